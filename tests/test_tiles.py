"""bfloat16 products on AMX tiles (stage_worker/tiles.py, kernels/tiles.c): the layout the kernel
reads, oneDNN's numbers to the bit up to 32 rows, each row's sum the same at any row count, the
refusals, and a stage whose packed weights are tiles giving the logits and tokens of one whose
weights are oneDNN's. Where the CPU has no AMX, the kernel must decline (and the rest skips)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from layerline.shared.cpu import cpu_flags
from layerline.shared.model_config import LayerRange
from layerline.stage_worker import native, tiles
from layerline.stage_worker.layouts import PackedLinear, can_pack
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)


AMX_CPU = {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The compiled library in a home of this module's, and `tile_kernel` deciding afresh with
    it (and again after the module); skips where nothing compiles."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERLINE_HOME", str(tmp_path_factory.mktemp("kernels")))
        patch.delenv(native.ENV, raising=False)
        tiles.tile_kernel.cache_clear()
        try:
            yield native.load()
        except native.KernelUnavailable as e:
            pytest.skip(f"no compiled kernels: {e}")
        finally:
            tiles.tile_kernel.cache_clear()


@pytest.fixture
def served(library):
    """The tile kernel, or a skip where this CPU (or this build, or Linux) gives no tiles."""
    if tiles.tile_kernel() is None:
        pytest.skip("no AMX tile kernel here")
    return tiles.tile_kernel()


def test_the_kernel_serves_wherever_the_build_has_tiles_and_declines_elsewhere(library):
    """Where the build has AMX code and Linux grants the tiles, the check against oneDNN passes
    and the kernel serves; where not (every CPU without AMX), it declines."""
    ready = library.unchecked["tiles_ready"]() == 1  # on AMX unless gcc before 11 or Linux before 5.16
    if not AMX_CPU:
        assert not ready
    assert (tiles.tile_kernel() is not None) == (ready and can_pack(torch.bfloat16, "cpu"))


def test_the_layout_puts_each_pair_of_inputs_of_16_columns_in_a_row_of_a_block():
    w = (torch.arange(64 * 96) % 251).view(64, 96).to(torch.bfloat16)  # bfloat16 holds integers to 256 exactly
    t = tiles.layout(w)
    assert t.shape == (4, 3, 16, 16, 2) and tiles.is_tiled(t) and not tiles.is_tiled(w)
    corners = [(0, 0, 0, 0, 0), (3, 2, 15, 15, 1), (1, 2, 7, 4, 0), (2, 0, 3, 9, 1)]
    for block_out, block_in, pair, column, half in corners:
        want = w[16 * block_out + column, 32 * block_in + 2 * pair + half]
        assert t[block_out, block_in, pair, column, half] == want


@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (64, 64)])
def test_weights_the_kernel_does_not_take_are_refused(shape):
    w = torch.zeros(*shape, dtype=torch.bfloat16)
    assert tiles.fits(w) == (shape == (64, 64))
    assert not tiles.fits(w.float()) and tiles.tiled_if_served(w.float()) is None
    if shape != (64, 64):
        with pytest.raises(ValueError, match="no tile layout"):
            tiles.layout(w)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b, "none", [], "")


@pytest.mark.parametrize(("out", "fan_in"), [(64, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_up_to_32_rows_the_products_are_onednns_to_the_bit(served, out, fan_in, bias):
    g = torch.Generator().manual_seed(out + fan_in)
    w = torch.randn(out, fan_in, generator=g).to(torch.bfloat16)
    b = torch.randn(out, generator=g).to(torch.bfloat16) if bias else None
    t = tiles.layout(w)
    for rows in (1, 2, 7, 15, 16, 17, 31, 32):
        x = torch.randn(rows, fan_in, generator=g).to(torch.bfloat16)
        assert torch.equal(tiles.product(x, t, b), _onednn(x, w, b)), rows
        assert torch.equal(tiles.packed_product(x, t, b), _onednn(x, w, b)), rows
        assert torch.equal(tiles.bound_product(t, b)(x), _onednn(x, w, b)), rows


def test_past_32_rows_each_row_is_the_sum_it_is_alone_and_close_to_the_exact_product(served):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 576, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 50, 576, generator=g).to(torch.bfloat16)  # 100 rows, in two dimensions
    t = tiles.layout(w)
    y = tiles.product(x, t, b)
    assert y.shape == (2, 50, 96) and y.dtype == torch.bfloat16
    rows = x.reshape(100, 576)
    for i in (0, 31, 32, 63, 64, 99):
        assert torch.equal(y.reshape(100, 96)[i], tiles.product(rows[i : i + 1], t, b)[0]), i
    exact = x.double() @ w.double().t() + b.double()
    # Within one bfloat16 step of the exact value (its 8 bits: 2^-7 of the power of two below it),
    # the sum in float32 and one rounding: far less than that.
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-3))) - 7)
    assert ((y.double() - exact).abs() <= step).all()
    assert tiles.product(rows[:0], t, b).shape == (0, 96)


def test_the_product_refuses_rows_and_biases_that_do_not_fit(served):
    t = tiles.layout(torch.zeros(64, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in 96, bfloat16"):
        tiles.product(torch.zeros(2, 64, dtype=torch.bfloat16), t, None)
    with pytest.raises(ValueError, match="in 96, bfloat16"):
        tiles.product(torch.zeros(2, 96), t, None)
    with pytest.raises(ValueError, match="a bias of 64"):
        tiles.product(torch.zeros(2, 96, dtype=torch.bfloat16), t, torch.zeros(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a bias of 64"):
        tiles.product(torch.zeros(2, 96, dtype=torch.bfloat16), t, torch.zeros(64))
    with pytest.raises(ValueError, match="in 96"):
        tiles.product(torch.tensor(1.0, dtype=torch.bfloat16), t, None)
    with pytest.raises(ValueError, match="not a contiguous CPU tile layout"):
        tiles.product(torch.zeros(2, 96, dtype=torch.bfloat16), t[:3], None)  # an odd count of column blocks
    rows = torch.ones(2, 96, dtype=torch.bfloat16, requires_grad=True)  # computed, as oneDNN's: no gradient kept
    assert torch.equal(tiles.product(rows, t, None), torch.zeros(2, 64, dtype=torch.bfloat16))


def test_a_bound_product_checks_its_weight_once_and_its_rows_at_every_call(served):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    t = tiles.layout(w)
    onednn = tiles.bound_product(torch.ops.mkldnn._reorder_linear_weight(w, None), b)
    by_tiles = tiles.bound_product(t, b)
    x = torch.randn(3, 5, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(by_tiles(x), onednn(x)) and by_tiles(x).shape == (3, 5, 64)  # rows in three dimensions
    columns = torch.randn(96, 4, generator=g).to(torch.bfloat16).t()  # [4, 96], not contiguous
    assert torch.equal(by_tiles(columns), _onednn(columns.contiguous(), w, b))
    with pytest.raises(ValueError, match="in 96, bfloat16"):
        by_tiles(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="in 96, bfloat16"):
        by_tiles(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a bias of 64"):
        tiles.bound_product(t, torch.zeros(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="is not packed"):
        tiles.bound_product(w, b)


PROMPTS = {"a": [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55, 89, 144, 7, 9], "b": [1, 7, 7, 200], "c": [9, 4, 2]}


@pytest.mark.parametrize(("family", "hidden"), [("smollm2", 96), ("qwen2", 64)])  # qwen2: biases on q, k and v
def test_a_stage_on_tiles_gives_the_logits_and_tokens_of_one_on_onednn(served, tmp_path, monkeypatch, family, hidden):
    """Widths that are multiples of 32 (every layer's weights fit the tiles; the head's 211 columns
    stay oneDNN's): prefill, decode batches (the decode path) and a lone row (the row path), each to
    the bit against the same stage with oneDNN's packed weights."""
    make_tiny_checkpoint(family, tmp_path, hidden_size=hidden, intermediate_size=128)
    on_tiles = load_stage(tmp_path, LayerRange(0, 4), dtype=torch.bfloat16)
    monkeypatch.setattr(tiles, "tiled_if_served", lambda weight: None)  # what `tiles.pack` asks
    on_onednn = load_stage(tmp_path, LayerRange(0, 4), dtype=torch.bfloat16)
    packed = {
        way: [m for m in stage.modules() if isinstance(m, PackedLinear)]
        for way, stage in (("tiles", on_tiles), ("onednn", on_onednn))
    }
    assert [tiles.is_tiled(m.weight_packed) for m in packed["tiles"]] == [True] * 16 + [False]  # the head
    assert not any(tiles.is_tiled(m.weight_packed) for m in packed["onednn"])
    pipes = [LocalPipeline([on_tiles]), LocalPipeline([on_onednn])]
    for stage in (on_tiles, on_onednn):
        stage.set_threads(2)
    greedy = [pipe.greedy(dict(PROMPTS), 6) for pipe in pipes]  # prefill, then decode batches of 3
    alone = [pipe.greedy({"d": PROMPTS["a"]}, 6) for pipe in pipes]  # one row a step
    assert greedy[0] == greedy[1] and alone[0] == alone[1]
    steps = [pipe.step({"a": [5], "b": [6], "c": [7]}) for pipe in pipes]
    assert torch.equal(steps[0], steps[1])
    one = [pipe.step({"d": [8]}) for pipe in pipes]
    assert torch.equal(one[0], one[1])


@pytest.mark.skipif(not COMPILER, reason="no C compiler")
def test_a_build_without_amx_code_declines_and_multiplies_nothing(tmp_path):
    """What a CPU without AMX (or a build without `-march=native`) gets: not ready, and a product
    call that says so and writes nothing."""
    import ctypes
    import subprocess

    library = tmp_path / "tiles.so"
    source = next(path for path in native.SOURCES if path.name == "tiles.c")
    subprocess.run([str(COMPILER), *native.FLAGS, "-o", str(library), str(source)], check=True)
    built = ctypes.CDLL(str(library))
    ready, product = built.layerline_tiles_ready, built.layerline_tile_linear
    ready.restype = ctypes.c_int
    product.argtypes, product.restype = native.SIGNATURES["tile_linear"]
    y = torch.full((2, 32), 7.0, dtype=torch.bfloat16)
    x, t = torch.ones(2, 32, dtype=torch.bfloat16), tiles.layout(torch.ones(32, 32, dtype=torch.bfloat16))
    assert ready() == 0
    assert product(x.data_ptr(), t.data_ptr(), None, 2, 32, 32, 1, y.data_ptr()) == 1
    assert torch.equal(y, torch.full((2, 32), 7.0, dtype=torch.bfloat16))
