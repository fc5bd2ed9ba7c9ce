"""The compiled attention kernel: built once per machine into the cache, checked before it is
trusted, refused arguments that would reach past the pools, and torch's path wherever it is off,
missing or wrong."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch

from layerline.stage_worker import fused, kernel_args, native, paged_attention, tiles
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache, StepLayout
from layerline.stage_worker.llama import gathered_decode_attention, swap_halves

pytestmark = pytest.mark.timeout(120)
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


def _kernel_cache(patch: pytest.MonkeyPatch, home: Path) -> Path:
    """`native.load()` reads and writes `home`'s cache, with the default choice and compiler."""
    patch.setenv("LAYERLINE_HOME", str(home))
    patch.delenv(native.ENV, raising=False)
    patch.delenv("CC", raising=False)
    return home


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own, empty: `native.load()` compiles into it."""
    return _kernel_cache(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A cache the kernel was compiled into once for this module (a compile takes seconds)."""
    with pytest.MonkeyPatch.context() as patch:
        home = _kernel_cache(patch, tmp_path_factory.mktemp("kernels"))
        native.load()
    return home


@pytest.fixture
def built(compiled, monkeypatch) -> Path:
    """This module's compiled cache: `native.load()` finds the kernel there."""
    return _kernel_cache(monkeypatch, compiled)


@pytest.fixture
def fresh_choice():
    """`compiled_kernel` decides again in this test, and again after it."""
    for cached in (paged_attention.compiled_kernel, fused.norm_kernel, fused.silu_kernel, tiles.tile_kernel):
        cached.cache_clear()
    yield
    for cached in (paged_attention.compiled_kernel, fused.norm_kernel, fused.silu_kernel, tiles.tile_kernel):
        cached.cache_clear()


def uneven_batch(lengths: list[int], *, dtype: torch.dtype, seed: int) -> tuple[PagedKVCache, StepLayout]:
    """Sequences of `lengths` positions (the last one this step's) in blocks of 16 with SmolLM2's
    kv heads, every slot random, and the layout of their decode step."""
    cache = PagedKVCache(CacheShape(700, 16, 3, 64), layer_ids=range(1), dtype=dtype)
    names = [f"s{i}" for i in range(len(lengths))]
    for name, length in zip(names, lengths, strict=True):
        cache.reserve(name, length - 1)
        cache.plan_step([name], [length - 1])
    generator = torch.Generator().manual_seed(seed)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=generator))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=generator))
    for name in names:
        cache.reserve(name, 1)
    layout = cache.plan_step(names, [1] * len(names))
    assert layout.decode_lens.tolist() == lengths
    return cache, layout


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_long_and_uneven_contexts_equal_the_gather(built, threads):
    """32 sequences of 1-300 positions in blocks of 16, SmolLM2's heads, on one and two threads."""
    kernel = native.load()
    cache, layout = uneven_batch([1 + (i * 97) % 300 for i in range(32)], dtype=torch.float32, seed=3)
    q = torch.randn(32, 9, 64, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = kernel_args.decode_batch(layout.decode_blocks, layout.decode_lens, block=16, slots=700 * 16)
        out = kernel(q, cache.k[0], cache.v[0], batch)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, gathered_decode_attention(q, cache.k[0], cache.v[0], layout=layout))


@needs_compiler
def test_bfloat16_pools_are_widened_as_they_are_read(built):
    """Bfloat16 pools give float32 attention over the same values, rounded once at the end to the
    query's dtype: 32 sequences of 1-300 positions, SmolLM2's heads."""
    kernel = native.load()
    cache, layout = uneven_batch([1 + (i * 89) % 300 for i in range(32)], dtype=torch.bfloat16, seed=4)
    q = torch.randn(32, 9, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    batch = kernel_args.decode_batch(layout.decode_blocks, layout.decode_lens, block=16, slots=700 * 16)
    out = kernel(q, cache.k[0], cache.v[0], batch)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 9 * 64)
    wide = kernel(q.float(), cache.k[0], cache.v[0], batch)  # a float32 query: float32 out, not rounded
    assert wide.dtype == torch.float32 and torch.equal(wide.to(torch.bfloat16), out)
    k32, v32 = cache.k[0].float(), cache.v[0].float()
    float_layout = dataclasses.replace(layout, mask_dtype=torch.float32)
    torch.testing.assert_close(wide, gathered_decode_attention(q.float(), k32, v32, layout=float_layout))
    torch.testing.assert_close(wide, kernel(q.float(), k32, v32, batch))


@needs_compiler
def test_compiled_once_into_the_cache_then_found_there(home):
    first = native.load()
    assert first.path.parent == home / "kernels" and first.path.suffix == ".so"
    built = first.path.stat().st_mtime_ns
    again = native.load()
    assert again.path == first.path and again.path.stat().st_mtime_ns == built
    assert [p.name for p in (home / "kernels").iterdir()] == [first.path.name]  # no partial file left


@needs_compiler
def test_arguments_that_would_reach_past_the_pools_are_refused(built):
    kernel = native.load()
    tables = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"decode lengths must lie in 1\.\.8"):
        kernel_args.decode_batch(tables, torch.tensor([9, 2]), block=4, slots=16)
    with pytest.raises(ValueError, match=r"decode lengths must lie in 1\.\.8"):
        kernel_args.decode_batch(tables, torch.tensor([0, 2]), block=4, slots=16)
    with pytest.raises(ValueError, match=r"block ids must lie in 0\.\.3"):
        kernel_args.decode_batch(tables + 1, torch.tensor([8, 2]), block=4, slots=16)
    batch = kernel_args.decode_batch(tables, torch.tensor([8, 2]), block=4, slots=16)
    pool = torch.zeros(16, 1, 8)
    with pytest.raises(ValueError, match="do not fit"):
        kernel(torch.zeros(2, 2, 8), pool, torch.zeros(32, 1, 8), batch)  # a pool of another size
    with pytest.raises(ValueError, match="3 queries for 2 sequences"):
        kernel(torch.zeros(3, 2, 8), pool, pool, batch)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors"):
        kernel(torch.zeros(2, 2, 8, dtype=torch.float16), pool, pool, batch)
    with pytest.raises(ValueError, match="unlike dtypes"):
        kernel(torch.zeros(2, 2, 8), pool, pool.to(torch.bfloat16), batch)


def test_turned_off_or_without_a_compiler_the_stage_keeps_torchs_path(home, monkeypatch, fresh_choice, caplog):
    monkeypatch.setenv(native.ENV, "torch")
    with pytest.raises(native.KernelUnavailable, match="LAYERLINE_KERNELS=torch"):
        native.load()
    with caplog.at_level(logging.INFO, logger="layerline.stage_worker.paged_attention"):
        assert paged_attention.compiled_kernel() is None
    assert "torch's operations (no compiled kernel: LAYERLINE_KERNELS=torch)" in caplog.text
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ValueError, match="LAYERLINE_KERNELS='fast': must be 'auto'"):
        native.load()
    monkeypatch.setenv(native.ENV, "auto")
    monkeypatch.setenv("CC", str(home / "no-such-cc"))
    with pytest.raises(native.KernelUnavailable, match="no-such-cc --version"):
        native.load()
    monkeypatch.delenv("CC")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.KernelUnavailable, match="no C compiler"):
        native.load()


@needs_compiler
def test_a_compiler_that_fails_leaves_nothing_behind(home, monkeypatch):
    broken = home / "broken.c"
    broken.write_text("int layerline_paged_attention(void) { return syntax error; }\n")
    monkeypatch.setattr(native, "SOURCES", (broken, *native.SOURCES[1:]))
    with pytest.raises(native.KernelUnavailable, match=r"compiling failed: .*-march=native.*; .*-O3"):
        native.load()
    assert list((home / "kernels").iterdir()) == []


def test_a_kernel_that_disagrees_with_torch_is_not_used(monkeypatch, fresh_choice, caplog):
    class Wrong:
        path = Path("/wrong.so")

        def __call__(self, q, k_pool, v_pool, batch):
            return torch.zeros(q.shape[0], q.shape[1] * q.shape[2])

    monkeypatch.setattr(native, "load", Wrong)
    with caplog.at_level(logging.WARNING, logger="layerline.stage_worker.paged_attention"):
        assert paged_attention.compiled_kernel() is None
    assert "/wrong.so is off by" in caplog.text


@needs_compiler
def test_scores_far_apart_strided_queries_and_pools_it_cannot_read(built):
    """Scores spread by hundreds (the exp's clamp and smallest exponent), a query that is a view
    into the step's qkv rows as llama.py passes it, and pools that are not one piece, refused."""
    kernel = native.load()
    generator = torch.Generator().manual_seed(5)
    cache = PagedKVCache(CacheShape(32, 4, 2, 16), layer_ids=range(1), dtype=torch.float32)
    for name, length in (("a", 30), ("b", 7)):
        cache.reserve(name, length)
        cache.plan_step([name], [length])
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=generator))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=generator))
    for name in ("a", "b"):
        cache.reserve(name, 1)
    layout = cache.plan_step(["a", "b"], [1, 1])
    qkv = torch.randn(2, 6 + 2 * 2, 16, generator=generator) * 100  # [T, h + 2 kvh, d]
    q = qkv.split([6, 4], dim=1)[0]
    assert not q.is_contiguous()
    batch = kernel_args.decode_batch(layout.decode_blocks, layout.decode_lens, block=4, slots=128)
    out = kernel(q, cache.k[0], cache.v[0], batch)
    reference = gathered_decode_attention(q.contiguous(), cache.k[0], cache.v[0], layout=layout)
    scores = torch.einsum("hd,ld->hl", q[0, :3].contiguous(), cache.k[0][:31, 0]) * 16**-0.5
    assert float((scores.max(-1).values - scores.min(-1).values).min()) > 200  # every head past the clamp at -87.3
    # Scores of hundreds carry float32 rounding of about 1e-5 into the weights, either way.
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="must be contiguous"):
        kernel(q, cache.k[0].transpose(0, 1).contiguous().transpose(0, 1), cache.v[0], batch)


@needs_compiler
def test_a_cache_others_may_write_is_not_loaded_from(home):
    (home / "kernels").mkdir(mode=0o777)
    (home / "kernels").chmod(0o777)
    with pytest.raises(native.KernelUnavailable, match="others may write it: not loaded"):
        native.load()


@needs_compiler
def test_one_openmp_runtime_in_the_process_and_a_second_refused(built, tmp_path, monkeypatch):
    native.load()
    with open("/proc/self/maps", encoding="utf-8") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(runtimes) == 1  # the kernel's libgomp.so.1 is torch's
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 0 08:01 1 /venv/torch/lib/libgomp.so.1\n7f02-7f03 r-xp 0 08:01 2 /usr/lib/libgomp.so.1\n"
    )
    monkeypatch.setattr(native, "MAPS", str(maps))
    with pytest.raises(native.KernelUnavailable, match="two OpenMP runtimes"):
        native.load()


def test_a_kernel_that_answers_nan_is_not_used(monkeypatch, fresh_choice):
    class Nan:
        path = Path("/nan.so")

        def __call__(self, q, k_pool, v_pool, batch):
            return torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"))

    monkeypatch.setattr(native, "load", Nan)
    assert paged_attention.compiled_kernel() is None


def rotary_step(n: int, *, heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int):
    """qkv of `n` rows, the rotary of positions far apart (cos and the signed sin as llama.py
    makes them) and zeroed pools of 40 slots."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, heads + 2 * kv_heads, d, generator=generator) * 30).to(dtype)
    angles = torch.randint(0, 30000, (n, 1), generator=generator).float() * torch.rand(d // 2, generator=generator)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :].to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)[:, None, :].to(dtype)
    pools = torch.zeros(40, kv_heads, d, dtype=dtype), torch.zeros(40, kv_heads, d, dtype=dtype)
    return qkv, cos, sin, pools


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "d"), [(32, 9, 3, 64), (3, 4, 4, 16), (40, 6, 1, 128)])
def test_rotary_and_stores_are_torchs_numbers(built, dtype, n, heads, kv_heads, d):
    """Bit for bit what llama.py's operations give: q * cos + swap_halves(q) * sin for the queries
    and keys (each product and the sum rounded to the dtype), the keys and values written to the
    step's slots, and no other pool row touched. 40 rows of 1920 go through the parallel loop."""
    kernel = native.load()
    qkv, cos, sin, (k_pool, v_pool) = rotary_step(n, heads=heads, kv_heads=kv_heads, d=d, dtype=dtype, seed=n)
    slots = torch.randperm(40)[:n]
    stores = kernel_args.write_slots(slots, pool_slots=40)
    q = kernel.rotate_and_store(qkv, cos, sin, k_pool, v_pool, stores, heads=heads)
    qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
    rotated = qk * cos + swap_halves(qk) * sin
    assert torch.equal(q, rotated[:, :heads]) and q.is_contiguous()
    assert torch.equal(k_pool[slots], rotated[:, heads:]) and torch.equal(v_pool[slots], v)
    untouched = torch.ones(40, dtype=torch.bool).index_fill_(0, slots, False)
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@needs_compiler
def test_rotary_refuses_slots_outside_the_pools_and_unlike_tensors(built):
    kernel = native.load()
    qkv, cos, sin, (k_pool, v_pool) = rotary_step(2, heads=4, kv_heads=2, d=16, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"0\.\.39"):
        kernel_args.write_slots(torch.tensor([3, 40]), pool_slots=40)
    with pytest.raises(ValueError, match=r"0\.\.39"):
        kernel_args.write_slots(torch.tensor([-1, 2]), pool_slots=40)
    slots = kernel_args.write_slots(torch.tensor([3, 5]), pool_slots=40)
    with pytest.raises(ValueError, match="checked against 40 pool rows, not 20"):
        kernel.rotate_and_store(qkv, cos, sin, k_pool[:20], v_pool[:20], slots, heads=4)
    with pytest.raises(ValueError, match="all of one dtype"):
        kernel.rotate_and_store(qkv, cos.to(torch.bfloat16), sin, k_pool, v_pool, slots, heads=4)
    with pytest.raises(ValueError, match="with 5 heads"):
        kernel.rotate_and_store(qkv, cos, sin, k_pool, v_pool, slots, heads=5)
    with pytest.raises(ValueError, match="3 slots for 2 rows"):
        kernel.rotate_and_store(
            qkv, cos, sin, k_pool, v_pool, kernel_args.write_slots(torch.tensor([1, 2, 3]), pool_slots=40), heads=4
        )
    assert not k_pool.any() and not v_pool.any()  # nothing refused wrote anything


def test_a_kernel_whose_rotary_rounds_otherwise_leaves_rotary_to_torch(monkeypatch, caplog):
    """A build that fused a multiply-add (one rounding, not three) would give other numbers than
    the modules': the stage keeps torch's operations for rotary then, and says so."""

    class Fused:
        path = Path("fused.so")

        def rotate_and_store(self, qkv, cos, sin, k_pool, v_pool, slots, *, heads):
            qk = qkv[:, : qkv.shape[1] - k_pool.shape[1]].float()
            out = torch.addcmul(qk * cos.float(), swap_halves(qk), sin.float()).to(qkv.dtype)
            k_pool.index_copy_(0, slots.slots, out[:, heads:])
            v_pool.index_copy_(0, slots.slots, qkv[:, qk.shape[1] :])
            return out[:, :heads].contiguous()

    monkeypatch.setattr(paged_attention, "compiled_kernel", Fused)
    paged_attention.rotary_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert paged_attention.rotary_kernel() is None
    finally:
        paged_attention.rotary_kernel.cache_clear()
    assert "does not round as torch does" in caplog.text
