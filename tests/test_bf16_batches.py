"""The compiled bfloat16 products of a few rows at once (stage_worker/bf16_batches.py, kernels/rows.c's
rows_bf16_batch): float32's exact sums rounded once to the bit, every count of rows a tile leaves;
the rows it takes and the ones it hands to the packed weight; a bfloat16 stage's decode batch
through it, within a rounding of oneDNN's; the rule that picks it."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import bf16_batches, decode_path
from layerline.stage_worker.layouts import PackedLinear, can_pack
from layerline.stage_worker.weights import load_stage

from .pipeline import cache_for
from .row_kernels import assert_rule, chosen
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def kernel(monkeypatch):
    """The batch kernel where this machine's build has it (`kernel`), for this test only."""
    yield from chosen(
        monkeypatch,
        bf16_batches.bf16_batch_kernel,
        "no compiled kernel with the CPU's bfloat16 instructions here (AVX512_BF16)",
    )


def _integers(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Small integers in bfloat16: their products and sums are exact in float32."""
    return torch.randint(-4, 5, shape, generator=generator).to(torch.bfloat16)


def _refused(x: torch.Tensor) -> torch.Tensor:
    raise AssertionError(f"handed {list(x.shape)} {x.dtype} rows to the packed weight")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("fan_in", "out", "bias"), [(576, 960, True), (1536, 576, False), (37, 9, True), (64, 1, False)]
)
def test_exact_sums_are_float32s_rounded_once_for_every_count_of_rows(kernel, threads, fan_in, out, bias):
    """2 to 31 rows on `threads` threads: where every sum is exact, float32's x W^T + b rounded to
    bfloat16 once, to the bit; whole tiles of 6 rows and every remainder, inputs past the last 32,
    a last group of fewer than 4 outputs."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(fan_in * out + threads)
    weight = _integers(out, fan_in, generator=generator)
    b = _integers(out, generator=generator) if bias else None
    product = bf16_batches.several_rows(weight, b, _refused)
    for rows in range(2, bf16_batches.BATCH_ROWS):
        x = _integers(rows, fan_in, generator=generator)
        exact = (x.float() @ weight.float().t() + (0 if b is None else b.float())).to(torch.bfloat16)
        torch.testing.assert_close(product(x), exact, atol=0, rtol=0)


def test_random_rows_are_within_a_rounding_of_float32s(kernel):
    """On random numbers each output within one bfloat16 rounding (2^-8 of the sum of |x_i w_ij|
    and |b_j|) of float32's product, also for rows that are a transposed view."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(3072, 576, generator=generator).to(torch.bfloat16)
    b = torch.randn(3072, generator=generator).to(torch.bfloat16)
    product = bf16_batches.several_rows(weight, b, _refused)
    for rows in (torch.randn(13, 576, generator=generator), torch.randn(576, 7, generator=generator).t()):
        x = rows.to(torch.bfloat16)
        scale = x.float().abs() @ weight.float().t().abs() + b.float().abs()
        error = (product(x).float() - (x.float() @ weight.float().t() + b.float())).abs() / scale
        assert float(error.max()) <= 2.0**-8


def test_other_rows_and_weights_go_to_the_packed_product(kernel):
    """One row, BATCH_ROWS rows and more, float32 rows, rows of another width and rows of three
    dimensions go to `packed`; so does every row where no [out, in] weight is kept, or the weight
    or the bias is not the kernel's (float32, or not contiguous)."""
    generator = torch.Generator().manual_seed(2)
    weight = _integers(16, 64, generator=generator)
    handed = []

    def packed(x: torch.Tensor) -> torch.Tensor:
        handed.append(tuple(x.shape))
        return torch.zeros(1)

    product = bf16_batches.several_rows(weight, None, packed)
    for shape in [(1, 64), (32, 64), (40, 64), (2, 3, 64)]:
        product(_integers(*shape, generator=generator))
    product(torch.randn(4, 64))
    product(_integers(4, 63, generator=generator))
    assert handed == [(1, 64), (32, 64), (40, 64), (2, 3, 64), (4, 64), (4, 63)]
    assert bf16_batches.several_rows(None, None, packed) is packed
    assert bf16_batches.several_rows(weight.float(), None, packed) is packed
    assert bf16_batches.several_rows(weight.t().contiguous().t(), None, packed) is packed
    assert bf16_batches.several_rows(weight, torch.zeros(16), packed) is packed


def test_a_bfloat16_stages_decode_batch_goes_through_it_within_a_rounding_of_onednns(kernel, tmp_path, monkeypatch):
    """A tiny bfloat16 model (with biases) loaded whole under `both`, its layers' [out, in] weights
    kept; the prefill of 3 prompts (11 rows, the modules) and a decode step
    of the 3 (the decode path) go through it and compute logits within bfloat16 rounding of the same
    stage loaded without the kernel (oneDNN's packed weights), the same greedy tokens."""
    if not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("oneDNN does not pack bfloat16 on this CPU")
    make_tiny_checkpoint("qwen2", tmp_path, num_layers=2, hidden_size=64, intermediate_size=96)
    calls = []
    bind = bf16_batches._bind

    def counted(kernel, weight, bias):
        product = bind(kernel, weight, bias)
        return None if product is None else (lambda x: calls.append((x.shape[0], weight.shape[0])) or product(x))

    monkeypatch.setattr(bf16_batches, "_bind", counted)
    ours = load_stage(tmp_path, LayerRange(0, 2), dtype=torch.bfloat16)
    monkeypatch.setattr(bf16_batches, "bf16_batch_kernel", lambda: None)
    theirs = load_stage(tmp_path, LayerRange(0, 2), dtype=torch.bfloat16)
    packed = [m for m in ours.modules() if isinstance(m, PackedLinear) and m.weight_rows is not None]
    assert len(packed) == 2 * 4 + 1  # qkv, o, gate_up and down of each layer, and the LM head
    prompts = [[1, 17, 42, 99, 3], [1, 7, 7, 200], [9, 4]]
    logits = {}
    for name, stage in (("ours", ours), ("theirs", theirs)):
        cache = cache_for(stage)
        names = [f"s{i}" for i in range(len(prompts))]
        new = prompts
        for _ in range(2):  # the prefill, then a decode step of the three
            for seq, ids in zip(names, new, strict=True):
                cache.reserve(seq, len(ids))
            layout = cache.plan_step(names, [len(ids) for ids in new])
            with torch.no_grad():
                out = stage(
                    torch.tensor([t for ids in new for t in ids]),
                    cache=cache,
                    layout=layout,
                    logit_rows=layout.last_rows(),
                )
            new = [[int(row.argmax())] for row in out]
        logits[name] = out.float()
    head = ours.lm_head.weight_rows.shape[0]
    assert {rows for rows, _ in calls} == {11, 3} and (3, head) in calls  # the LM head's 3 logit rows too
    assert isinstance(ours.decode_path, decode_path.DecodePath)
    scale = logits["theirs"].abs().max()
    assert float((logits["ours"] - logits["theirs"]).abs().max()) <= 0.02 * float(scale)
    assert torch.equal(logits["ours"].argmax(-1), logits["theirs"].argmax(-1))


def test_the_rule_takes_it_on_intels_cpus_without_amx_only(kernel, monkeypatch, tmp_path):
    """auto: the kernel on an Intel CPU without AMX tiles (where it was measured), oneDNN's with
    them, on AMD's and where no vendor is named; kernel: everywhere it builds; torch: nowhere."""
    cases = [("intel", "auto", True), ("intel_amx", "auto", False), ("amd", "auto", False), ("other", "auto", False)]
    cases += [("amd", "kernel", True), ("intel", "torch", False)]
    assert_rule(monkeypatch, tmp_path, bf16_batches.bf16_batch_kernel, cases)
