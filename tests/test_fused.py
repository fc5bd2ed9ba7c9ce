"""RMSNorm and the MLP's SiLU through the compiled kernels: torch's numbers to the bit, or torch's operations."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.stage_worker import fused, native, paged_attention, tiles
from layerline.stage_worker import rows as rows_module
from layerline.stage_worker.llama import StageModel
from layerline.stage_worker.rows import row_norm, row_silu_mul

pytestmark = pytest.mark.timeout(120)
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Iterator[native.PagedAttentionKernel]:
    """The kernels, compiled once for this module into a home of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERLINE_HOME", str(tmp_path_factory.mktemp("kernels")))
        for name in (native.ENV, "CC"):
            patch.delenv(name, raising=False)
        yield native.load()


@pytest.fixture
def fresh_choice():
    """`compiled_kernel`, `norm_kernel` and `silu_kernel` decide again in this test, and again after it (asked for
    before monkeypatch, so that its patches are undone first)."""
    for cached in (paged_attention.compiled_kernel, fused.norm_kernel, fused.silu_kernel, tiles.tile_kernel):
        cached.cache_clear()
    yield
    for cached in (paged_attention.compiled_kernel, fused.norm_kernel, fused.silu_kernel, tiles.tile_kernel):
        cached.cache_clear()


def spread(*shape: int, seed: int) -> torch.Tensor:
    """Random values over a wide range of magnitudes: where another order of the sum, or one
    rounding where torch has two, shows in the last bit."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * torch.randn(*shape, generator=generator).mul(2).exp()


def tiny_layer(dtype: torch.dtype) -> Any:
    """Layer 0 of a one-layer Llama of random weights: hidden 72, MLP halves of 96 (a width the SiLU takes)."""
    config = ModelConfig.from_dict(
        {"model_type": "llama", "hidden_size": 72, "intermediate_size": 96, "num_hidden_layers": 1, "vocab_size": 64,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8, "rms_norm_eps": 1e-5}
    )  # fmt: skip
    torch.manual_seed(0)
    return StageModel(config, LayerRange(0, 1)).to(dtype).layers["0"]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [(1, 576), (32, 576), (7, 8), (9, 15), (4, 100), (3, 1536), (2, 8192), (200, 576), (2, 5, 64)],
    ids=str,
)
def test_rms_norm_is_torchs_numbers(kernel, dtype, shape):
    """Rows of whole vectors of 8 and not, one group of 4 vectors and many levels of 16, one row
    and enough for the parallel loop (200 x 576), and a 3-D batch: torch.equal, both dtypes."""
    x = spread(*shape, seed=sum(shape)).to(dtype)
    weight = spread(shape[-1], seed=1).to(dtype)
    for eps in (1e-5, 1e-6):
        ours = kernel.rms_norm(x, weight, eps)
        assert ours.shape == x.shape and ours.dtype == dtype
        assert torch.equal(ours, fused.torch_rms_norm(x, weight, eps))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (7, 8), (9, 15), (3, 1536), (14, 576), (200, 576)], ids=str)
def test_a_residuals_sum_and_its_norm_in_one_call_are_torchs_numbers(kernel, dtype, shape):
    """`add_rms_norm`: x + y as torch rounds it in the dtype, and RMSNorm of that, torch.equal to torch's
    `x + y` and `torch_rms_norm` of it; rows on one thread and past the parallel loop's 8192."""
    x, y = spread(*shape, seed=sum(shape)).to(dtype), spread(*shape, seed=7).to(dtype)
    weight = spread(shape[-1], seed=1).to(dtype)
    total, normed = fused.add_rms_norm(kernel, x, y, weight, 1e-5)
    assert torch.equal(total, x + y)
    assert torch.equal(normed, fused.torch_rms_norm(x + y, weight, 1e-5))


@needs_compiler
def test_a_residuals_sum_and_norm_refuses_what_the_norm_does_not_take(kernel):
    x, weight = spread(4, 64, seed=0), spread(64, seed=1)
    refused = {
        "rows of another shape": (x, spread(3, 64, seed=2)),
        "unlike dtypes": (x, x.to(torch.bfloat16)),
        "a strided row": (x, spread(4, 128, seed=2)[:, ::2]),
        "a 3-D batch": (x.view(2, 2, 64), x.view(2, 2, 64)),
    }
    for a, b in refused.values():
        with pytest.raises(ValueError, match="not taken"):
            fused.add_rms_norm(kernel, a, b, weight, 1e-5)


@needs_compiler
def test_a_kernel_whose_sum_is_not_rounded_leaves_rmsnorm_to_torch(kernel, fresh_choice, monkeypatch, caplog):
    """A residual's sum kept in float32 into the norm (not rounded to bfloat16 first) gives other
    bits: the check refuses the kernel's norms, and torch's operations keep them."""

    def unrounded(k, x, y, weight, eps):
        wide = x.float() + y.float()
        return wide.to(x.dtype), fused.torch_rms_norm(wide, weight.float(), eps).to(x.dtype)

    monkeypatch.setattr(fused, "add_rms_norm", unrounded)
    with caplog.at_level(logging.WARNING):
        assert fused.norm_kernel() is None
    assert "does not sum or round as torch does" in caplog.text


@needs_compiler
def test_rms_norm_takes_only_what_it_computes_as_torch_does(kernel):
    x, weight = spread(4, 64, seed=0), spread(64, seed=1)
    assert kernel.takes_norm(x, weight)
    refused = {
        "rows shorter than a vector": (spread(4, 7, seed=0), spread(7, seed=1)),
        "unlike dtypes": (x.to(torch.bfloat16), weight),
        "half precision": (x.half(), weight.half()),
        "a strided row": (spread(4, 128, seed=0)[:, ::2], weight),
        "a gradient to keep": (x, weight.clone().requires_grad_()),
    }
    for why, (a, w) in refused.items():
        assert not kernel.takes_norm(a, w), why
        with pytest.raises(ValueError, match="not taken"):
            kernel.rms_norm(a, w, 1e-5)
        with torch.no_grad():  # torch's operations serve them
            assert torch.equal(fused.rms_norm(a, w, 1e-5), fused.torch_rms_norm(a, w, 1e-5)), why
    assert not kernel.takes_norm(x, spread(65, seed=1))  # a weight of another width: torch refuses it too


def test_a_kernel_whose_norm_rounds_otherwise_leaves_rmsnorm_to_torch(fresh_choice, monkeypatch, caplog):
    """A build that fused the squares' multiply-adds into the sum (one rounding, not two) gives other
    last bits on some rows: the stage keeps torch's operations for RMSNorm then, and says so."""

    class Fused:
        path = Path("fused.so")

        def rms_norm(self, x, weight, eps):
            wide = x.double()
            scale = (wide.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps).rsqrt()
            return (weight.double() * (wide * scale).to(x.dtype).double()).to(x.dtype)

    monkeypatch.setattr(paged_attention, "compiled_kernel", Fused)
    with caplog.at_level(logging.WARNING):
        assert fused.norm_kernel() is None
    assert "does not sum or round as torch does" in caplog.text
    x, weight = spread(3, 64, seed=0), spread(64, seed=1)
    assert torch.equal(fused.rms_norm(x, weight, 1e-5), fused.torch_rms_norm(x, weight, 1e-5))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_and_a_lone_row_normalize_as_torch_does(fresh_choice, kernel, monkeypatch, dtype):
    """The model's RMSNorm modules and the lone row's norm (rows.py) run the kernel where it serves,
    with the numbers of torch's operations: equal to the bit either way."""
    monkeypatch.setenv("LAYERLINE_HOME", str(kernel.path.parent.parent))
    assert fused.norm_kernel() is not None
    x, weight = spread(1, 576, seed=3).to(dtype), spread(576, seed=4).to(dtype)
    assert torch.equal(row_norm(x, weight, 1e-5), fused.torch_rms_norm(x, weight, 1e-5))
    norm = tiny_layer(dtype).input_layernorm
    torch.nn.init.normal_(norm.weight)
    hidden = spread(6, 72, seed=5).to(dtype)
    with torch.inference_mode():
        through_kernel = norm(hidden)
        monkeypatch.setattr(fused, "norm_kernel", lambda: None)
        assert torch.equal(through_kernel, norm(hidden))


EDGES = [float("inf"), float("-inf"), float("nan"), 200.0, -200.0, 104.5, -104.5, 0.0, -0.0, 1e-30, 88.7, -87.4]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN where NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (32, 1536), (3, 32), (100, 96), (2, 4096), (40, 64)], ids=str)
def test_silu_mul_is_torchs_numbers(kernel, dtype, rows, width):
    """Values over +-100 and the edges of e^x (0 below -104, inf above 100, infinities, NaN), one row
    and enough for the parallel loop: equal to `F.silu(gate) * up` to the bit, both dtypes."""
    for scale in (1.0, 8.0, 60.0):
        gate_up = (spread(rows, 2 * width, seed=rows + width) * scale).to(dtype)
        assert same(kernel.silu_mul(gate_up), fused.torch_silu_mul(gate_up))
    edges = torch.tensor(EDGES * (2 * width // len(EDGES) + 1))[: 2 * width].repeat(rows, 1).to(dtype)
    edges[:, width:] = spread(rows, width, seed=2).to(dtype)  # the edges through the gate, times finite ups
    assert same(kernel.silu_mul(edges), fused.torch_silu_mul(edges))


@needs_compiler
def test_silu_takes_only_widths_torch_vectorizes_whole(kernel, fresh_choice, monkeypatch):
    """A half of 48 or 100 would put elements on torch's scalar path, whose e^x is another function's:
    those widths (and strided, half-precision or differentiable inputs) stay with torch's kernels."""
    monkeypatch.setenv("LAYERLINE_HOME", str(kernel.path.parent.parent))
    assert kernel.takes_silu(spread(4, 128, seed=0))
    refused = {
        "a half of 48": spread(4, 96, seed=0),
        "a half of 100": spread(4, 200, seed=0),
        "a strided row": spread(4, 256, seed=0)[:, ::2],
        "half precision": spread(4, 128, seed=0).half(),
        "a gradient to keep": spread(4, 128, seed=0).requires_grad_(),
    }
    for why, gate_up in refused.items():
        assert not kernel.takes_silu(gate_up), why
        with pytest.raises(ValueError, match="not taken"):
            kernel.silu_mul(gate_up)
        with torch.no_grad():
            assert same(fused.silu_mul(gate_up), fused.torch_silu_mul(gate_up)), why
    assert fused.silu_kernel(48) is None and fused.silu_kernel(64) is not None


def test_a_kernel_whose_silu_rounds_otherwise_leaves_it_to_torch(fresh_choice, monkeypatch, caplog):
    """A build whose e^x is not torch's (here: in double precision) gives other last bits: torch's
    operations stay for the SiLU, and the log says so."""

    class Other:
        path = Path("other.so")
        takes_silu = staticmethod(native.PagedAttentionKernel.takes_silu)

        def silu_mul(self, gate_up):
            gate, up = gate_up.double().chunk(2, dim=-1)
            return (torch.nn.functional.silu(gate).to(gate_up.dtype).double() * up).to(gate_up.dtype)

    monkeypatch.setattr(paged_attention, "compiled_kernel", Other)
    with caplog.at_level(logging.WARNING):
        assert fused.silu_kernel(64) is None
    assert "does not round as torch does at width 64" in caplog.text


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mlp_and_a_lone_row_give_torchs_numbers_through_the_kernel(fresh_choice, kernel, monkeypatch, dtype):
    monkeypatch.setenv("LAYERLINE_HOME", str(kernel.path.parent.parent))
    mlp = tiny_layer(dtype).mlp
    hidden = spread(6, 72, seed=5).to(dtype)
    gate_up = spread(1, 2 * 1536, seed=6).to(dtype)
    with torch.inference_mode():
        assert fused.silu_kernel(96) is not None
        through_kernel, row = mlp(hidden), row_silu_mul(gate_up)
        monkeypatch.setattr(fused, "silu_kernel", lambda width: None)
        monkeypatch.setattr(rows_module, "silu_kernel", lambda width: None)
        assert same(through_kernel, mlp(hidden))
        assert same(row, row_silu_mul(gate_up))
