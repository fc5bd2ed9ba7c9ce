"""The compiled products of float32 rows by `--quantize int8` layers (row_kernel.bind_int8,
kernels/rows.c's layerline_rows_i8): torch's float32 product by the weight the codes stand for, to
the bit where the sums are exact, one row or several; a lone token and a decode batch of an int8
stage through them give the logits of transformers holding the dequantized weights; refusals; the
rule and the build that pick them, and the scalar loop of a build without vectors."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from layerline.shared.cpu import is_x86
from layerline.shared.model_config import LayerRange
from layerline.stage_worker import int4_rows, native, row_kernel
from layerline.stage_worker.quantize import DEQUANTIZED_DTYPE, DEQUANTIZED_ROWS, KERNEL_ROWS, Int8Linear
from layerline.stage_worker.weights import load_stage

from .row_kernels import assert_dequantized_logits, assert_rule, chosen
from .test_quantize import tiny64  # noqa: F401  (the module's fixture)


@pytest.fixture
def products(monkeypatch):
    """The int8 kernel where this machine's build has it (`kernel`), for this test only; torch's
    thread count restored after it."""
    yield from chosen(monkeypatch, row_kernel.int8_row_kernel, "no compiled kernel with AVX2 or AVX-512 here")


def _layer(out: int, fan_in: int, *, bias: bool, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Codes, power-of-two bfloat16 scales and a small-integer bias: every product and sum of a
    small-integer row with them is exact in float32."""
    codes = torch.randint(-128, 128, (out, fan_in), generator=generator, dtype=torch.int8)
    scales = (2.0 ** torch.randint(-6, 1, (out,), generator=generator)).to(torch.bfloat16)
    b = torch.randint(-50, 51, (out,), generator=generator).float() if bias else None
    return codes, scales, b


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("fan_in", "out", "bias"), [(576, 960, False), (1536, 576, True), (37, 96, True), (35, 7, False), (64, 1, True)]
)
def test_exact_sums_give_torchs_float32_products_to_the_bit(products, threads, fan_in, out, bias):
    """On `threads` threads, inputs past the last 16 and a last group of fewer than four outputs
    included: x (codes * scales)^T + b, and with a residual added, as torch computes them in float32."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(fan_in * out)
    codes, scales, b = _layer(out, fan_in, bias=bias, generator=generator)
    x = torch.randint(-8, 9, (1, fan_in), generator=generator).float()
    residual = torch.randint(-1000, 1001, (1, out), generator=generator).float()
    bound = row_kernel.bind_int8(codes, scales, b)
    assert bound is not None
    product, add_product = bound
    want = x @ (codes.float() * scales.float()[:, None]).t() + (0 if b is None else b)
    assert torch.equal(product(x), want)
    assert torch.equal(add_product(residual, x), residual + want)
    assert torch.equal(add_product(residual.double(), x), residual + want)  # torch adds one the kernel does not read


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 9, 31])
def test_several_rows_at_once_are_each_rows_product(products, rows):
    """Rows in tiles of up to four share each code read: every row's product is its own, to the bit
    where the sums are exact, a residual of its own added."""
    generator = torch.Generator().manual_seed(rows)
    codes, scales, b = _layer(37, 70, bias=True, generator=generator)
    x = torch.randint(-8, 9, (rows, 70), generator=generator).float()
    residual = torch.randint(-1000, 1001, (rows, 37), generator=generator).float()
    product, add_product = row_kernel.bind_int8(codes, scales, b)
    want = x @ (codes.float() * scales.float()[:, None]).t() + b
    assert torch.equal(product(x), want)
    assert torch.equal(add_product(residual, x), residual + want)
    assert torch.equal(product(x[1:2]), want[1:2])


@pytest.mark.parametrize("rows", [1, 2, 7, KERNEL_ROWS - 1])
def test_an_int8_layer_of_a_float32_model_takes_the_kernel_for_fewer_rows(products, rows):
    """Below KERNEL_ROWS rows `Int8Linear` multiplies float32 rows by its codes in float32 (torch's
    kernel would round them to bfloat16 first); from DEQUANTIZED_ROWS on, by its codes made
    DEQUANTIZED_DTYPE (where that is bfloat16, the rounding shows)."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(40, 64), torch.randn(40)
    layer = Int8Linear(weight, bias)
    x = torch.randn(rows, 64)
    want = x @ layer.dense().t() + bias
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
    many = torch.randn(max(DEQUANTIZED_ROWS, KERNEL_ROWS), 64)
    far = (layer(many) - (many @ layer.dense().t() + bias)).abs().max()
    assert far > 1e-4 or DEQUANTIZED_DTYPE != torch.bfloat16  # the bfloat16 path's rounding: not the kernel


def test_random_rows_are_within_float32_rounding(products):
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(-128, 128, (3072, 576), generator=generator, dtype=torch.int8)
    scales = (torch.rand(3072, generator=generator) / 100).to(torch.bfloat16)
    x = torch.randn(1, 576, generator=generator)
    bound = row_kernel.bind_int8(codes, scales, None)
    assert bound is not None
    weight = codes.float() * scales.float()[:, None]
    scale = x.abs() @ weight.abs().t()
    assert ((bound[0](x) - x @ weight.t()).abs() / scale).max() < 1e-5


def test_bad_rows_and_layers_are_refused(products):
    codes = torch.zeros(8, 40, dtype=torch.int8)
    scales = torch.ones(8, dtype=torch.bfloat16)
    bound = row_kernel.bind_int8(codes, scales, None)
    assert bound is not None
    for x in (torch.zeros(1, 40, dtype=torch.bfloat16), torch.zeros(1, 39), torch.zeros(0, 40), torch.zeros(40)):
        with pytest.raises(ValueError, match="rows of 40 float32 on the CPU"):
            bound[0](x)
    assert row_kernel.bind_int8(codes.t(), scales, None) is None  # not [out, in] row by row
    assert row_kernel.bind_int8(codes, scales.float(), None) is None  # scales are bfloat16
    assert row_kernel.bind_int8(codes, scales, torch.zeros(8, dtype=torch.bfloat16)) is None  # bias float32
    assert row_kernel.bind_int8(codes, scales[:4], None) is None
    assert row_kernel.bind_int8(codes.float(), scales, None) is None


def test_a_lone_token_of_an_int8_stage_gives_the_dequantized_models_logits(products, tiny64):  # noqa: F811
    """A float32 int8 stage decodes each token through the kernel (its row path has a plan), and
    each step's logits are those of transformers holding the weights the codes stand for, to float32
    rounding (the modules round each layer's input to bfloat16 for torch's kernel: 2% there)."""
    path, hf = tiny64
    stage = load_stage(path, LayerRange(0, 4), quantize="int8")
    assert stage.row_path is not None and stage.row_path.plan(torch.get_num_threads()) is not None
    assert_dequantized_logits(stage, hf, {"a": [5, 6], "b": [7], "c": [8, 9, 10]})


def test_only_a_float32_int8_stage_takes_the_kernel(products, tiny64):  # noqa: F811
    path, _ = tiny64
    threads = torch.get_num_threads()
    int4 = load_stage(path, LayerRange(0, 4), quantize="int4")
    serves = int4_rows.int4_row_kernel() is not None  # int4's own kernel (tests/test_int4_rows.py)
    assert int4.row_path is not None and (int4.row_path.plan(threads) is not None) == serves
    half = load_stage(path, LayerRange(0, 4), dtype=torch.bfloat16, quantize="int8")
    layer = half.layers["0"].self_attn.o_proj
    assert isinstance(layer, Int8Linear) and layer.row_products() is None
    assert half.row_path is not None and half.row_path.plan(threads) is None


def test_the_build_and_the_rule_pick_the_int8_kernel(products, monkeypatch, tmp_path):
    """`auto` takes it on Intel's CPUs as on AMD's (torch's one-row int8 kernel is the other way on
    both), not where /proc/cpuinfo names no vendor; `torch` leaves torch's. A build without
    `-march=native` computes the same numbers, in vectors or (on plain x86-64) in its scalar loop."""
    this_build = products.unchecked["rows_i8_vectorized"]()
    assert this_build == 1  # the fixture's kernel serves: it has the vectors
    if is_x86():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        source = next(path for path in native.SOURCES if path.name == "rows.c")
        library = tmp_path / "rows.so"
        subprocess.run([str(compiler), *native.FLAGS, "-o", str(library), str(source)], check=True)
        generic = ctypes.CDLL(str(library))
        call = generic.layerline_rows_i8
        call.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_void_p]
        generator = torch.Generator().manual_seed(3)
        codes, scales, b = _layer(9, 37, bias=True, generator=generator)
        x = torch.randint(-8, 9, (3, 37), generator=generator).float()
        y = torch.empty(3, 9)
        call(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), b.data_ptr(), None, 3, 37, 9, 2, y.data_ptr())
        assert torch.equal(y, x @ (codes.float() * scales.float()[:, None]).t() + b)
    cases = [("intel", "auto", True), ("intel_amx", "auto", True), ("amd", "auto", True), ("other", "auto", False)]
    cases += [("intel", "torch", False)]
    assert_rule(monkeypatch, tmp_path, row_kernel.int8_row_kernel, cases)
