"""A decode batch's attention straight off the paged KV pools, by the compiled kernel and by
torch's operations, gives the numbers of the gather and torch's kernel, whatever the pools hold
outside each sequence's positions."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.stage_worker import kernel_args
from layerline.stage_worker.fused import norm_kernel, silu_kernel
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache, StepLayout
from layerline.stage_worker.llama import StageModel, batch_decode_attention, gathered_decode_attention
from layerline.stage_worker.paged_attention import (
    bag_indices,
    bagged_decode_attention,
    compiled_kernel,
    paged_decode_attention,
    rotary_kernel,
)

pytestmark = pytest.mark.timeout(60)
FLOAT_OVER_BF16 = pytest.param(torch.float32, torch.bfloat16, id="float32-over-bfloat16")
HAS_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(params=["compiled", "torch"])
def pools_path(request, monkeypatch, kernel_home):
    """`paged_decode_attention` through the compiled kernel (built in a home of this module's),
    then through torch's operations."""
    monkeypatch.setenv("LAYERLINE_HOME", str(kernel_home))
    for name in ("LAYERLINE_KERNELS", "CC"):
        monkeypatch.delenv(name, raising=False)
    compiled_kernel.cache_clear()
    if request.param == "compiled":
        if not HAS_COMPILER:
            pytest.skip("no C compiler on this machine")
        assert compiled_kernel() is not None  # a compiler is here: the kernel must build and agree
    else:
        monkeypatch.setattr("layerline.stage_worker.paged_attention.compiled_kernel", lambda: None)
    norm_kernel.cache_clear()
    silu_kernel.cache_clear()
    yield request.param
    compiled_kernel.cache_clear()
    norm_kernel.cache_clear()
    silu_kernel.cache_clear()
    rotary_kernel.cache_clear()


def scattered_batch(lengths: list[int], *, kv_heads: int, block_size: int = 4) -> tuple[PagedKVCache, StepLayout]:
    """A pool whose sequences' blocks interleave (they grew a token at a time, side by side),
    every slot random, then one decode step of each: its layout."""
    cache = PagedKVCache(CacheShape(64, block_size, kv_heads, 8), layer_ids=range(1), dtype=torch.float32)
    names = [f"s{i}" for i in range(len(lengths))]
    for name in names:
        cache.reserve(name, 1)
    cache.plan_step(names, [1] * len(names))
    for step in range(1, max(lengths)):
        growing = [n for n, length in zip(names, lengths, strict=True) if length > step]
        for name in growing:
            cache.reserve(name, 1)
        cache.plan_step(growing, [1] * len(growing))
    generator = torch.Generator().manual_seed(0)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=generator))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=generator))
    for name in names:
        cache.reserve(name, 1)
    return cache, cache.plan_step(names, [1] * len(names))


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (6, 1)])
def test_a_decode_batch_off_the_pools_equals_the_gather_and_torchs_kernel(heads, kv_heads, pools_path):
    lengths = [3, 9, 1, 14, 6]
    cache, layout = scattered_batch(lengths, kv_heads=kv_heads)
    assert layout.decode_blocks.shape == (5, 4)  # padded to the longest, 15 tokens
    blocks = layout.decode_blocks.flatten().tolist()
    assert blocks != sorted(blocks)  # the sequences' blocks interleave in the pool
    q = torch.randn(len(lengths), heads, 8, generator=torch.Generator().manual_seed(1))
    out = paged_decode_attention(q, cache.k[0], cache.v[0], layout=layout)
    assert out.shape == (5, heads * 8)
    reference = gathered_decode_attention(q, cache.k[0], cache.v[0], layout=layout)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    if pools_path == "compiled":  # a later layer's call reuses the batch the first checked
        batch = layout.memo["decode_batch"]
        assert torch.equal(paged_decode_attention(q, cache.k[0], cache.v[0], layout=layout), out)
        assert layout.memo["decode_batch"] is batch


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_torchs_operations_read_up_to_the_longest_context_once_a_step(heads, kv_heads):
    cache, layout = scattered_batch([3, 9, 1, 14, 6], kv_heads=kv_heads)
    q = torch.randn(5, heads, 8, generator=torch.Generator().manual_seed(1))
    out = bagged_decode_attention(q, cache.k[0], cache.v[0], layout=layout)
    # It reads each sequence up to the batch's longest context, 15, not to its blocks' end, 16:
    # reading the masked 16th changes only the rounding of the softmax's vectorized sums.
    assert layout.decode_length == 15 and bag_indices(layout, heads=heads, kv_heads=kv_heads).mask.shape[-1] == 15
    whole_blocks = dataclasses.replace(layout, decode_length=16)
    padded = bagged_decode_attention(q, cache.k[0], cache.v[0], layout=whole_blocks)
    torch.testing.assert_close(out, padded, rtol=1e-6, atol=1e-7)
    # The bags' indices are made once a step and kept for every later layer.
    assert bag_indices(layout, heads=heads, kv_heads=kv_heads) is bag_indices(layout, heads=heads, kv_heads=kv_heads)


def test_positions_a_sequence_does_not_hold_weigh_nothing(pools_path):
    """What sits in a sequence's blocks beyond its length (another's stale KV, huge values) never
    reaches its output."""
    cache, layout = scattered_batch([2, 13], kv_heads=3)
    q = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(2))
    before = paged_decode_attention(q, cache.k[0], cache.v[0], layout=layout)
    held = torch.zeros(cache.k[0].shape[0], dtype=torch.bool)
    for row, length in enumerate((3, 14)):  # the positions each holds after this step's write
        slots = (layout.decode_blocks[row][:, None] * layout.block_size + torch.arange(layout.block_size)).flatten()
        held[slots[:length]] = True
    cache.k[0][~held] = 1e30
    cache.v[0][~held] = -1e30
    after = paged_decode_attention(q, cache.k[0], cache.v[0], layout=layout)
    assert torch.equal(before, after)


def test_bfloat16_takes_the_pools_path_with_the_kernel_and_the_gather_without(monkeypatch, pools_path):
    """Float32 pools always read straight off the pools; bfloat16 ones only by the compiled kernel
    (which widens them to float32), else the gather and torch's kernel. Either way a bfloat16
    query gets bfloat16 out, within bfloat16's rounding of the float32 answer."""
    taken: list[torch.dtype] = []
    monkeypatch.setattr(
        "layerline.stage_worker.llama.paged_decode_attention",
        lambda q, k, v, *, layout: taken.append(k.dtype) or paged_decode_attention(q, k, v, layout=layout),
    )
    cache, layout = scattered_batch([4, 7], kv_heads=3)
    q = torch.randn(2, 9, 8)
    full = batch_decode_attention(q, cache.k[0], cache.v[0], layout=layout)
    half = cache.k[0].to(torch.bfloat16), cache.v[0].to(torch.bfloat16)
    out = batch_decode_attention(q.to(torch.bfloat16), *half, layout=layout)
    compiled = [torch.float32, torch.bfloat16] if pools_path == "compiled" else [torch.float32]
    assert taken == compiled and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), full, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_layer_through_the_kernels_rotary_is_torchs_to_the_bit(pools_path, dtype, monkeypatch):
    """An attention layer's decode batch with rotary and the KV writes in the compiled kernel
    gives exactly what it gives through torch's operations: the same attention follows either
    way, so the layer's output and both pools are equal to the bit."""
    config = ModelConfig.from_dict(
        {"model_type": "llama", "vocab_size": 64, "hidden_size": 72, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8, "rms_norm_eps": 1e-5}
    )  # fmt: skip
    torch.manual_seed(0)
    model = StageModel(config, LayerRange(0, 1)).to(dtype)
    attention = model.layers["0"].self_attn
    cache, layout = scattered_batch([4, 7, 1], kv_heads=3)
    x = torch.randn(3, 72, dtype=dtype)
    cos, sin = model.rope(layout.positions, dtype)
    rotary_kernel.cache_clear()
    assert (rotary_kernel() is not None) == (pools_path == "compiled")
    outs = []
    for rotary in ("kernel", "torch"):
        if rotary == "torch":
            monkeypatch.setattr("layerline.stage_worker.paged_attention.rotary_kernel", lambda: None)
        k_pool, v_pool = cache.k[0].to(dtype), cache.v[0].to(dtype)
        with torch.inference_mode():
            out = attention(x, cos, sin, k_pool=k_pool, v_pool=v_pool, layout=dataclasses.replace(layout))
        outs.append((out, k_pool, v_pool))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


SHAPES = [  # (heads, kv heads, head size, block): groups of 3, 8 (4 heads at once), 1; more threads than heads
    (9, 3, 8, 4),
    (16, 2, 64, 16),
    (8, 1, 128, 16),
    (2, 2, 16, 4),
]


@pytest.mark.parametrize("pools_path", ["compiled"], indirect=True)
@pytest.mark.parametrize(("q_dtype", "pool_dtype"), [(torch.float32,) * 2, (torch.bfloat16,) * 2, FLOAT_OVER_BF16])
@pytest.mark.parametrize("rows", ["uneven", "lone", "run"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}b{}".format(*s))
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_attention_gives_the_same_bits_whatever_the_threads(threads, shape, rows, q_dtype, pool_dtype, pools_path):
    """Rows go to whichever thread is free, and where there are fewer runs than threads each run's
    query heads are cut in parts (mid kv head too; more threads than cores, heads or rows): each
    head of each row is still one thread's, summed in the same order as one thread sums it."""
    h, kvh, d, block = shape
    slots = 64 * block
    gen = torch.Generator().manual_seed(threads * 100 + h)
    k_pool, v_pool = (torch.randn(slots, kvh, d, generator=gen).to(pool_dtype) for _ in range(2))
    blocks = torch.randperm(64, generator=gen)
    width = 5
    if rows == "run":  # one sequence's consecutive rows (a prompt's, a token and its drafts): one run
        lens = torch.arange(2 * block - 3, 2 * block + 3)
        tables = blocks[:width].repeat(len(lens), 1)
    else:
        uneven = [1, 2 * block, 3 * block + 5, block - 1, 4 * block]
        lens = torch.tensor(uneven if rows == "uneven" else [3 * block + 7])
        tables = blocks[: width * len(lens)].view(len(lens), width)
    batch = kernel_args.decode_batch(tables.contiguous(), lens, block=block, slots=slots)
    q = torch.randn(len(lens), h, d, generator=gen).to(q_dtype)
    kernel = compiled_kernel()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel(q, k_pool, v_pool, batch)
        torch.set_num_threads(threads)
        for _ in range(3):
            assert torch.equal(kernel(q, k_pool, v_pool, batch), alone)
    finally:
        torch.set_num_threads(before)
    # and the numbers are attention's: each row over its own positions, through torch
    for i, length in enumerate(lens.tolist()):
        positions = torch.tensor([int(tables[i, p // block]) * block + p % block for p in range(length)])
        keys, values = k_pool[positions].float(), v_pool[positions].float()
        group = h // kvh
        scores = torch.einsum("hd,phd->hp", q[i].float(), keys.repeat_interleave(group, dim=1)) * d**-0.5
        expected = torch.einsum("hp,phd->hd", scores.softmax(-1), values.repeat_interleave(group, dim=1))
        tolerance = 0.02 if torch.bfloat16 in (q_dtype, pool_dtype) else 1e-4
        torch.testing.assert_close(alone[i].float().view(h, d), expected, rtol=tolerance, atol=tolerance)
