"""The compiled products of float32 rows by `--quantize int4` layers (stage_worker/int4_rows.py,
kernels/int4.c), reading torch's own packed codes: the float32 product by the weight the codes
stand for, to the bit where the sums are exact, for whole blocks of 64 outputs and the outputs past
them, one row or several; a lone token and a decode batch of an int4 stage through them give the
logits of transformers holding that weight; refusals; the rule that picks them."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import int4_rows
from layerline.stage_worker.quantize import INT4_ROWS, Int4Linear
from layerline.stage_worker.weights import load_stage

from .row_kernels import assert_dequantized_logits, assert_rule, chosen
from .test_quantize import tiny64  # noqa: F401  (the module's fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def products(monkeypatch):
    """The int4 kernel where this machine's build has it (`kernel`), for this test only."""
    yield from chosen(monkeypatch, int4_rows.int4_row_kernel, "no compiled kernel with AVX-512 here")


def _exact_layer(out: int, fan_in: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Codes packed by torch, power-of-two scales and small-integer offsets, and the weight they stand
    for: every product and sum of a small-integer row with them is exact in float32."""
    padded = -(-out // INT4_ROWS) * INT4_ROWS
    codes = torch.randint(0, 16, (padded, fan_in), generator=generator, dtype=torch.int32)
    scales = 2.0 ** torch.randint(-2, 2, (fan_in // 32, padded, 1), generator=generator)
    offsets = torch.randint(-20, 21, (fan_in // 32, padded, 1), generator=generator).float()
    sz = torch.cat([scales, offsets], dim=-1).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    per_input = sz.float().transpose(0, 1).repeat_interleave(32, dim=1)  # [padded, in, 2]
    weight = ((codes.float() - 8) * per_input[..., 0] + per_input[..., 1])[:out]
    return packed, sz, weight


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("out", "fan_in"), [(960, 576), (576, 1536), (70, 64), (100, 96), (48, 32), (130, 64), (120, 64)]
)
def test_exact_sums_give_the_float32_product_to_the_bit(products, threads, out, fan_in):
    """Whole blocks of 64 outputs, 16, 32 or 48 past them (padding past `out` included), fewer
    than 64 in all; 1 to 5 rows (a tile of 2 and the one past it), with a bias and a residual."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(out * fan_in + threads)
    packed, sz, weight = _exact_layer(out, fan_in, generator)
    b = torch.randint(-50, 51, (out,), generator=generator).float()
    product, add_product = int4_rows.bind_int4(packed, sz, b, out)
    for rows in range(1, 6):
        x = torch.randint(-3, 4, (rows, fan_in), generator=generator).float()
        residual = torch.randint(-1000, 1001, (rows, out), generator=generator).float()
        torch.testing.assert_close(product(x), x @ weight.t() + b, atol=0, rtol=0)
        torch.testing.assert_close(add_product(residual, x), x @ weight.t() + b + residual, atol=0, rtol=0)


def test_an_int4_layer_of_a_float32_model_takes_the_kernel_for_fewer_rows(products):
    """`Int4Linear` multiplies float32 rows through the kernel below KERNEL_ROWS (each within float32
    rounding of the product by its `dense()` weight, no bfloat16 rounding of the rows), and many
    rows, or a bfloat16 model's, through torch's kernel."""
    generator = torch.Generator().manual_seed(3)
    layer = Int4Linear(torch.randn(100, 96, generator=generator), torch.randn(100, generator=generator))
    weight = layer.dense()
    for rows in range(1, int4_rows.KERNEL_ROWS):
        x = torch.randn(rows, 96, generator=generator)
        want = x @ weight.t() + layer.bias
        scale = x.abs() @ weight.abs().t() + layer.bias.abs()
        assert float(((layer(x) - want).abs() / scale).max()) < 1e-5
    many = torch.randn(int4_rows.KERNEL_ROWS, 96, generator=generator)
    torch.testing.assert_close(layer(many), layer._product(many.bfloat16()).float() + layer.bias)
    half = Int4Linear(torch.randn(100, 96, generator=generator).bfloat16(), None)
    assert half.row_products() is None


def test_a_lone_token_of_an_int4_stage_gives_the_dequantized_models_logits(products, tiny64):  # noqa: F811
    """A float32 int4 stage decodes each token through the kernel (its row path has a plan), and
    each step's logits are those of transformers holding the weights the codes stand for, to
    float32 rounding; so do three sequences a step (the modules, their layers on the kernel: a
    step of 4 rows or more would be torch's, its rows rounded to bfloat16)."""
    path, hf = tiny64
    stage = load_stage(path, LayerRange(0, 4), quantize="int4")
    assert stage.row_path is not None and stage.row_path.plan(torch.get_num_threads()) is not None
    assert_dequantized_logits(stage, hf, {"a": [5], "b": [7], "c": [8]})


def test_bad_rows_and_layers_are_refused(products):
    generator = torch.Generator().manual_seed(4)
    packed, sz, _ = _exact_layer(64, 64, generator)
    product, _ = int4_rows.bind_int4(packed, sz, None, 64)
    for x in (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 63), torch.zeros(0, 64), torch.zeros(64)):
        with pytest.raises(ValueError, match="rows of 64 float32 on the CPU"):
            product(x)
    assert int4_rows.bind_int4(packed, sz.float(), None, 64) is None  # scales and offsets are bfloat16
    assert int4_rows.bind_int4(packed, sz[:1], None, 64) is None  # one group's, for 64 inputs
    assert int4_rows.bind_int4(packed, sz, None, 65) is None  # more outputs than the padded codes
    assert int4_rows.bind_int4(packed, sz, torch.zeros(64, dtype=torch.bfloat16), 64) is None  # bias float32
    assert int4_rows.bind_int4(packed.view(torch.int8), sz, None, 64) is None


def test_the_rule_takes_it_on_every_named_x86_vendor(products, monkeypatch, tmp_path):
    """`auto`: on Intel's CPUs (with AMX or not) and AMD's alike, since torch's int4 kernel is the
    other way on both; not where no vendor is named; `torch`: nowhere."""
    cases = [("intel", "auto", True), ("intel_amx", "auto", True), ("amd", "auto", True), ("other", "auto", False)]
    cases += [("other", "kernel", True), ("amd", "torch", False)]
    assert_rule(monkeypatch, tmp_path, int4_rows.int4_row_kernel, cases)
