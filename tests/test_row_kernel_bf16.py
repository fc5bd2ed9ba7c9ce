"""The compiled bfloat16 products of a single row (row_kernel.py, kernels/rows.c's row_rows_bf16):
torch's numbers to the bit where the sums are exact, to a rounding otherwise; the [out, in] weight
a bfloat16 stage keeps for them under `both`; refusals; the rule and the build that pick them."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import torch
from torch import nn

from layerline.shared.cpu import cpu_flags, is_x86
from layerline.stage_worker import native, row_kernel
from layerline.stage_worker.layouts import Linear, LMHead, PackedLinear, StepThreads, TransposedLinear, can_pack
from layerline.stage_worker.rows import RowMultiply

from .row_kernels import assert_rule, chosen


@pytest.fixture
def products(monkeypatch):
    """The bfloat16 kernel where this machine's build has it (`kernel`), for this test only; torch's
    thread count restored after it."""
    yield from chosen(
        monkeypatch,
        row_kernel.bf16_row_kernel,
        "no compiled kernel with the CPU's bfloat16 dot product here (AVX512_BF16)",
    )


def _integers(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Small integers in bfloat16: their products and sums are exact in float32."""
    return torch.randint(-4, 5, shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("fan_in", "out", "bias"), [(576, 960, False), (1536, 576, True), (37, 96, True), (35, 7, False), (64, 1, True)]
)
def test_exact_sums_give_torchs_bfloat16_products_to_the_bit(products, threads, fan_in, out, bias):
    """A [out, in] weight seen as [in, out] (as `PackedLinear` keeps it, and `Linear` on one thread)
    through the kernel on `threads` threads: where every sum is exact, torch's bfloat16 x W^T + b (a
    float32 sum rounded once) and, with a residual, that rounded then added and rounded again; inputs
    past the last 32 and a last group of fewer than four outputs included."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(fan_in * out)
    weight, x = _integers(out, fan_in, generator=generator), _integers(1, fan_in, generator=generator)
    b = _integers(out, generator=generator) if bias else None
    residual = _integers(1, out, generator=generator) * 1000
    bound = row_kernel.bind(weight.t(), b)
    assert bound is not None
    product, add_product = bound
    exact = (x.float() @ weight.float().t() + (0 if b is None else b.float())).to(torch.bfloat16)
    torch.testing.assert_close(product(x), exact, atol=0, rtol=0)
    torch.testing.assert_close(add_product(residual, x), exact + residual, atol=0, rtol=0)
    assert isinstance(getattr(RowMultiply.of((weight.t(), b)).product, "__self__", None), row_kernel._Bound)


@pytest.mark.parametrize("threads", [1, 2])
def test_random_rows_are_within_a_rounding_of_torchs(products, threads):
    """On random numbers the kernel's float32 sums run in its own order: each output within one
    bfloat16 rounding (2^-8 of the sum of |x_i w_ij| and |b_j|) of torch's product."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(960, 576, generator=generator).to(torch.bfloat16)
    x, b = torch.randn(1, 576, generator=generator).to(torch.bfloat16), torch.randn(960).to(torch.bfloat16)
    product, _ = row_kernel.bind(weight.t(), b)
    scale = x.float().abs() @ weight.float().t().abs() + b.float().abs()
    error = (product(x).float() - (x @ weight.t() + b).float()).abs() / scale
    assert float(error.max()) <= 2.0**-8


@pytest.mark.parametrize("module", ["qkv", "down", "head"])
def test_a_packed_bfloat16_layer_keeps_its_rows_for_one_row(products, module):
    """Under `both` a bfloat16 `PackedLinear` keeps the [out, in] weight beside the packed one
    (`keep_rows`) and hands it, seen as [in, out], to a single row: the kernel's product, within a
    rounding of the packed one's; without `keep_rows` the packed weight alone."""
    if not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("oneDNN does not pack bfloat16 on this CPU")
    fan_in, out = {"qkv": (64, 96), "down": (160, 64), "head": (64, 512)}[module]
    loaded = nn.Linear(fan_in, out, bias=False).to(torch.bfloat16).requires_grad_(False)
    threads_of = StepThreads()
    plain = {"qkv": TransposedLinear.of, "down": Linear.of}.get(module)
    layer = LMHead.of(loaded) if plain is None else plain(loaded, step_threads=threads_of)
    kept, alone = PackedLinear(layer, keep_plain=False, keep_rows=True), PackedLinear(layer, keep_plain=False)
    w, _ = kept.row_weight(2)
    assert w.shape == (fan_in, out) and w.stride() == (1, fan_in)
    assert alone.weight_rows is None and alone.row_weight(2)[0] is alone.weight_packed
    x = torch.randn(1, fan_in).to(torch.bfloat16)
    multiply = RowMultiply.of(kept.row_weight(2))
    assert isinstance(getattr(multiply.product, "__self__", None), row_kernel._Bound)
    scale = x.float().abs() @ loaded.weight.float().t().abs()
    error = (multiply.product(x).float() - alone(x).float()).abs() / scale
    assert float(error.max()) <= 2.0**-7


def test_a_bad_row_is_refused_naming_the_width_and_dtype(products):
    product, _ = row_kernel.bind(torch.randn(32, 48).to(torch.bfloat16).t(), None)
    with pytest.raises(ValueError, match="a row of 48 bfloat16"):
        product(torch.randn(1, 48))  # float32
    with pytest.raises(ValueError, match="a row of 48 bfloat16"):
        product(torch.randn(1, 47).to(torch.bfloat16))


def test_only_rows_are_taken_in_bfloat16(products):
    """The columns layouts are float32's alone: a bfloat16 [in, out] matrix keeps torch's product,
    as does a bias of another dtype."""
    weight = torch.randn(32, 48).to(torch.bfloat16)
    assert row_kernel.bind(weight.t().contiguous(), None) is None
    assert row_kernel.bind(weight.t(), torch.randn(32)) is None


def test_the_build_and_the_rule_pick_the_bfloat16_kernel(products, monkeypatch, tmp_path):
    """This machine's build has the bfloat16 kernel where its CPU has the instruction; one without
    `-march=native` has none; `torch`, and `auto` on an Intel CPU with AMX tiles or a CPU of no
    vendor, leave torch's products; `auto` takes the kernel on an Intel CPU without AMX tiles."""
    assert products.unchecked["rows_bf16"]() == int("avx512_bf16" in cpu_flags())
    if is_x86():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        source = next(path for path in native.SOURCES if path.name == "rows.c")
        library = tmp_path / "rows.so"
        subprocess.run([str(compiler), *native.FLAGS, "-o", str(library), str(source)], check=True)
        assert ctypes.CDLL(str(library)).layerline_rows_bf16() == 0
    cases = [("intel_amx", "auto", False), ("intel", "auto", True), ("amd", "auto", True), ("amd", "torch", False)]
    cases += [("other", "auto", False), ("intel_amx", "kernel", True)]
    assert_rule(monkeypatch, tmp_path, row_kernel.bf16_row_kernel, cases)
