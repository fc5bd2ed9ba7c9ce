"""A decode step's decoder layers in one call of the compiled kernels (kernels/layers.c).

Where every product of a stage's layers is fma_blocks' (the FMA blocks), a step's layers need no
Python between their kernels: decode_path.py's loop (a decode batch) and rows.py's (a lone row)
make nine C calls a layer, and between two of them check the tensors they hand on, make the next
output and read its address. Measured in one process on 2 cores of an Intel Xeon without AMX
(SmolLM2's 30 layers, the kernels timed around their calls): a lone bfloat16 row's 15.1 ms step
spent 9.7 ms in the products, 1.4 in the other kernels and about 2.4 in the Python around them; a
32-row float32 step of 65 ms, 4 ms in that Python. layers.c makes the decode batch's calls, on the
same arguments, in the same order; rows.py's residual sum (torch's add) and the norm after it are
one call there, the residual's sum and norm kernel that gives torch's numbers to the bit (fused.py
checks that before the kernels serve). So a step's numbers are the loops' to the bit
(tests/test_layer_stack.py checks both paths against it).

Owns `LayerStack`: made once for a stage's model (`of`): None unless it has one rank and each of
its layers' four products is an `fma_blocks.BoundBlocks` of one dtype, their norms of that dtype.
A call takes the step's bound kernels (step_kernels.StepKernels, where their RMSNorm and SiLU
serve), checks what the C will read against them (the rows, each layer's pools, whose addresses
it reads at each call; the weights' it read once), and returns the residual after the last
layer: what the loops return before the final norm and the head; `normed` returns it with the
final norm of it, made in the same call where the stage holds the head (`final_norm`).

Knows a Llama layer's order of operations and the C's arguments; nothing of checkpoints, of the
engine or the network.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .fma_blocks import BoundBlocks
from .kv_cache import PagedKVCache
from .llama import DecoderLayer, StageModel
from .step_kernels import StepKernels

ALIGN = 64  # bytes: each scratch buffer starts on a cache line
_Checked = tuple["weakref.ref[PagedKVCache]", tuple[int, int, int], list[int], "ctypes.Array[ctypes.c_void_p]"]


@dataclass(frozen=True)
class _Layer:
    layer_id: int
    # In layers.c's order, without the pools: input norm, qkv and its bias, o and its bias, the
    # post-attention norm, gate_up and its bias, down and its bias. Held, as views of the stack's
    # own: the C reads them.
    tensors: tuple[torch.Tensor | None, ...]
    products: tuple[tuple[int, int], ...]  # (out, in) of qkv, o, gate_up and down


class LayerStack:
    """`of(model)`: the stage's layers as layers.c runs them, or None where it cannot."""

    def __init__(self, model: StageModel, layers: Sequence[_Layer], dtype: torch.dtype) -> None:
        shards, config = model.shards, model.config
        self._layers, self._dtype, self._eps = tuple(layers), dtype, config.rms_norm_eps
        self._hidden, self._intermediate = config.hidden_size, shards.intermediate
        self._heads, self._kv_heads, self._head_dim = shards.num_heads, shards.num_kv_heads, config.head_dim
        h, kvh, d, w = self._heads, self._kv_heads, self._head_dim, self._intermediate
        self._bound_for = {"heads": h, "SiLU width": w, "KV heads": kvh, "head_dim": d}  # a step's kernels'
        self._bound_values = tuple(self._bound_for.values())
        # Scratch, in elements: [rows, hidden] x 4, [rows, (h + 2 kvh) d], [rows, h d] x 2, [rows, 2 w], [rows, w].
        self._widths = (self._hidden,) * 4 + ((h + 2 * kvh) * d, h * d, h * d, 2 * w, w)
        norm = model.norm.weight.detach() if model.norm is not None and model.lm_head is not None else None
        fits = norm is not None and norm.dtype == dtype and norm.shape == (self._hidden,) and norm.is_contiguous()
        self.final_norm = norm if fits else None  # the stage's final norm, where `normed` can make it
        # Each layer's tensors' addresses, in layers.c's order: read once (`_addresses`)
        self._weights = tuple(tuple(t.data_ptr() if t is not None else None for t in layer.tensors) for layer in layers)
        # The cache, pool shape and pools' addresses last checked, and the C array
        self._checked: _Checked | None = None
        self._scratch: tuple[int, torch.Tensor, ctypes.Array[ctypes.c_void_p]] | None = None  # rows, buffer, C array

    @classmethod
    def of(cls, model: StageModel) -> LayerStack | None:
        if model.tp.size != 1 or not model.layers:
            return None
        layers = [_layer(layer) for layer in model.layers.values()]
        planned = [layer for layer in layers if layer is not None]
        if len(planned) != len(layers):
            return None
        dtypes = {t.dtype for layer in planned for t in layer.tensors if t is not None}
        if len(dtypes) != 1:
            return None
        stack = cls(model, planned, dtypes.pop())
        return stack if all(stack._fits(layer) for layer in planned) else None

    def _fits(self, layer: _Layer) -> bool:
        """Its products' shapes and its norms' the model's: what layers.c takes for granted."""
        h, kvh, d, w, hidden = self._heads, self._kv_heads, self._head_dim, self._intermediate, self._hidden
        shapes = ((h + 2 * kvh) * d, hidden), (hidden, h * d), (2 * w, hidden), (hidden, w)
        norms = [layer.tensors[i] for i in (0, 5)]
        return layer.products == shapes and all(
            n is not None and n.shape == (hidden,) and n.is_contiguous() for n in norms
        )

    def __call__(self, x: torch.Tensor, kernels: StepKernels, cache: PagedKVCache) -> torch.Tensor:
        """The residual after the last layer for the step's rows x [rows, hidden]: ValueError,
        naming what differs, where the step's kernels, the rows or a pool are not the stack's."""
        return self._run(x, kernels, cache, None)

    def normed(self, x: torch.Tensor, kernels: StepKernels, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual after the last layer and the stage's final norm of it (`StageModel.norm`'s
        numbers, to the bit: the kernel the model's norm calls), in one call; ValueError as the call
        says, and where the stack has no `final_norm`."""
        if self.final_norm is None:
            raise ValueError("this stack has no final norm: its stage holds no head, or a norm of another dtype")
        normed = torch.empty_like(x)
        return self._run(x, kernels, cache, normed), normed

    def _run(
        self, x: torch.Tensor, kernels: StepKernels, cache: PagedKVCache, normed: torch.Tensor | None
    ) -> torch.Tensor:
        bound, rows = kernels.bound, kernels.rows
        if not kernels.norms or kernels.dtype != self._dtype:
            raise ValueError(
                f"the step's kernels: {kernels.dtype}, norms {kernels.norms}; the stack takes "
                f"{self._dtype} with the kernels' norms"
            )
        if (bound.heads, bound.silu_width, *bound.pool[1:]) != self._bound_values:
            theirs = dict(zip(self._bound_for, (bound.heads, bound.silu_width, *bound.pool[1:]), strict=True))
            raise ValueError(f"the step's kernels were bound for {theirs}, the stack's layers have {self._bound_for}")
        if x.shape != (rows, self._hidden) or x.dtype != self._dtype or not x.is_contiguous() or not x.is_cpu:
            raise ValueError(f"rows {list(x.shape)} {x.dtype}: the stack takes [{rows}, {self._hidden}] {self._dtype}")
        pointers = self._addresses(cache, bound.pool)  # first: a pool it refuses is never read
        out = torch.empty_like(x)
        final: tuple[int | None, int | None] = (None, None)  # the final norm's weight and output, where made
        if normed is not None and self.final_norm is not None:
            final = (self.final_norm.data_ptr(), normed.data_ptr())
        dims = (ctypes.c_int64 * 8)(rows, self._hidden, self._heads, self._kv_heads, self._head_dim)
        dims[5:] = [self._intermediate, bound.width, bound.block]
        failed = bound.functions["blocks_layers"](
            len(self._layers),
            pointers,
            dims,
            (ctypes.c_void_p * 5)(*bound.addresses),
            self._scratch_for(rows),
            self._dtype == torch.bfloat16,
            self._eps,
            self._head_dim**-0.5,
            torch.get_num_threads(),
            bound.threads,
            x.data_ptr(),
            out.data_ptr(),
            *final,
        )
        if failed:
            what = "scores of the attention" if failed > 0 else "a product's widened rows"
            raise MemoryError(f"the layers' kernels had no memory for the {what} of {rows} rows")
        return out

    def _scratch_for(self, rows: int) -> ctypes.Array[ctypes.c_void_p]:
        """The C's scratch buffers for `rows` rows, each on a cache line of its own: the last call's
        again for as many rows (a stack runs one step at a time: its stage's compute thread)."""
        if self._scratch is None or self._scratch[0] != rows:
            self._scratch = None  # the last one freed before the next is made
            size = torch.finfo(self._dtype).bits // 8
            offsets, total = [], 0
            for width in self._widths:
                offsets.append(total)
                total += -(-rows * width * size // ALIGN) * ALIGN // size
            scratch = torch.empty(total, dtype=self._dtype)
            addresses = (ctypes.c_void_p * len(offsets))(*(scratch.data_ptr() + o * size for o in offsets))
            self._scratch = (rows, scratch, addresses)
        return self._scratch[2]

    def _addresses(self, cache: PagedKVCache, pool: tuple[int, int, int]) -> ctypes.Array[ctypes.c_void_p]:
        """Every layer's tensors' addresses and then its two pools', in layers.c's order. The weights'
        are read once: the stack holds views of its own (`_layer`) of buffers a stage never replaces
        (layouts.py's packed weights), whose storage no other code can swap; the pools' at each
        call (a cache's pools can be swapped): a lone row's step read all of them again (180 of the
        weights and 60 of the pools for SmolLM2) in 0.2 ms of 25, its caches cold. The pools are
        checked against `pool`, the step's, when a cache, a pool shape or an address is first seen,
        not at every step; the C array is the last call's where nothing changed."""
        k, v = cache.k, cache.v
        pools = [p for layer in self._layers for p in (k[layer.layer_id].data_ptr(), v[layer.layer_id].data_ptr())]
        last = self._checked
        if last is None or last[0]() is not cache or last[1] != pool or last[2] != pools:
            for layer in self._layers:
                for p in (k[layer.layer_id], v[layer.layer_id]):
                    if p.shape != pool or p.dtype != self._dtype or not p.is_contiguous() or not p.is_cpu:
                        raise ValueError(
                            f"layer {layer.layer_id}'s pools are {list(p.shape)} {p.dtype} on {p.device}, not "
                            f"the contiguous {list(pool)} {self._dtype} on the CPU the step bound"
                        )
            weights = self._weights
            pointers = [a for i, w in enumerate(weights) for a in (*w, pools[2 * i], pools[2 * i + 1])]
            last = (weakref.ref(cache), pool, pools, (ctypes.c_void_p * len(pointers))(*pointers))
            self._checked = last
        return last[3]


def _layer(layer: nn.Module) -> _Layer | None:
    assert isinstance(layer, DecoderLayer), layer
    attn, mlp = layer.self_attn, layer.mlp
    products: list[torch.Tensor | None] = []
    shapes: list[tuple[int, int]] = []
    for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        several = getattr(module, "several_rows", None)
        bound = several() if several is not None else None
        if not isinstance(bound, BoundBlocks):
            return None
        weight, bias, out, fan_in = bound.parts  # held as views of the stack's own (`_addresses`)
        products += [weight.detach(), None if bias is None else bias.detach()]
        shapes.append((out, fan_in))
    norms = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
    return _Layer(layer.layer_id, (norms[0], *products[:4], norms[1], *products[4:]), tuple(shapes))
