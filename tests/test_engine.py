"""Stage engine and sampler: per-sequence validation, KV exhaustion, sampling rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import paged_attention, sampler
from layerline.stage_worker.engine import SequenceStep, StageEngine, StepInputError
from layerline.stage_worker.kv_cache import CacheShape, KVCacheExhausted, PagedKVCache
from layerline.stage_worker.sampler import SamplingParams, greedy, sample
from layerline.stage_worker.weights import load_stage

from .tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine")
    make_tiny_checkpoint("smollm2", path)
    return path


def engine(ckpt, layers: LayerRange, *, num_blocks: int = 32) -> StageEngine:
    model = load_stage(ckpt, layers)
    cfg = model.config
    cache = PagedKVCache(
        CacheShape(num_blocks, 4, cfg.num_kv_heads, cfg.head_dim), layer_ids=layers, dtype=torch.float32
    )
    return StageEngine(model, cache)


def two_stage_greedy(first: StageEngine, last: StageEngine, prompts: dict[str, list[int]], n: int):
    out = {s: [] for s in prompts}
    steps = [SequenceStep(s, tuple(range(len(p))), tuple(p)) for s, p in prompts.items()]
    for _ in range(n):
        a = first.run(steps)
        b = last.run(a.kept, a.hidden)
        assert not a.errors and not b.errors
        steps = []
        for s in prompts:
            tok = b.draws[s].token_id
            out[s].append(tok)
            pos = len(prompts[s]) + len(out[s]) - 1
            steps.append(SequenceStep(s, (pos,), (tok,)))
    return out


def test_two_engines_decode_like_one_pipeline(ckpt):
    from .pipeline import LocalPipeline

    prompts = {"x": [1, 5, 9, 30, 31], "y": [1, 2], "z": [7] * 11}
    got = two_stage_greedy(engine(ckpt, LayerRange(0, 2)), engine(ckpt, LayerRange(2, 4)), prompts, 12)
    ref = LocalPipeline([load_stage(ckpt, LayerRange(0, 4))]).greedy(prompts, 12)
    assert got == ref


def test_bad_sequences_fail_alone(ckpt):
    first = engine(ckpt, LayerRange(0, 2))
    first.run([SequenceStep("known", (0, 1, 2), (1, 2, 3))])
    out = first.run(
        [
            SequenceStep("known", (3,), (4,)),  # fine
            SequenceStep("skip", (0, 2), (1, 2)),  # positions skip
            SequenceStep("known2", (0,), (9999,)),  # outside the vocabulary
            SequenceStep("ghost", (7,), (1,)),  # unknown sequence
            SequenceStep("known", (4,), (5,)),  # twice in one step
        ]
    )
    assert [s.sequence_id for s in out.kept] == ["known"]
    msgs = {e.sequence_id: str(e.error) for e in out.errors}
    assert "consecutive" in msgs["skip"]
    assert "token id 9999 is outside the vocabulary [0, 211)" in msgs["known2"]
    assert "unknown sequence id 'ghost'" in msgs["ghost"]
    assert "appears twice" in msgs["known"]
    assert out.hidden is not None and out.hidden.shape == (1, 48)
    repeat = first.run([SequenceStep("known", (3,), (4,))])
    assert "start at 3, expected 4" in str(repeat.errors[0].error)
    assert first.cache.sequences() == ["known"]  # no blocks held for the rejected sequences


def test_a_later_stage_runs_the_rows_of_the_sequences_it_keeps(ckpt):
    hidden = torch.randn(6, 48)  # rows: a a a | bad bad | b
    middle = engine(ckpt, LayerRange(1, 3))
    out = middle.run([SequenceStep("a", (0, 1, 2)), SequenceStep("bad", (0, 2)), SequenceStep("b", (0,))], hidden)
    assert [s.sequence_id for s in out.kept] == ["a", "b"]
    alone = engine(ckpt, LayerRange(1, 3)).run(
        [SequenceStep("a", (0, 1, 2)), SequenceStep("b", (0,))], hidden[[0, 1, 2, 5]]
    )
    assert out.hidden is not None and alone.hidden is not None
    assert torch.equal(out.hidden, alone.hidden)


def test_hidden_shape_must_match_positions(ckpt):
    last = engine(ckpt, LayerRange(2, 4))
    with pytest.raises(StepInputError, match=r"hidden states have shape \(3, 48\)"):
        last.run([SequenceStep("a", (0, 1), ())], torch.zeros(3, 48))


def test_kv_exhaustion_fails_only_the_sequence_that_does_not_fit(ckpt):
    first = engine(ckpt, LayerRange(0, 2), num_blocks=4)  # 16 token slots
    out = first.run(
        [
            SequenceStep("small", (0, 1, 2), (1, 2, 3)),
            SequenceStep("big", tuple(range(20)), tuple(range(20))),
            SequenceStep("small2", (0, 1, 2, 3, 4), (1, 2, 3, 4, 5)),
        ]
    )
    assert [s.sequence_id for s in out.kept] == ["small", "small2"]
    assert isinstance(out.errors[0].error, KVCacheExhausted)
    assert "'big' needs 5 more block(s), 3 free" in str(out.errors[0].error)
    assert first.cache.blocks_free == 1
    assert first.release("small") and first.release("small2")
    assert not first.release("big")
    assert first.cache.blocks_free == first.cache.blocks_total == 4


def test_a_shared_prefix_is_copied_and_gives_the_same_tokens(ckpt):
    """b starts with a's first 6 tokens: both stages copy them and compute only b's rest."""
    first, last = engine(ckpt, LayerRange(0, 2)), engine(ckpt, LayerRange(2, 4))
    greedy = SamplingParams(temperature=0.0)
    a, b = [1, 5, 9, 30, 31, 40, 41, 42], [1, 5, 9, 30, 31, 40, 7, 8, 9]

    def run(steps):
        out = first.run(steps)
        done = last.run(out.kept, out.hidden)
        assert not out.errors and not done.errors
        return {s: d.token_id for s, d in done.draws.items()}

    run([SequenceStep("a", tuple(range(8)), tuple(a), sampling=greedy)])
    free = first.cache.blocks_free
    shared = run([SequenceStep("b", tuple(range(6, 9)), tuple(b[6:]), sampling=greedy, prefix_from="a")])
    assert first.cache.length("b") == last.cache.length("b") == 9
    assert first.cache.blocks_free == free - 3  # 9 tokens in blocks of 4: b owns its own copy
    whole = run([SequenceStep("c", tuple(range(9)), tuple(b), sampling=greedy)])
    assert shared["b"] == whole["c"]
    for layer in first.cache.k:  # the copied K rows are a's, bit for bit
        table_a, table_b = first.cache._tables["a"], first.cache._tables["b"]
        for p in range(6):
            slot_a, slot_b = (t[p // 4] * 4 + p % 4 for t in (table_a, table_b))
            assert torch.equal(first.cache.k[layer][slot_b], first.cache.k[layer][slot_a])
    for e in (first, last):
        e.release("a")
        e.release("b")  # a's blocks and b's are separate: releasing both frees both
        e.release("c")
        assert e.cache.blocks_free == e.cache.blocks_total


@pytest.mark.parametrize(
    "step,message",
    [
        (SequenceStep("b", (3, 4), (5, 6), prefix_from="nobody"), "prefix_from 'nobody': that sequence holds 0"),
        (SequenceStep("b", (9, 10), (5, 6), prefix_from="a"), "holds 4 token(s) here, fewer than the 9 to copy"),
        (SequenceStep("b", (0, 1), (5, 6), prefix_from="a"), "must start past position 0"),
        (SequenceStep("a", (4,), (5,), prefix_from="a"), "already holds KV here"),
        (SequenceStep("b", (2,), (5,), prefix_from="b"), "names itself in prefix_from"),
    ],
)
def test_a_bad_prefix_fails_only_its_sequence(ckpt, step, message):
    first = engine(ckpt, LayerRange(0, 2))
    first.run([SequenceStep("a", (0, 1, 2, 3), (1, 2, 3, 4))])
    free = first.cache.blocks_free
    out = first.run([step, SequenceStep("a", (4,), (9,))] if step.sequence_id != "a" else [step])
    assert [e.sequence_id for e in out.errors] == [step.sequence_id]
    assert message in str(out.errors[0].error)
    assert step.sequence_id == "a" or "b" not in first.cache  # nothing was copied
    assert first.cache.blocks_free >= free - 1


def test_a_step_alone_on_its_chain_takes_the_prefill_threads(ckpt):
    e = engine(ckpt, LayerRange(0, 2), num_blocks=128)
    e.max_threads, e.prefill_threads = 1, 2
    before = torch.get_num_threads()
    try:
        seen = []
        for sid, n, alone in (("a", 64, True), ("b", 64, False), ("c", 1, True), ("d", 1, False), ("e", 16, True)):
            e.run([SequenceStep(sid, tuple(range(n)), tuple(range(1, n + 1)))], alone=alone)
            seen.append((torch.get_num_threads(), e.model.step_threads.count))
        assert seen == [(2, 2), (1, 1), (2, 2), (1, 1), (2, 2)]  # alone: the chain's threads, whatever its size
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (3, 49152), (8, 49152), (32, 49152), (9, 32000), (8, 49157)])
def test_greedy_picks_what_argmax_picks_among_ties_infinities_and_nan(rows, vocab, path, monkeypatch):
    """Through the compiled argmax (kernels/argmax.c), and through torch's reductions: from 8 rows
    on, 49152 and 32000 logits are reduced in slices of 1024 and 1000 first; 49157 has no such
    divisor and is reduced whole, as fewer rows are."""
    _argmax_path(path, monkeypatch)
    gen = torch.Generator().manual_seed(rows)
    for trial in range(20):
        logits = torch.randint(-2, 3, (rows, vocab), generator=gen).float()  # ties everywhere, far apart too
        if trial % 4 == 0:  # signed zeros are equal: the first of them
            logits[:, :] = torch.where(torch.rand(rows, vocab, generator=gen) < 0.5, logits, -logits)
            logits[logits > 0] = -1.0
        if trial % 4 == 1:
            logits[0, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
        if trial % 4 == 2:
            logits[-1] = float("-inf")
        if trial % 4 == 3:
            logits[0, [vocab - 9152, 5]] = float("inf")
        assert greedy(logits) == logits.argmax(-1).tolist()
        wide = F.pad(logits, (0, 7), value=float("nan"))[:, :vocab]  # a view whose rows are not contiguous
        assert greedy(wide) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_greedy_picks_what_argmax_picks_where_a_vectorized_argmax_goes_wrong(path, monkeypatch):
    """Short rows, a maximum only in the tail or in a vector's last lane, ties across lanes, NaN at
    either end (sampler.edge_rows), one row at a time and as a batch of equal widths."""
    _argmax_path(path, monkeypatch)
    rows = sampler.edge_rows()
    for row in rows:
        assert greedy(row) == row.argmax(-1).tolist()
    batch = torch.cat([row for row in rows if row.shape[1] == 49157])
    assert greedy(batch) == batch.argmax(-1).tolist()


def _argmax_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy through torch's reductions, or through the compiled argmax: asserted to serve where
    the library builds with vectors (AVX2, AVX-512), skipped where it cannot."""
    if path == "torch":
        monkeypatch.setattr(sampler, "argmax_kernel", lambda: None)
        return
    kernel = paged_attention.compiled_kernel()
    if kernel is None or not kernel.unchecked["argmax_vectorized"]():
        pytest.skip("no vectorized compiled argmax here (no C compiler, no AVX2, or LAYERLINE_KERNELS=torch)")
    assert sampler.argmax_kernel() is not None  # it passed its check against torch


def test_greedy_and_top_k_one_agree_and_seeds_reproduce():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = sample(logits, [SamplingParams()] * 3, histories=[()] * 3, positions=[0, 1, 2])
    assert [d.token_id for d in greedy] == logits.argmax(-1).tolist()
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert [d.token_id for d in sample(logits, [top1] * 3, histories=[()] * 3, positions=[0] * 3)] == [
        d.token_id for d in greedy
    ]
    seeded = [SamplingParams(temperature=1.5, seed=7, top_p=0.9, min_p=0.01)] * 3
    a = sample(logits, seeded, histories=[()] * 3, positions=[4, 4, 4])
    b = sample(logits, seeded, histories=[()] * 3, positions=[4, 4, 4])
    assert [d.token_id for d in a] == [d.token_id for d in b]
    draws = [sample(logits[:1], seeded[:1], histories=[()], positions=[p])[0].token_id for p in range(40)]
    assert len(set(draws)) > 1  # different positions draw differently


def test_repetition_penalty_and_logprobs():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]])
    plain = sample(logits, [SamplingParams(logprobs=2)], histories=[(0,)], positions=[0])[0]
    assert plain.token_id == 0
    assert [t for t, _ in plain.top] == [0, 1]
    assert plain.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())
    penalized = sample(logits, [SamplingParams(repetition_penalty=1.2)], histories=[(0,)], positions=[0])
    assert penalized[0].token_id == 1


@pytest.mark.parametrize(
    "params,field",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_bad_sampling_params_are_named(params, field):
    with pytest.raises(ValueError, match=field):
        params.check()


def test_a_sequence_belongs_to_the_chain_it_started_on(ckpt):
    """A step of another chain can neither continue a sequence nor copy its KV (prefix_from)."""
    first = engine(ckpt, LayerRange(0, 2))
    assert not first.run([SequenceStep("mine", tuple(range(6)), (1, 2, 3, 4, 5, 6))], chain="a\0b").errors
    other = first.run(
        [
            SequenceStep("mine", (6,), (7,)),
            SequenceStep("thief", (5,), (6,), prefix_from="mine"),
        ],
        chain="c\0b",
    )
    assert [(e.sequence_id, str(e.error)) for e in other.errors] == [
        ("mine", "sequence 'mine': it belongs to another chain, not to this step's"),
        ("thief", "prefix_from names 'mine': it belongs to another chain, not to this step's"),
    ]
    assert "thief" not in first.cache
    same = first.run(
        [SequenceStep("mine", (6,), (7,)), SequenceStep("friend", (5,), (6,), prefix_from="mine")], chain="a\0b"
    )
    assert not same.errors and [s.sequence_id for s in same.kept] == ["mine", "friend"]
    assert first.release("mine") and first.release("friend")
    assert not first.run([SequenceStep("mine", (0,), (1,))], chain="c\0b").errors  # freed: a new sequence


def test_a_lone_decoding_sequence_reads_its_kv_as_one_run_of_slots():
    """`StepLayout.decode_slots`: one decoding sequence whose blocks follow each other reads its
    context as a slice of the pool; a fragmented table, two sequences or a prefill chunk do not."""
    cache = PagedKVCache(CacheShape(8, 4, 1, 2), layer_ids=range(1), dtype=torch.float32)
    cache.reserve("a", 6)  # blocks 0, 1
    cache.plan_step(["a"], [6])
    cache.reserve("a", 1)
    assert cache.plan_step(["a"], [1]).decode_slots == slice(0, 7)
    cache.reserve("b", 3)  # block 2
    cache.reserve("a", 2)  # a's third block is 3: still a run
    layout = cache.plan_step(["a"], [1])
    assert layout.decode_slots == slice(0, 8)
    cache.plan_step(["b"], [3])
    cache.reserve("a", 1)
    cache.reserve("b", 1)
    assert cache.plan_step(["a", "b"], [1, 1]).decode_slots is None  # two sequences: the gather
    cache.release("b")  # block 2 comes back first
    cache.reserve("c", 1)  # block 2
    cache.reserve("a", 4)  # a needs its fourth block: 4, after 0, 1, 3
    layout = cache.plan_step(["a"], [1])
    assert cache._tables["a"] == [0, 1, 3, 4] and layout.decode_slots is None
    cache.reserve("a", 2)
    assert cache.plan_step(["a"], [2]).decode_slots is None  # more than one token: a prefill span


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_decoding_sequences_masks_the_rest_of_their_blocks(dtype):
    """`StepLayout.decode_mask` is added to the attention scores: 0 for each held position, -inf
    for the rest of the gathered blocks, in the pools' dtype (made once a step, not per layer)."""
    cache = PagedKVCache(CacheShape(8, 4, 1, 2), layer_ids=range(1), dtype=dtype)
    for sequence_id, tokens in (("a", 2), ("b", 6)):
        cache.reserve(sequence_id, tokens)
        cache.plan_step([sequence_id], [tokens])
    cache.reserve("a", 1)
    cache.reserve("b", 1)
    mask = cache.plan_step(["a", "b"], [1, 1]).decode_mask
    assert mask.dtype == dtype and mask.shape == (2, 1, 1, 8)
    held = [[0.0] * 3 + [float("-inf")] * 5, [0.0] * 7 + [float("-inf")]]
    assert mask[:, 0, 0].tolist() == held


def test_the_pool_hands_out_consecutive_blocks_where_it_can():
    """Blocks follow a sequence's last one where free, else the first free run long enough, else
    the lowest free ones: sequences that came and went leave the next one a run of blocks."""
    cache = PagedKVCache(CacheShape(8, 2, 1, 2), layer_ids=range(1), dtype=torch.float32)

    def add(sequence_id: str, tokens: int) -> None:
        cache.reserve(sequence_id, tokens)
        cache.plan_step([sequence_id], [tokens])

    add("a", 2)  # [0]
    add("b", 2)  # [1]
    add("a", 2)  # a's next block, 1, is b's: the first free one, 2
    add("b", 2)  # b's next, 2, is taken: 3
    assert cache._tables == {"a": [0, 2], "b": [1, 3]}
    cache.release("a")
    cache.release("b")
    add("c", 6)
    assert cache._tables["c"] == [0, 1, 2]  # a run, where a stack would have given 3, 1, 2 or so
    add("d", 2)  # 3
    add("c", 2)  # 3 is d's: the first free block, 4
    cache.release("d")
    add("e", 4)  # two blocks: the first run of two free is 5, 6 (3 alone is free before it)
    assert cache._tables["c"] == [0, 1, 2, 4] and cache._tables["e"] == [5, 6]
    add("f", 4)  # no run of two left (3 and 7 are free, apart): the lowest free ones
    assert cache._tables["f"] == [3, 7] and cache.blocks_free == 0
    with pytest.raises(KVCacheExhausted):
        cache.reserve("g", 1)
