"""RMSNorm through the compiled kernel: torch's numbers to the bit, or torch's operations."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.stage_worker import native, norms, paged_attention
from layerline.stage_worker.llama import StageModel
from layerline.stage_worker.rows import row_norm

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
    """`compiled_kernel` and `norm_kernel` decide again in this test, and again after it (asked for
    before monkeypatch, so that its patches are undone first)."""
    paged_attention.compiled_kernel.cache_clear()
    norms.norm_kernel.cache_clear()
    yield
    paged_attention.compiled_kernel.cache_clear()
    norms.norm_kernel.cache_clear()


def spread(*shape: int, seed: int) -> torch.Tensor:
    """Random values over a wide range of magnitudes: where another order of the sum, or one
    rounding where torch has two, shows in the last bit."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * torch.randn(*shape, generator=generator).mul(2).exp()


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
        assert torch.equal(ours, norms.torch_rms_norm(x, weight, eps))


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
            assert torch.equal(norms.rms_norm(a, w, 1e-5), norms.torch_rms_norm(a, w, 1e-5)), why
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
        assert norms.norm_kernel() is None
    assert "does not sum or round as torch does" in caplog.text
    x, weight = spread(3, 64, seed=0), spread(64, seed=1)
    assert torch.equal(norms.rms_norm(x, weight, 1e-5), norms.torch_rms_norm(x, weight, 1e-5))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_and_a_lone_row_normalize_as_torch_does(fresh_choice, kernel, monkeypatch, dtype):
    """The model's RMSNorm modules and the lone row's norm (rows.py) run the kernel where it serves,
    with the numbers of torch's operations: equal to the bit either way."""
    monkeypatch.setenv("LAYERLINE_HOME", str(kernel.path.parent.parent))
    assert norms.norm_kernel() is not None
    x, weight = spread(1, 576, seed=3).to(dtype), spread(576, seed=4).to(dtype)
    assert torch.equal(row_norm(x, weight, 1e-5), norms.torch_rms_norm(x, weight, 1e-5))
    config = ModelConfig.from_dict(
        {"model_type": "llama", "hidden_size": 72, "intermediate_size": 96, "num_hidden_layers": 1, "vocab_size": 64,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8, "rms_norm_eps": 1e-5}
    )  # fmt: skip
    torch.manual_seed(0)
    norm = StageModel(config, LayerRange(0, 1)).to(dtype).layers["0"].input_layernorm
    torch.nn.init.normal_(norm.weight)
    hidden = spread(6, 72, seed=5).to(dtype)
    with torch.inference_mode():
        through_kernel = norm(hidden)
        monkeypatch.setattr(norms, "norm_kernel", lambda: None)
        assert torch.equal(through_kernel, norm(hidden))
