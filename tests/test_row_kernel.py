"""The compiled float32 products of a single row (row_kernel.py, kernels/rows.c): torch's numbers
to rounding on every weight layout a stage makes, refusals where it does not take a weight, and
the rule that picks it (LAYERLINE_ROW_PRODUCTS, the CPU's vendor)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from layerline.shared import cpu as shared_cpu
from layerline.stage_worker import row_kernel
from layerline.stage_worker.layouts import Linear, LMHead, StepThreads, TransposedLinear
from layerline.stage_worker.rows import RowMultiply

from .row_kernels import chosen


@pytest.fixture
def products(monkeypatch):
    """The kernel, chosen wherever it compiles (`kernel`), for this test only; torch's thread count
    restored after it."""
    yield from chosen(
        monkeypatch, row_kernel.row_kernel, "no compiled kernel here (no C compiler, or LAYERLINE_KERNELS=torch)"
    )


def _expected(x, weight, bias, residual=None):
    y = x @ weight.t() + (0 if bias is None else bias)
    return y if residual is None else y + residual


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("fan_in", "out", "bias"), [(576, 960, False), (37, 96, True), (1536, 576, False)])
def test_the_layers_row_weights_give_torchs_products(products, threads, fan_in, out, bias):
    """Each linear layout's `row_weight(threads)` (a [in, out] matrix, its column blocks, a
    [out, in] matrix or its row blocks) multiplied through the kernel on `threads` threads: torch's
    x W^T + b, and with a residual added, to float32 rounding."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(fan_in + out)
    weight = torch.randn(out, fan_in, generator=generator)
    b = torch.randn(out, generator=generator) if bias else None
    x, residual = torch.randn(1, fan_in, generator=generator), torch.randn(1, out, generator=generator)
    loaded = nn.Linear(fan_in, out, bias=bias)
    with torch.no_grad():
        loaded.weight.copy_(weight)
        if b is not None:
            loaded.bias.copy_(b)
    threads_of = StepThreads()
    for module in (TransposedLinear.of(loaded, step_threads=threads_of), Linear.of(loaded, step_threads=threads_of)):
        w, module_bias = module.row_weight(threads)
        bound = row_kernel.bind(w, module_bias)
        assert bound is not None, (type(module).__name__, w.shape, w.stride())
        product, add_product = bound
        torch.testing.assert_close(product(x), _expected(x, weight, b), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(add_product(residual, x), _expected(x, weight, b, residual), atol=1e-4, rtol=1e-5)
        assert isinstance(getattr(RowMultiply.of((w, module_bias)).product, "__self__", None), row_kernel._Bound)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out", [90, 7, 1])
def test_a_last_group_of_fewer_than_four_outputs(products, threads, out):
    """The [out, in] form takes its outputs four at a time: a short last group (and fewer outputs
    than threads) gives torch's products too."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(out)
    weight, x = torch.randn(out, 35, generator=generator), torch.randn(1, 35, generator=generator)
    bound = row_kernel.bind(weight.t(), None)
    assert bound is not None
    torch.testing.assert_close(bound[0](x), x @ weight.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("vocab", [4096, 4104])
def test_the_lm_heads_blocks_give_torchs_logits_in_vocabulary_order(products, vocab, threads):
    """The head's column blocks (`HEAD_BLOCKS`): 8 of 512 columns; 8 of 513, not whole vectors of
    16, which the kernel leaves to torch."""
    generator = torch.Generator().manual_seed(vocab)
    loaded = nn.Linear(64, vocab, bias=False)
    with torch.no_grad():
        loaded.weight.copy_(torch.randn(vocab, 64, generator=generator))
    head = LMHead.of(loaded)
    x = torch.randn(1, 64, generator=generator)
    torch.set_num_threads(threads)  # 3 threads: a thread's columns cross a block's edge
    bound = row_kernel.bind(*head.row_weight(threads))
    assert head.weight_blocks.shape[:1] == (8,)
    if vocab == 4104:
        assert bound is None
        bound = RowMultiply.of(head.row_weight(2)).product, None
    assert bound is not None
    torch.testing.assert_close(bound[0](x), x @ loaded.weight.t(), atol=1e-4, rtol=1e-5)


def test_weights_the_kernel_does_not_take_keep_torchs_product(products):
    """bfloat16, a column block not a multiple of 16 wide, a weight torch keeps a gradient of, a
    bias of another length: no binding (`bind` None), and RowMultiply multiplies them through torch."""
    w = torch.randn(32, 48)
    assert row_kernel.bind(w.to(torch.bfloat16), None) is None
    assert row_kernel.bind(torch.randn(32, 40), None) is None  # [in, out] with 40 columns
    assert row_kernel.bind(w.requires_grad_(), None) is None
    assert row_kernel.bind(torch.randn(32, 48), torch.randn(47)) is None
    x, narrow = torch.randn(1, 32), torch.randn(32, 40)
    torch.testing.assert_close(RowMultiply.of((narrow, None)).product(x), x @ narrow)


def test_a_residual_the_kernel_does_not_read_is_added_by_torch(products):
    """A strided residual, a negated view of one (torch's lazy negation) and a bias of one are not
    what the kernel reads as they lie: the sums are still residual + x W^T + b."""
    generator = torch.Generator().manual_seed(7)
    weight, x = torch.randn(48, 32, generator=generator), torch.randn(1, 32, generator=generator)
    strided = torch.randn(48, 2, generator=generator).t()[:1]  # [1, 48], stride 2
    negated = torch._neg_view(torch.randn(1, 48, generator=generator))
    assert not strided.is_contiguous() and negated.is_neg()
    product, add_product = row_kernel.bind(weight.t().contiguous(), None)
    for residual in (strided, negated):
        torch.testing.assert_close(add_product(residual, x), x @ weight.t() + residual, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(product(torch._neg_view(x)), -x @ weight.t(), atol=1e-4, rtol=1e-5)
    assert row_kernel.bind(weight.t().contiguous(), torch._neg_view(torch.randn(48))) is None


def test_auto_wants_a_build_with_wide_vectors(products, tmp_path):
    """`auto` takes the kernel only from a build with AVX2 or AVX-512 (`-march=native` on such a CPU):
    a build without `-march` (SSE2 on x86-64) says so, and this machine's build says what its CPU has."""
    import ctypes
    import subprocess

    from layerline.shared.cpu import cpu_flags, is_x86
    from layerline.stage_worker import native

    assert products.unchecked["rows_vectorized"]() == int(bool({"avx2", "avx512f"} & cpu_flags()))
    if not is_x86():
        return
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    source = next(path for path in native.SOURCES if path.name == "rows.c")
    library = tmp_path / "rows.so"
    subprocess.run([str(compiler), *native.FLAGS, "-o", str(library), str(source)], check=True)
    assert ctypes.CDLL(str(library)).layerline_rows_vectorized() == 0


def test_a_bad_row_is_refused_naming_the_width(products):
    product, _ = row_kernel.bind(torch.randn(32, 48), None)
    with pytest.raises(ValueError, match="a row of 32 float32"):
        product(torch.randn(1, 31))
    with pytest.raises(ValueError, match="a row of 32 float32"):
        product(torch.randn(2, 32))


def test_the_rule_picks_the_kernel_on_amd_and_torch_on_intel_and_where_told(products, monkeypatch, tmp_path):
    """auto: the kernel on an x86 CPU that is not Intel's (MKL's fast products run on Intel's), torch
    where no vendor is named (another architecture); kernel: everywhere; torch: nowhere; a
    misspelt choice is a ValueError naming the variable."""
    cpus = {"intel": "vendor_id\t: GenuineIntel\n", "amd": "vendor_id\t: AuthenticAMD\n", "arm": "CPU part\t: 0xd0c\n"}
    for name, line in cpus.items():
        (tmp_path / name).write_text(f"processor\t: 0\n{line}\n")
    try:
        for cpu, choice, serves in [
            ("intel", "auto", False),
            ("arm", "auto", False),
            ("amd", "auto", True),
            ("intel", "kernel", True),
            ("amd", "torch", False),
        ]:
            monkeypatch.setattr(shared_cpu, "CPUINFO", tmp_path / cpu)
            monkeypatch.setenv(row_kernel.ENV, choice)
            row_kernel.row_kernel.cache_clear()
            assert (row_kernel.row_kernel() is not None) == serves, (cpu, choice)
            assert (row_kernel.bind(torch.randn(32, 48), None) is not None) == serves, (cpu, choice)
        assert shared_cpu.cpu_vendor() == "AuthenticAMD"
        monkeypatch.setenv(row_kernel.ENV, "fast")
        row_kernel.row_kernel.cache_clear()
        with pytest.raises(ValueError, match="LAYERLINE_ROW_PRODUCTS='fast'"):
            row_kernel.row_kernel()
    finally:
        row_kernel.row_kernel.cache_clear()
