"""Weight-only quantized linear layers (`--quantize int8 | int4`), built once from a loaded layer.

- `Int8Linear`: each output channel's weights as int8 with one scale, W ~ q * scale (symmetric,
  per output channel); the product runs in torch's `_weight_int8pack_mm`, or for a step of many
  rows on CPU as a product with the codes made bfloat16 (or float32), scaled after; fewer rows of
  a float32 model go through the compiled int8 kernel where it serves (`row_products`).
- `Int4Linear`: each group of INT4_GROUP input weights of an output channel as 4-bit codes with
  a scale and an offset, W ~ (q - 8) * scale + zero (asymmetric, groupwise); the product runs in
  `_weight_int4pack_mm_for_cpu` on CPU and `_weight_int4pack_mm` on CUDA; fewer than 4 rows of a
  float32 model go through the compiled int4 kernel where it serves (`row_products`, int4_rows.py).

Activations enter both of torch's kernels as bfloat16 and the result is cast back to the model's dtype:
on CPU these kernels are vectorized (AVX-512, AVX2) only for bfloat16 and float16 inputs, and
float16 runs the scalar loop of the int8 one. Measured on an Intel Xeon with AVX-512 (one
thread, the 121 products of one token of SmolLM2-135M), a float32 input makes the int8 kernel
6x (one row) to 70x (32 rows) and the int4 one 13x to 140x slower than float32 matmuls; in
bfloat16 one row is 1.5x (int8) and 2x (int4) faster, 32 rows 2x and 1.6x slower. The CUDA
int4 kernel takes bfloat16 only.

`Int8Embedding` keeps the token embedding in int8 as well (a lookup, no kernel).

Scales and offsets are kept in bfloat16 (what the kernels read), and the codes are chosen
against those rounded values, so `dense()` is exactly the weight the kernels multiply by.

Knows nothing of the model's structure (layouts.py chooses which layers to convert), of
checkpoints, of the network or of the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerline.shared.cpu import cpu_flags, is_x86

from .int4_rows import KERNEL_ROWS as INT4_KERNEL_ROWS
from .int4_rows import bind_int4
from .parallel import TensorParallel
from .row_kernel import RowProducts, bind_int8

INT4_GROUP = 32  # input weights sharing one int4 scale and offset (the kernels take 32, 64, 128 or 256)
INT4_ROWS = 16  # the CPU int4 kernel packs output channels in blocks of this many (padded up to it)
INT4_INNER_K_TILES = 2  # the CUDA kernel's tiling of the input dimension (2, 4 or 8)
KERNEL_DTYPE = torch.bfloat16  # the activations' and scales' dtype inside the kernels (see above)


def _dequantized_rows() -> tuple[int, torch.dtype]:
    """From how many rows on a CPU int8 layer multiplies by its weight dequantized for the step,
    and in which dtype. Below that (and below 32 rows) a float32 model's rows go through the
    compiled int8 kernel where it serves (row_kernel.bind_int8: on AVX-512 it reads the codes once
    for up to 4 rows at a time, on AVX2 once a row from the first-level cache after the first; the
    30 layers' products on 2 cores of an AMD EPYC Zen 4, ms, against `_weight_int8pack_mm`: 1 row
    4.9 against 11.7, 2 rows 5.9 / 13.4, 4 rows 9.3 / 15.9, 8 rows 13.0 / 23.1, 16 rows 24.7 / 36.4,
    32 rows 58.8 / 68.2, where the codes made bfloat16 and multiplied by oneDNN took 44), else
    through `_weight_int8pack_mm`, which computes one row at a time: on an Intel Xeon with
    AMX, SmolLM2's gate_up ([3072, 576], one thread) took 0.78, 3.1 and 12.0 ms at 16, 64 and 256
    rows, and the codes made bfloat16 (exact: |code| <= 128) and multiplied by oneDNN then scaled
    0.72, 0.99 and 1.9 ms (float32 itself 0.52, 1.5 and 5.4); at one row 0.11 against 0.57. Where
    the CPU has no bfloat16 instructions the weight is made float32 instead, which beat the kernel
    from about 100 rows on (an AVX-512 Xeon without them, one thread, 256 rows: 8.5 ms against 15.7)."""
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dequantized_rows(onednn_bfloat16=onednn, x86=is_x86(), flags=cpu_flags())


def dequantized_rows(*, onednn_bfloat16: bool, x86: bool, flags: frozenset[str]) -> tuple[int, torch.dtype]:
    """`_dequantized_rows` of a machine: where oneDNN multiplies bfloat16 and the CPU has the
    instructions for it, from 32 rows on in bfloat16; else from 128 in float32. oneDNN says it
    multiplies bfloat16 on any AVX-512 CPU and emulates the instructions where they are missing:
    on 2 cores of an Intel Xeon without them (family 6 model 106), gate_up, down, qkv and o of one
    SmolLM2 layer at 32, 64, 128 and 256 rows took 5.9, 11.0, 20.2 and 36.1 ms that way, 4.4, 4.5,
    7.1 and 11.5 ms in float32, 2.6, 4.7, 9.8 and 19.6 ms through `_weight_int8pack_mm`. So on x86
    the CPU's flags (as Linux lists them; none where unknown) decide: AVX512_BF16 or AMX's
    bfloat16. Elsewhere oneDNN's word."""
    if onednn_bfloat16 and (not x86 or {"avx512_bf16", "amx_bf16"} & flags):
        return 32, torch.bfloat16
    return 128, torch.float32


DEQUANTIZED_ROWS, DEQUANTIZED_DTYPE = _dequantized_rows()
KERNEL_ROWS = 32  # the compiled int8 kernel takes fewer rows than this and DEQUANTIZED_ROWS (see above)


class QuantizeError(ValueError):
    """A layer whose shape the chosen quantization cannot take."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [out, in] and bfloat16 scales [out] with weight ~ codes * scales[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE)  # [out]
    codes = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)  # [out, in]
    return codes, scales


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 codes [out, in] in 0..15 and bfloat16 scales and zeros [in / group, out, 2] with
    weight[o, g * group + j] ~ (codes[o, g * group + j] - 8) * scales[g, o, 0] + scales[g, o, 1]."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise QuantizeError(f"int4 needs an input width that is a multiple of {group}, got {in_features}")
    w = weight.detach().float().reshape(out_features, in_features // group, group)  # [out, groups, group]
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE).float()
    zero = (low + 8 * scale).to(KERNEL_DTYPE).float()  # the value of code 8
    codes = torch.round((w - zero) / scale + 8).clamp(0, 15).to(torch.int32)  # [out, groups, group]
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return codes.reshape(out_features, in_features), scales_and_zeros.to(KERNEL_DTYPE)


def _dense_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 [out, in] weight that int4 `codes` and `scales_and_zeros` stand for."""
    out_features, in_features = codes.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
    grouped = codes.reshape(out_features, in_features // group, group).float()  # [out, groups, group]
    return ((grouped - 8) * sz[..., :1] + sz[..., 1:]).reshape(out_features, in_features)


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel: W = weight_int8 * scales[:, None]."""

    weight_int8: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bfloat16
    bias: torch.Tensor | None  # [out], the model's dtype

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        codes, scales = quantize_int8(weight)
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype  # the activations' (the model's)
        self.register_buffer("weight_int8", codes)  # [out, in]
        self.register_buffer("scales", scales)  # [out], bfloat16
        self.register_buffer("bias", None if bias is None else bias.detach())

    def row_products(self) -> RowProducts | None:
        """(product, add_product) of rows of a float32 model through the compiled kernel
        (row_kernel.bind_int8: the float32 rows times the codes, each output scaled once, where
        torch's kernel takes the rows rounded to bfloat16), or None where it does not serve: then
        rows.RowPath leaves a lone row's step to the modules, and `forward` calls torch's kernel."""
        if not hasattr(self, "_products"):
            codes, scales, bias = self.weight_int8, self.scales, self.bias
            assert isinstance(codes, torch.Tensor) and isinstance(scales, torch.Tensor)
            serves = self.dtype == torch.float32 and codes.is_cpu
            self._products = (
                bind_int8(codes, scales, bias if isinstance(bias, torch.Tensor) else None) if serves else None
            )
        return self._products

    def dense(self) -> torch.Tensor:
        """The float32 [out, in] weight the kernel multiplies by."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= DEQUANTIZED_ROWS and x.device.type == "cpu":  # many rows: see `_dequantized_rows`
            codes = self.weight_int8.to(DEQUANTIZED_DTYPE)  # [out, in], exact
            y = (F.linear(x.to(DEQUANTIZED_DTYPE), codes) * self.scales.to(DEQUANTIZED_DTYPE)).to(x.dtype)
        elif (
            x.is_cpu and x.dtype == torch.float32 and 0 < x.shape[0] < KERNEL_ROWS and (products := self.row_products())
        ):
            return products[0](x)  # fewer rows: see `_dequantized_rows`; the bias is the kernel's
        else:  # the kernel needs scales of the input's dtype (another dtype crashes it on CPU)
            y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.weight_int8, self.scales).to(x.dtype)
        return y + self.bias if self.bias is not None else y


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit codes, groups of INT4_GROUP inputs sharing a scale and an
    offset (see `quantize_int4`), packed once into the kernel's layout. The output channels are
    padded with zero weights up to a multiple of INT4_ROWS and the padding cut off each product."""

    weight_int4: torch.Tensor  # the kernel's packed layout of [padded out, in] 4-bit codes
    scales_and_zeros: torch.Tensor  # [in / INT4_GROUP, padded out, 2] bfloat16
    bias: torch.Tensor | None  # [out], the model's dtype

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype  # the activations' (the model's)
        padded = -(-self.out_features // INT4_ROWS) * INT4_ROWS
        weight = torch.nn.functional.pad(weight.detach(), (0, 0, 0, padded - self.out_features))  # [padded, in]
        codes, scales_and_zeros = quantize_int4(weight)
        self.on_cuda = weight.device.type == "cuda"
        if self.on_cuda:  # the CUDA packer takes two codes a byte, the first in the high half
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), INT4_INNER_K_TILES
            )
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, padded, 2], bfloat16
        self.register_buffer("bias", None if bias is None else bias.detach())

    def dense(self) -> torch.Tensor:
        """The float32 [out, in] weight the codes stand for, (q - 8) * scale + offset, unpacked by
        multiplying the identity: on CPU in float32 (torch's kernel takes float32 rows with float32
        scales: exact), on CUDA in bfloat16 (rounded)."""
        if not self.on_cuda:
            eye, sz = torch.eye(self.in_features), self.scales_and_zeros.float()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, INT4_GROUP, sz)
            return y.t()[: self.out_features].contiguous()
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE, device=self.weight_int4.device)
        return self._product(eye).float().t()[: self.out_features].contiguous()

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in bfloat16 for a bfloat16 `x`: [rows, out] (padding cut off)."""
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x, self.weight_int4, INT4_GROUP, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_int4, INT4_GROUP, self.scales_and_zeros)
        return y[:, : self.out_features]

    def row_products(self) -> RowProducts | None:
        """(product, add_product) of rows of a float32 model through the compiled kernel
        (int4_rows.bind_int4: the float32 rows times the codes where they lie, where torch's
        kernel takes the rows rounded to bfloat16), or None where it does not serve. Bound at first
        use to the buffers as loaded (a stage never replaces or moves them)."""
        if not hasattr(self, "_products"):
            packed, sz, bias = self.weight_int4, self.scales_and_zeros, self.bias
            assert isinstance(packed, torch.Tensor) and isinstance(sz, torch.Tensor)
            serves = self.dtype == torch.float32 and not self.on_cuda
            bias = bias if isinstance(bias, torch.Tensor) else None
            self._products = bind_int4(packed, sz, bias, self.out_features) if serves else None
        return self._products

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.is_cpu
            and x.dtype == torch.float32
            and 0 < x.shape[0] < INT4_KERNEL_ROWS
            and (products := self.row_products())
        ):
            return products[0](x)  # the bias is the kernel's
        y = self._product(x.to(KERNEL_DTYPE)).to(x.dtype)
        return y + self.bias if self.bias is not None else y


class Int8Embedding(nn.Module):
    """This rank's rows [start, start + rows) of the token embedding, each row int8 with one scale
    (`quantize_int8`: a row of the embedding is an output channel of a tied head); ids outside
    them embed to zero and the ranks' rows are summed, as in llama.py's VocabParallelEmbedding.
    A lookup reads one row a token, so this saves memory, not time: 1/4 of float32's bytes."""

    weight_int8: torch.Tensor  # [rows, hidden] int8
    scales: torch.Tensor  # [rows] bfloat16

    def __init__(self, weight: torch.Tensor, *, start: int, tp: TensorParallel) -> None:
        super().__init__()
        codes, scales = quantize_int8(weight)
        self.register_buffer("weight_int8", codes)
        self.register_buffer("scales", scales)
        self.start, self.tp, self.dtype = start, tp, weight.dtype

    def dense(self) -> torch.Tensor:
        """The float32 [rows, hidden] weight the lookups return rows of."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (each in [0, rows)): codes times scale, exact in float32, then the model's dtype."""
        return (F.embedding(ids, self.weight_int8).float() * self.scales[ids, None].float()).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight_int8.shape[0])  # [T]
        x = self._rows(local.clamp(0, self.weight_int8.shape[0] - 1)) * mine[:, None]
        return self.tp.all_reduce(x)  # [T, hidden]


QUANTIZED_LINEARS: dict[str, type[Int8Linear] | type[Int4Linear]] = {"int8": Int8Linear, "int4": Int4Linear}


def quantized(weight: torch.Tensor, bias: torch.Tensor | None, *, scheme: str) -> Int8Linear | Int4Linear:
    """The quantized layer of an [out, in] `weight` (and bias) under `scheme` ("int8" or "int4")."""
    return QUANTIZED_LINEARS[scheme](weight, bias)
