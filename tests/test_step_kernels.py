"""The compiled kernels bound to a decode step (stage_worker/step_kernels.py): a lone decoding
row's rotary, KV writes and attention through them give the logits, the greedy tokens and the KV
that torch's operations give on the row path, each layer through the kernels; arguments that do
not fit what a step bound are refused."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import rows, step_kernels
from layerline.stage_worker.fused import torch_rms_norm
from layerline.stage_worker.weights import load_stage

from .pipeline import cache_for
from .tiny_models import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55]
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"),
]


@pytest.mark.parametrize("width", [104, 128])  # SiLU's halves: not taken by its kernel, taken (norms bound)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_row_through_the_kernels_gives_torchs_logits_tokens_and_kv(tmp_path, monkeypatch, dtype, width):
    make_tiny_checkpoint("smollm2", tmp_path, intermediate_size=width)
    stage = load_stage(tmp_path, LayerRange(0, 4), dtype=dtype)
    stage.set_threads(2)
    calls, norms = [], []
    attend, norm = step_kernels.StepKernels.attend, step_kernels.StepKernels.norm

    def counted(self, qkv, k_pool, v_pool):
        calls.append(k_pool.data_ptr())
        return attend(self, qkv, k_pool, v_pool)

    def counted_norm(self, x, weight, eps):
        norms.append(weight.data_ptr())
        return norm(self, x, weight, eps)

    monkeypatch.setattr(step_kernels.StepKernels, "attend", counted)
    monkeypatch.setattr(step_kernels.StepKernels, "norm", counted_norm)
    caches = {way: cache_for(stage) for way in ("kernels", "torch")}
    new, seen = {way: list(PROMPT) for way in caches}, {way: [] for way in caches}
    for step in range(6):
        logits = {}
        for way, cache in caches.items():
            if way == "torch":
                monkeypatch.setattr(rows, "bind", lambda *args, **kwargs: None)
            else:
                monkeypatch.setattr(rows, "bind", step_kernels.bind)
            cache.reserve("s", len(new[way]))
            layout = cache.plan_step(["s"], [len(new[way])])
            with torch.no_grad():
                logits[way] = stage(torch.tensor(new[way]), cache=cache, layout=layout, logit_rows=layout.last_rows())
            seen[way].append(int(logits[way][-1].argmax()))
            new[way] = [seen[way][-1]]
        # float32 sums in another order (the attention); bfloat16 rounds the same sums at 0.004 near 1
        tolerance = 1e-5 if dtype == torch.float32 else 0.03
        torch.testing.assert_close(logits["kernels"], logits["torch"], atol=tolerance, rtol=0)
        if step == 0:  # the prompt is a prefill: neither way takes the row path
            assert calls == []
    assert seen["kernels"] == seen["torch"]
    layers = stage.layer_range
    assert len(calls) == 5 * len(layers)  # every layer of every decoding step through the kernels
    assert calls[: len(layers)] == [caches["kernels"].k[i].data_ptr() for i in layers]
    assert len(norms) == (5 * 2 * len(layers) if width == 128 else 0)  # two a layer, where bound
    first, kernels, torchs = layers.start, caches["kernels"], caches["torch"]
    # Layer 0's values to the bit, its keys as torch rotates them (the row path's float32 rotary is
    # one product, equal to rounding); later layers' inputs carry the attention's other order.
    assert torch.equal(kernels.v[first], torchs.v[first])
    key_tolerance = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(kernels.k[first], torchs.k[first], atol=key_tolerance, rtol=0)
    for i in layers:
        torch.testing.assert_close(kernels.k[i], torchs.k[i], atol=tolerance, rtol=0)
        torch.testing.assert_close(kernels.v[i], torchs.v[i], atol=tolerance, rtol=0)


def test_a_bound_step_refuses_pools_and_rows_it_was_not_bound_for(tmp_path):
    make_tiny_checkpoint("smollm2", tmp_path, intermediate_size=128)
    stage = load_stage(tmp_path, LayerRange(0, 2))
    cache = cache_for(stage)
    cache.reserve("s", 3)
    cache.plan_step(["s"], [3])
    cache.reserve("s", 1)
    layout = cache.plan_step(["s"], [1])
    cos, sin = stage.rope(layout.positions, torch.float32)
    h, kvh, d = stage.shards.num_heads, stage.shards.num_kv_heads, stage.config.head_dim
    kernels = step_kernels.bind(layout, cos, sin, pool=cache.k[0], heads=h, silu_width=128)
    assert kernels is not None
    qkv = torch.randn(1, (h + 2 * kvh) * d)
    assert kernels.attend(qkv, cache.k[0], cache.v[0]).shape == (1, h * d)
    with pytest.raises(ValueError, match=r"the key pool must be a contiguous \[512, 2, 8\] torch.float32"):
        kernels.attend(qkv, cache.k[0][:-1], cache.v[0])
    with pytest.raises(ValueError, match=r"the value pool must be a contiguous .* not .* torch.bfloat16"):
        kernels.attend(qkv, cache.k[0], cache.v[0].bfloat16())
    with pytest.raises(ValueError, match="qkv must be"):
        kernels.attend(qkv[:, :-1], cache.k[0], cache.v[0])
    assert kernels.norms  # halves of 128: SiLU's kernel takes them
    x = torch.randn(1, stage.config.hidden_size)
    assert torch.equal(kernels.norm(x, torch.ones(x.shape[1]), 1e-5), torch_rms_norm(x, torch.ones(x.shape[1]), 1e-5))
    with pytest.raises(ValueError, match="the rows to normalize must be"):
        kernels.norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    y, weight = torch.randn(1, x.shape[1]), torch.randn(x.shape[1])
    total, normed = kernels.add_norm(x, y, weight, 1e-5)
    assert torch.equal(total, x + y) and torch.equal(normed, torch_rms_norm(x + y, weight, 1e-5))
    with pytest.raises(ValueError, match="the rows added to the residual must be"):
        kernels.add_norm(x, torch.randn(2, x.shape[1]), weight, 1e-5)
    with pytest.raises(ValueError, match="SiLU of halves 104 wide was not bound"):
        kernels.silu(torch.randn(1, 208))
    # halves of 104: SiLU's kernel does not take them, so neither RMSNorm nor SiLU is bound
    unbound = step_kernels.bind(layout, cos, sin, pool=cache.k[0], heads=h, silu_width=104)
    assert unbound is not None and not unbound.norms
    with pytest.raises(ValueError, match="RMSNorm was not bound"):
        unbound.norm(x, torch.ones(x.shape[1]), 1e-5)
    with pytest.raises(ValueError, match="RMSNorm was not bound"):
        unbound.add_norm(x, y, weight, 1e-5)
    with pytest.raises(ValueError, match="cos must be"):
        step_kernels.bind(layout, cos[..., :-2], sin[..., :-2], pool=cache.k[0], heads=h, silu_width=128)
    # bfloat16 cos and sin for float32 pools: not the kernels' (one dtype for all), torch's way
    assert step_kernels.bind(layout, cos.bfloat16(), sin.bfloat16(), pool=cache.k[0], heads=h, silu_width=128) is None
