"""A stage's way through a step of decoding sequences only (one token each), over plain tensors.

Under load most steps are a decode batch: every sequence adds one token. Through the modules, a
layer is a dozen module calls and the kernel wrappers' checks, about 100 us of Python a layer
between the products (a 32-row step of SmolLM2's 30 layers, bfloat16, one process, 2 cores of an
Intel Xeon with AMX: 29 ms in the layers, of them 16 in the products and 9 in the kernels).
`DecodePath` runs the same math on the same tensors: the packed weights of each layer
(layouts.PackedLinear's `weight_packed`, oneDNN's, the AMX tiles' or fma_blocks': its
`several_rows`) multiplied directly, and
the compiled kernels bound once a step (step_kernels.py): the same calls in the same order as
the modules make, so the same numbers to the bit (tests/test_decode_path.py checks that).
Measured there, 10 interleaved rounds of 3 steps, the whole step: 32 rows bfloat16 33.1 -> 29.8
ms, float32 72.1 -> 67.7 ms; 8 rows 23.1 -> 19.9 and 41.3 -> 37.5 ms; the same tokens. Each
residual's sum and the norm after it are then one call (`StepKernels.add_norm`, split over the
threads from 8192 elements): in one process, 12 interleaved rounds of 3 steps against torch's
add and the norm apart, bfloat16 32 rows 39.1 -> 38.5 and 39.3 -> 37.8 ms, 16 rows 30.5 -> 29.8
and 30.2 -> 29.1 (the machine slower that day); float32 unchanged within its noise; the same
tokens. Where every product is the FMA blocks', the whole loop is one call (layer_stack.py: the
same calls in C; 32 rows of 29 layers on an Intel Xeon without AMX, bfloat16 51.4 -> 42.9 ms,
float32 47.7 -> 42.6).

It serves a step of two or more decode rows (`StepLayout.decode_only`: decoding sequences, and on
the CPU a prompt's rows too, kv_cache.plan_step's `token_rows`; a lone row is rows.py's)
on one rank (no collectives), where every linear layer of the stage is packed and the kernels
serve (compiled, their RMSNorm, SiLU and rotary torch's numbers); `__call__` returns None
otherwise and the modules run. The LM head stays the module's, and the final norm too where the
stack does not make it (`LayerStack.normed`).

Knows the model's module names and math, nothing of checkpoints, of the engine or the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .kv_cache import PagedKVCache, StepLayout
from .layer_stack import LayerStack
from .llama import DecoderLayer, StageModel
from .step_kernels import StepKernels, bind
from .tiles import is_packed

log = logging.getLogger(__name__)

# x -> x W^T + b by a packed weight (oneDNN's, the tiles' or fma_blocks') and its bias, as
# `PackedLinear.forward` computes it (`several_rows`), its checks made once.
Packed = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    layer_id: int
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Packed
    o: Packed
    gate_up: Packed
    down: Packed


class DecodePath:
    """`StageModel.decode_path`: a decode batch's step through plain tensors. `layers` is its plan,
    made once: every layer's norms and packed weights, or None (the path never serves) unless all
    are packed, their norms share a dtype and there is one rank."""

    def __init__(self, model: StageModel) -> None:
        self.model = model
        self.layers = _plan(model)
        self.stack = LayerStack.of(model) if self.layers else None  # the FMA blocks': the layers in one call
        if self.stack is not None:
            log.info("a decode step's %d layers: one call of the compiled kernels (layer_stack.py)", len(model.layers))

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
        logit_rows: torch.Tensor | None,
        argmax_only: bool = False,
    ) -> torch.Tensor | None:
        """The layers (and head) for a decode batch, x [D, hidden], cos and sin [D, 1, head_dim]:
        what `StageModel.forward` returns, or None where this path does not serve."""
        layers = self.layers
        if not layers or not layout.decode_only or layout.decode_slots is not None or x.shape[0] < 2:
            return None
        model, x = self.model, x.contiguous()
        eps = model.config.rms_norm_eps
        pool = cache.k[layers[0].layer_id]
        kernels = bind(layout, cos, sin, pool=pool, heads=model.shards.num_heads, silu_width=model.shards.intermediate)
        if kernels is None or not kernels.norms or x.dtype != kernels.dtype or layers[0].input_norm.dtype != x.dtype:
            return None  # every layer's norm weights share one dtype (`_plan`)
        normed = None  # the final norm of every row, where the stack makes it
        if self.stack is not None and self.stack.final_norm is not None:  # a last stage's
            x, normed = self.stack.normed(x, kernels, cache)  # the same calls on the same tensors, in C
        elif self.stack is not None:
            x = self.stack(x, kernels, cache)
        else:
            x = _layers(x, layers, kernels, cache, eps)
        if model.lm_head is None:
            return x
        assert model.norm is not None  # the last stage holds both
        if normed is None:
            normed = model.norm(x if logit_rows is None else x[logit_rows])
        elif logit_rows is not None:
            normed = normed[logit_rows]  # each row normalized alone: the same numbers either way
        x = normed
        if (screened := model.screened(x, argmax_only)) is not None:  # few greedy rows (head_screen.py)
            return screened
        logits = model.lm_head(x)  # [R, vocab padded]
        return logits[:, : model.config.vocab_size].float()


def _layers(
    x: torch.Tensor, layers: tuple[_Layer, ...], kernels: StepKernels, cache: PagedKVCache, eps: float
) -> torch.Tensor:
    """The residual after the last of `layers` for the rows x [D, hidden]. Each residual's sum and the
    norm after it in one call (`add_norm`): the modules' `x + y` and norm, to the bit: for SmolLM2's
    30 layers 61 calls (and adds) instead of 120."""
    normed = kernels.norm(x, layers[0].input_norm, eps)
    for i, layer in enumerate(layers):
        qkv = layer.qkv(normed)  # [D, (h + 2 kvh) d]
        attended = layer.o(kernels.attend(qkv, cache.k[layer.layer_id], cache.v[layer.layer_id]))
        x, normed = kernels.add_norm(x, attended, layer.post_attention_norm, eps)
        down = layer.down(kernels.silu(layer.gate_up(normed)))  # gate_up [D, 2 w]
        if i + 1 < len(layers):
            x, normed = kernels.add_norm(x, down, layers[i + 1].input_norm, eps)
        else:
            x = x + down
    return x


def _plan(model: StageModel) -> tuple[_Layer, ...] | None:
    if model.tp.size != 1:
        return None
    layers = [_layer(layer) for layer in model.layers.values()]
    planned = tuple(layer for layer in layers if layer is not None)
    dtypes = {t.dtype for layer in planned for t in (layer.input_norm, layer.post_attention_norm)}
    return planned if len(planned) == len(layers) and len(dtypes) == 1 else None


def _layer(layer: nn.Module) -> _Layer | None:
    assert isinstance(layer, DecoderLayer), layer
    attn, mlp = layer.self_attn, layer.mlp
    weights = [_packed(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    qkv, o, gate_up, down = weights
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    return _Layer(layer.layer_id, *norms, qkv, o, gate_up, down)


def _packed(module: nn.Module) -> Packed | None:
    """A `layouts.PackedLinear`'s product of several rows (`several_rows`: by its packed weight and
    bias); None for any other layer."""
    weight, several = getattr(module, "weight_packed", None), getattr(module, "several_rows", None)
    if not isinstance(weight, torch.Tensor) or not is_packed(weight) or several is None:
        return None
    return several()
