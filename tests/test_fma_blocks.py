"""float32 and bfloat16 products on FMAs (stage_worker/fma_blocks.py, kernels/blocks.c): the layouts;
float32's exact sums (rounded once to bfloat16) to the bit, every count of rows a tile leaves; every
block computed whatever the team; a lone row the same alone and in a batch; the refusals; a stage
that keeps its weights in blocks alone, its prefill, decode batch and lone token within a rounding
of oneDNN's; the rule that picks it."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import decode_path, fma_blocks, tiles
from layerline.stage_worker.layouts import PackedLinear, can_pack, weight_copies
from layerline.stage_worker.weights import load_stage

from .pipeline import cache_for
from .row_kernels import assert_rule, chosen
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)
DTYPES = [torch.float32, torch.bfloat16]


def _chooser(dtype: torch.dtype):
    """`block_kernel(dtype)` as a cached chooser of no arguments (row_kernels.chosen, assert_rule)."""

    def choose():
        return fma_blocks.block_kernel(dtype)

    choose.cache_clear = fma_blocks.block_kernel.cache_clear  # type: ignore[attr-defined]
    return choose


@pytest.fixture(params=DTYPES, ids=["float32", "bfloat16"])
def dtype(request, monkeypatch):
    """Each dtype, its block kernel where this machine's build has it (`kernel`) and the blocks pack
    it (not bfloat16 where the AMX tiles serve), for this test only."""
    for _ in chosen(monkeypatch, _chooser(request.param), "no kernel with AVX-512 here"):
        if not tiles.blocks_pack(request.param):
            pytest.skip(f"the AMX tiles take {request.param} here")
        yield request.param


def _integers(*shape: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Small integers: their products and sums are exact in float32."""
    return torch.randint(-4, 5, shape, generator=generator).to(dtype)


def test_the_layouts_put_each_blocks_outputs_where_the_kernel_reads_them():
    """float32: element (b, k, j) is output 32b + j's weight of input k. bfloat16: (b, k, 2i) output
    32b + i's, (b, k, 2i + 1) output 32b + 16 + i's, where the kernel widens them."""
    out, fan_in = 64, 3
    weight = torch.arange(out).view(out, 1) * 4 + torch.arange(fan_in)  # exact in bfloat16 up to 256
    wide, narrow = fma_blocks.layout(weight.float()), fma_blocks.layout(weight.to(torch.bfloat16))
    assert wide.shape == (2, fan_in, 2, 16) and narrow.shape == (2, fan_in, 16, 2)
    assert fma_blocks.is_blocked(wide) and fma_blocks.is_blocked(narrow)
    assert not fma_blocks.is_blocked(wide.view(2, fan_in, 32)) and not fma_blocks.is_blocked(wide.transpose(2, 3))
    wide, narrow = wide.flatten(2), narrow.flatten(2)  # as the kernel reads them: 32 weights an input
    for b, k, i in [(0, 0, 0), (0, 2, 5), (1, 1, 15), (1, 0, 9)]:
        assert wide[b, k, i] == wide[b, k, 16 + i] - 64 == weight[32 * b + i, k]
        assert narrow[b, k, 2 * i] == weight[32 * b + i, k]
        assert narrow[b, k, 2 * i + 1] == weight[32 * b + 16 + i, k]
    for bad in (torch.zeros(48, 8), torch.zeros(64, 8, dtype=torch.float16), torch.zeros(64)):
        assert not fma_blocks.fits(bad)
        with pytest.raises(ValueError, match="no block layout"):
            fma_blocks.layout(bad)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("fan_in", "out", "bias"), [(576, 960, True), (1536, 576, False), (37, 32, True)])
def test_exact_sums_are_float32s_rounded_once_for_every_count_of_rows(dtype, threads, fan_in, out, bias):
    """1 to 30 rows, and 40, on `threads` threads: where every sum is exact, float32's x W^T + b
    (rounded to bfloat16 once), to the bit; whole tiles of 12 rows and every remainder, odd widths,
    fewer blocks than threads."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(fan_in * out + threads)
    weight = _integers(out, fan_in, generator=generator, dtype=dtype)
    b = _integers(out, generator=generator, dtype=dtype) if bias else None
    packed = tiles.pack(weight)
    assert fma_blocks.is_blocked(packed)
    product = tiles.bound_product(packed, b)
    for rows in [*range(1, 31), 40]:
        x = _integers(rows, fan_in, generator=generator, dtype=dtype)
        exact = (x.float() @ weight.float().t() + (0 if b is None else b.float())).to(dtype)
        torch.testing.assert_close(product(x), exact, atol=0, rtol=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_blocks_claimed_by_a_team_are_each_computed_once(dtype, threads):
    """The threads claim blocks from a shared count as they go (blocks.c): over many calls, with
    as many threads as blocks claimed at once differ (18, 30, 96 and 1536 blocks), every output
    is the one thread's, to the bit (two inputs in turn: an output left unwritten would hold the
    other's numbers, or none)."""
    generator = torch.Generator().manual_seed(threads)
    for out, fan_in in ((576, 1536), (960, 576), (3072, 576), (49152, 64)):
        weight = torch.randn(out, fan_in, generator=generator).to(dtype)
        product = tiles.bound_product(tiles.pack(weight), None)
        xs = [torch.randn(13, fan_in, generator=generator).to(dtype) for _ in range(2)]
        torch.set_num_threads(1)
        alone = [product(x) for x in xs]
        torch.set_num_threads(threads)
        for i in range(20):
            assert torch.equal(product(xs[i % 2]), alone[i % 2])


def test_random_rows_are_within_a_rounding_and_a_row_is_the_same_alone_and_in_a_batch(dtype):
    """On random numbers each output within a rounding (bfloat16's 2^-8, float32's sums 1e-5, of the
    sum of |x_i w_ij| and |b_j|) of float64's product, also for rows that are a transposed view or
    of three dimensions; and each row's outputs, multiplied alone, equal to the bit its outputs in
    the batch."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(3072, 576, generator=generator).to(dtype)
    b = torch.randn(3072, generator=generator).to(dtype)
    packed = tiles.pack(weight)
    assert fma_blocks.is_blocked(packed)
    product = tiles.bound_product(packed, b)
    for rows in (torch.randn(13, 576, generator=generator), torch.randn(576, 7, generator=generator).t()):
        x = rows.to(dtype)
        scale = x.double().abs() @ weight.double().t().abs() + b.double().abs()
        y = product(x)
        error = (y.double() - (x.double() @ weight.double().t() + b.double())).abs() / scale
        assert float(error.max()) <= (2.0**-8 if dtype == torch.bfloat16 else 1e-5)
        for i in range(x.shape[0]):
            assert torch.equal(product(x[i : i + 1]), y[i : i + 1])
    x = torch.randn(2, 3, 576, generator=generator).to(dtype)
    assert torch.equal(product(x), product(x.view(6, 576)).view(2, 3, 3072))


def test_rows_past_the_widened_buffer_go_in_parts(dtype):
    """Rows longer than the kernel widens at once (2^20 floats: 252 rows of 4096 inputs) are
    multiplied in parts, each part's rows in their place: exact sums to the bit, as in one part."""
    generator = torch.Generator().manual_seed(7)
    weight = _integers(64, 4096, generator=generator, dtype=dtype)
    b = _integers(64, generator=generator, dtype=dtype)
    x = _integers(260, 4096, generator=generator, dtype=dtype)
    exact = (x.float() @ weight.float().t() + b.float()).to(dtype)
    torch.testing.assert_close(tiles.bound_product(tiles.pack(weight), b)(x), exact, atol=0, rtol=0)


def test_it_refuses_rows_and_biases_it_does_not_take(dtype):
    """Rows of another width or dtype, a bias of another length or dtype: a ValueError naming them;
    a weight whose outputs are not whole blocks stays oneDNN's."""
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    weight = torch.randn(64, 40).to(dtype)
    product = tiles.bound_product(tiles.pack(weight), None)
    with pytest.raises(ValueError, match=r"rows \[3, 39\].*in 40"):
        product(torch.randn(3, 39).to(dtype))
    with pytest.raises(ValueError, match=rf"{other}.*in 40, {str(dtype)[6:]}, CPU"):
        product(torch.randn(3, 40).to(other))
    for bias in (torch.zeros(63, dtype=dtype), torch.zeros(64, dtype=other)):
        with pytest.raises(ValueError, match=f"a bias of 64 contiguous {str(dtype)[6:]} for these blocks"):
            tiles.bound_product(tiles.pack(weight), bias)
    if can_pack(dtype, "cpu"):
        assert tiles.pack(torch.randn(48, 40).to(dtype)).is_mkldnn


def test_a_stage_keeps_its_weights_in_blocks_alone_within_a_rounding_of_torchs(dtype, tmp_path, monkeypatch):
    """A tiny model (with biases) loaded whole under `both`: every linear layer and the LM head in
    blocks, one copy (no plain module or [out, in] weight beside them); the prefill of 3 prompts (11
    rows, the modules), a decode step of the 3 (the decode path) and a lone token (the row path) go
    through the kernel and compute logits within a rounding of the same stage loaded without it
    (oneDNN's packed weights, and the plain modules or [out, in] weights for a lone row), with the
    same greedy tokens."""
    if not can_pack(dtype, "cpu"):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    make_tiny_checkpoint("llama2", tmp_path, num_layers=2, vocab_size=256, hidden_size=64, intermediate_size=96)
    calls = []
    bound = fma_blocks.BoundBlocks.__call__

    def counted(self, x):
        calls.append((x.shape[0], self._out))
        return bound(self, x)

    monkeypatch.setattr(fma_blocks.BoundBlocks, "__call__", counted)
    ours = load_stage(tmp_path, LayerRange(0, 2), dtype=dtype)
    assert weight_copies("both", dtype, "cpu", 1) == 1
    with monkeypatch.context() as without:
        without.setattr(fma_blocks, "block_kernel", lambda dtype: None)
        theirs = load_stage(tmp_path, LayerRange(0, 2), dtype=dtype)
    packed = [m for m in ours.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 * 4 + 1  # qkv, o, gate_up and down of each layer, and the LM head
    assert all(fma_blocks.is_blocked(m.weight_packed) and m.weight_rows is None and m.plain is None for m in packed)
    prompts = [[1, 17, 42, 99, 3], [1, 7, 7, 200], [9, 4]]
    logits = {}
    for name, stage in (("ours", ours), ("theirs", theirs)):
        cache = cache_for(stage)
        names = [f"s{i}" for i in range(len(prompts))]
        new = prompts
        for step in range(3):  # the prefill, a decode step of the three, then the first alone
            names, new = (names[:1], new[:1]) if step == 2 else (names, new)
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
            logits[name, step] = out.float()
    assert {rows for rows, _ in calls} == {11, 3, 1} and (3, 256) in calls  # the LM head's 3 logit rows too
    assert isinstance(ours.decode_path, decode_path.DecodePath)
    for step in range(3):
        theirs_step = logits["theirs", step]
        difference = (logits["ours", step] - theirs_step).abs().max()
        assert float(difference) <= (0.02 if dtype == torch.bfloat16 else 1e-4) * float(theirs_step.abs().max())
        assert torch.equal(logits["ours", step].argmax(-1), theirs_step.argmax(-1))


def test_the_rule_takes_it_on_intels_cpus_without_amx_only(dtype, monkeypatch, tmp_path):
    """auto: the kernel on an Intel CPU without AMX tiles (where it was measured), torch's with
    them, on AMD's and where no vendor is named; kernel: everywhere it builds; torch: nowhere."""
    cases = [("intel", "auto", True), ("intel_amx", "auto", False), ("amd", "auto", False)]
    cases += [("other", "auto", False), ("amd", "kernel", True), ("intel", "torch", False)]
    assert_rule(monkeypatch, tmp_path, _chooser(dtype), cases)


def test_where_the_amx_tiles_serve_they_take_bfloat16_first(dtype, monkeypatch):
    """On a CPU with AMX tiles (their kernel serving) bfloat16 weights are the tiles', whatever
    LAYERLINE_ROW_PRODUCTS says of the blocks; float32's stay the blocks'."""
    monkeypatch.setattr(tiles, "tile_kernel", object)  # any library: the tiles serve
    assert tiles.blocks_pack(dtype) == (dtype == torch.float32)
