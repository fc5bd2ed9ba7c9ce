"""A stage's way through a step of one token of one sequence, over plain tensors (pure torch).

A lone stream decodes one token a step, and on CPU most of such a step is the weights streaming
through the caches. Between two of its matrix products the step's Python runs cold, so every
module call and attribute lookup costs several times what it costs in a loop: through the
modules, SmolLM2's 30 layers took 46-54 ms a token where the same products and operations on
plain tensors took 40-47 (two threads, AMD EPYC, interleaved). `RowPath` is that second way:
the math of `DecoderLayer` and of the head, written once more for one row, over each layer's
weights as a single row multiplies them (`RowWeight`: on several threads, blocks of the output
columns, so that each thread streams its own part of a weight; layouts.py says what it measured).
The module path stays the reference: tests/test_model_core.py checks both give the same logits.
A layer's rotary, KV writes and attention go through the compiled kernels where they serve
(step_kernels.py: two calls a layer), else through torch's operations below. Where every product
is the FMA blocks' and the kernels' norms serve, the layers are one call (layer_stack.py: the same
calls in C; SmolLM2's 29 layers on an Intel Xeon without AMX, bfloat16 10.6 -> 8.4 ms, float32
19.9 -> 16.6).

It serves a step when the layouts offer every layer's row weight, on one rank (the path has no
collectives), for a token whose context is one run of cache slots (`StepLayout.decode_slots`);
`__call__` returns None otherwise and the modules run.

Knows the model's module names and math, nothing of checkpoints, of the engine or the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .fused import norm_kernel, silu_kernel
from .kv_cache import PagedKVCache, StepLayout
from .layer_stack import LayerStack
from .llama import DecoderLayer, StageModel, decode_attention, rms_norm
from .row_kernel import bind as bind_row_kernel
from .step_kernels import bind
from .tiles import bound_product, is_packed

# How a single row multiplies a linear layer: (w, b) with y = (x @ w).view(1, -1) + b for x [1, in]
# (`row_product`), or, where w is a packed weight (oneDNN's, the AMX tiles' or fma_blocks', `tiles.is_packed`),
# x W^T + b as the modules multiply it (`RowMultiply` binds it: tiles.bound_product).
# A linear layer that offers `row_weight(threads) -> RowWeight | None` (the CPU layouts of
# layouts.py do), or its own `row_products()` (quantize's Int8Linear and Int4Linear: their kernels), can be on the path.
RowWeight = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class RowMultiply:
    """A single row's product by one `RowWeight` and that product added onto a residual, decided
    once, when a plan is made: a packed weight's bound with its checks made (tiles.bound_product);
    a plain float32 one's through the compiled kernel where it serves (row_kernel.py: on CPUs
    where MKL's products of a row are slow), else through `row_product` and `row_add_product`."""

    product: Callable[[torch.Tensor], torch.Tensor]  # x -> x W^T + b
    add_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (residual, x) -> residual + x W^T + b

    @classmethod
    def of(cls, weight: RowWeight) -> RowMultiply:
        w, b = weight
        if is_packed(w):
            product = bound_product(w, b)
            return cls(product, lambda residual, x: product(x).add_(residual))
        kernel = bind_row_kernel(w, b)
        if kernel is not None:
            return cls(*kernel)
        return cls(lambda x: row_product(x, weight), lambda residual, x: row_add_product(residual, x, weight))


silu = torch._C._nn.silu  # F.silu's kernel, without its Python wrapper


def row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a single row x [1, hidden]: its mean square read out as a number, then two
    products, where `rms_norm` runs half a dozen small kernels (pow, mean, add, rsqrt and the
    products). The same numbers to rounding: the scale is computed in double and rounded once. A
    lone stream's step of SmolLM2's 30 layers, one process, two threads (Intel Xeon, AVX-512), 2
    runs of 12 interleaved rounds: 27.4 against 28.2 ms.

    In half precision the row is normalized in float32, cast, then scaled, the order `rms_norm`
    and transformers use: multiplying the half-precision row by the scale computes in float32 and
    rounds once, the numbers of a float32 copy scaled and cast, one kernel fewer (a bfloat16 step,
    one process, two threads, Intel Xeon with AMX, two runs of 12 interleaved rounds: 18.9 and
    21.4 against 19.5 and 21.7 ms, the same logits).

    Where the compiled RMSNorm serves (fused.py), it runs instead: one call, and torch's numbers
    to the bit."""
    kernel = norm_kernel()
    if kernel is not None and kernel.takes_norm(x, weight):
        return kernel.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 == weight.dtype:
        mean_square = float(torch.dot(x[0], x[0])) / x.shape[1]
        return torch.mul(x, weight).mul_(1.0 / math.sqrt(mean_square + eps))
    if x.dtype != weight.dtype:
        return rms_norm(x, weight, eps)
    wide = x[0].float()
    mean_square = float(torch.dot(wide, wide)) / x.shape[1]
    return weight * torch.mul(x, 1.0 / math.sqrt(mean_square + eps))


def rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding at one position as a matrix: `x @ rotation(cos, sin)` is
    `x * cos + swap_halves(x) * sin` for rows x [n, d], with cos and the signed sin [1, d] as
    `StageModel.rope` makes them. One product a layer instead of five elementwise kernels; the same
    numbers to rounding (each output sums two products and zeros)."""
    d = cos.shape[-1]
    rot = torch.diag(cos.view(d))  # [d, d]
    rot[(torch.arange(d) + d // 2) % d, torch.arange(d)] = sin.view(d)
    return rot


def rotary(cos: torch.Tensor, sin: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rotary embedding at one position for rows qk [n, d], with cos and the signed sin [1, d]:
    in float32 one product with `rotation(cos, sin)`; in half precision the modules' elementwise
    kernels in their order (rolling by half a head is `swap_halves`), the same numbers as they
    give. A half-precision matrix product this small ran at 16 us hot and 33 us in a step; SmolLM2's
    lone-token step in bfloat16, one process, two threads (Intel Xeon, AMX), 15 interleaved rounds
    of 4 steps: 22.9 against 23.7 ms. In float32 the product stays the faster (26.7 against 27.0)."""
    if cos.dtype == torch.float32:
        rot = rotation(cos, sin)  # [d, d]
        return lambda qk: qk @ rot
    half = cos.shape[-1] // 2
    return lambda qk: qk * cos + qk.roll(half, -1) * sin


def row_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of one row gate_up [1, 2 w]: the compiled kernel's call where it serves
    (fused.py), else the modules' two kernels on slices (no chunk)."""
    kernel = silu_kernel(gate_up.shape[1] // 2)
    if kernel is not None and kernel.takes_silu(gate_up):
        return kernel.silu_mul(gate_up)
    width = gate_up.shape[1] // 2  # [gate | up]
    return silu(gate_up[:, :width]).mul_(gate_up[:, width:])


def row_add_product(residual: torch.Tensor, x: torch.Tensor, weight: RowWeight) -> torch.Tensor:
    """residual + x W^T for single rows residual [1, out], x [1, in], in one kernel where the
    weight has no bias (the product adds onto the residual), else as `residual + row_product`."""
    w, b = weight
    if b is not None:
        return row_product(x, weight).add_(residual)
    if w.dim() == 2:  # [in, out]
        return torch.addmm(residual, x, w)
    blocks = w.shape[0]  # [blocks, in, out / blocks]: the residual's columns block after block
    return torch.baddbmm(residual.view(blocks, 1, -1), x.expand(blocks, 1, x.shape[1]), w).view(1, -1)


def row_product(x: torch.Tensor, weight: RowWeight) -> torch.Tensor:
    """x W^T + b for a single row x [1, in]: [1, out]. The weight is plain: [in, out], or output
    blocks [blocks, in, out / blocks], whose batched product is [1, out] in memory (a packed one
    goes through `RowMultiply`)."""
    w, b = weight
    y = torch.matmul(x, w).view(1, -1)
    return y if b is None else y + b


@dataclass(frozen=True)
class _RowLayer:
    """A decoder layer's weights as a single row uses them: plain tensors, so that a step reads
    no module attribute and calls no module."""

    layer_id: int
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: RowMultiply
    o: RowMultiply
    gate_up: RowMultiply
    down: RowMultiply


@dataclass(frozen=True)
class _RowPlan:
    layers: tuple[_RowLayer, ...]
    head: RowMultiply | None  # how a single row multiplies the LM head, on the last stage
    norm: torch.Tensor | None  # the final norm's weight on the last stage
    norm_dtype: torch.dtype | None  # of every layer's norm weights, where they share one


class RowPath:
    """`StageModel.row_path`: a step of one token over plain tensors, its plans made once per
    thread count (a plan holds views of the model's weights, no copies)."""

    def __init__(self, model: StageModel) -> None:
        self.model = model
        self._plans: dict[int, _RowPlan | None] = {}
        self.stack = LayerStack.of(model)  # where the FMA blocks serve every product: the layers in one call

    def plan(self, threads: int) -> _RowPlan | None:
        """The layers' and the head's row weights on `threads` threads; None unless every linear
        layer offers its row weight and the model has one rank."""
        if threads not in self._plans:
            self._plans[threads] = self._make(threads)
        return self._plans[threads]

    def _make(self, threads: int) -> _RowPlan | None:
        model = self.model
        if model.tp.size != 1:
            return None
        layers = [_row_layer(layer, threads) for layer in model.layers.values()]
        head = _row_multiply(model.lm_head, threads) if model.lm_head is not None else None
        if any(layer is None for layer in layers) or (model.lm_head is not None and head is None):
            return None
        norm = model.norm.weight.detach() if model.norm is not None else None
        planned = tuple(layer for layer in layers if layer is not None)
        dtypes = {w.dtype for layer in planned for w in (layer.input_norm, layer.post_attention_norm)}
        return _RowPlan(planned, head, norm, dtypes.pop() if len(dtypes) == 1 else None)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
        threads: int,
        argmax_only: bool = False,
    ) -> torch.Tensor | None:
        """The layers (and head) for one token whose context is the cache slots `layout.decode_slots`,
        the new token's last. x [1, hidden]; cos, sin [1, 1, head_dim]. Returns what
        `StageModel.forward` returns (with `argmax_only`, through the head's screen where it serves),
        or None where this path cannot serve (no plan)."""
        plan = self.plan(threads)
        slots = layout.decode_slots
        if plan is None or slots is None:
            return None
        model = self.model
        h, kvh = model.shards.num_heads, model.shards.num_kv_heads
        d, eps = model.config.head_dim, model.config.rms_norm_eps
        # The compiled kernels' rotary, writes and attention where they serve (step_kernels.py),
        # and their RMSNorm and SiLU called without the wrappers' checks where those serve too;
        # else torch's operations, with this position's rotary made once for every layer.
        pool = cache.k[plan.layers[0].layer_id]  # a stage holds a layer or more (LayerRange.check)
        kernels = bind(layout, cos, sin, pool=pool, heads=h, silu_width=model.shards.intermediate)
        rotate = rotary(cos[0], sin[0]) if kernels is None else None
        norm, silu_mul, compiled = row_norm, row_silu_mul, False
        if kernels is not None and kernels.norms and x.dtype == plan.norm_dtype:
            norm, silu_mul, compiled = kernels.norm, kernels.silu, True
        new = slots.stop - 1  # the new token's slot
        layers = plan.layers
        normed = None  # the final norm, where the stack makes it
        if self.stack is not None and kernels is not None and compiled:  # the same math in C (layer_stack.py)
            if self.stack.final_norm is not None:  # a last stage's
                x, normed = self.stack.normed(x.contiguous(), kernels, cache)
            else:
                x = self.stack(x.contiguous(), kernels, cache)
            layers = ()
        # Slices and views rather than split, chunk and transposes: each call after a product runs
        # cold, and these are most of a layer's calls (a step in bfloat16 20.4-20.6 against
        # 21.0-21.4 ms, float32 25.0 against 26.0; one process, two threads, Intel Xeon with AMX).
        for layer in layers:
            qkv = layer.qkv.product(norm(x, layer.input_norm, eps))  # [1, (h + 2 kvh) d]
            if kernels is not None:
                x = layer.o.add_product(x, kernels.attend(qkv, cache.k[layer.layer_id], cache.v[layer.layer_id]))
            else:
                assert rotate is not None
                qkv = qkv.view(h + 2 * kvh, d)
                qk = rotate(qkv[: h + kvh])  # as in Attention: [h + kvh, d]
                cache.k[layer.layer_id][new].copy_(qk[h:])
                cache.v[layer.layer_id][new].copy_(qkv[h + kvh :])
                keys = cache.k_heads[layer.layer_id][:, :, slots]  # [1, kvh, L, d], a view
                values = cache.v_heads[layer.layer_id][:, :, slots]
                x = layer.o.add_product(x, decode_attention(qk[:h].view(1, h, d), keys, values, mask=None))
            gate_up = layer.gate_up.product(norm(x, layer.post_attention_norm, eps))
            x = layer.down.add_product(x, silu_mul(gate_up))
        if plan.head is None:
            return x
        assert plan.norm is not None  # the last stage holds both
        x = normed if normed is not None else row_norm(x, plan.norm, eps)
        if (screened := model.screened(x, argmax_only)) is not None:  # a greedy row (head_screen.py)
            return screened
        logits = plan.head.product(x)  # [1, vocab padded]
        return logits[:, : model.config.vocab_size].float()


def _row_layer(layer: nn.Module, threads: int) -> _RowLayer | None:
    assert isinstance(layer, DecoderLayer), layer
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = (
        _row_multiply(m, threads) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    )
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return _RowLayer(
        layer.layer_id,
        layer.input_layernorm.weight.detach(),
        layer.post_attention_layernorm.weight.detach(),
        qkv,
        o,
        gate_up,
        down,
    )


def _row_multiply(module: nn.Module, threads: int) -> RowMultiply | None:
    """How a single row multiplies a linear layer: by its `row_weight(threads)` (see `RowWeight`),
    or through its own `row_products()` (quantize's int8 and int4 kernels); None where it offers neither."""
    row_products = getattr(module, "row_products", None)
    if row_products is not None:
        products = row_products()
        return None if products is None else RowMultiply(*products)
    row_weight = getattr(module, "row_weight", None)
    weight = None if row_weight is None else row_weight(threads)
    return None if weight is None else RowMultiply.of(weight)
