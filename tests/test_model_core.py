"""The model core against transformers: logits, greedy decoding, layer splits, bad input."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from layerline.shared.model_config import ConfigError, LayerRange, ModelConfig
from layerline.stage_worker.weights import CheckpointError, CheckpointReader, load_stage, owned_tensor_names

from .pipeline import LocalPipeline
from .tiny_models import FAMILIES, make_tiny_checkpoint

PROMPTS = {
    "a": [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55, 89, 144],
    "b": [1, 7, 7, 7, 200],
    "c": [1, 150, 2, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75],
    "d": [9],
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_checkpoint(request.param, out)
    return request.param, out, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_prefill_logits_match_transformers(tiny):
    _, path, hf = tiny
    pipe = LocalPipeline([load_stage(path, LayerRange(0, 4))])
    for ids in PROMPTS.values():
        pipe = LocalPipeline([pipe.stages[0]])
        ours = pipe.step({"s": ids}, all_logits=True)
        torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_mixed_batch_and_chunked_prefill_match_transformers(tiny):
    """Sequences at different positions share a step: chunks of prompts beside decode tokens."""
    _, path, hf = tiny
    pipe = LocalPipeline([load_stage(path, LayerRange(0, 4))])
    a, c = PROMPTS["a"], PROMPTS["c"]
    pipe.step({"a": a[:5], "c": c[:1]})
    # a: a second prefill chunk; c: one decode-shaped token at position 1; d: a fresh sequence.
    logits = pipe.step({"a": a[5:11], "c": c[1:2], "d": PROMPTS["d"]}, all_logits=True)
    torch.testing.assert_close(logits[0:6], hf_logits(hf, a[:11])[5:11], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[6], hf_logits(hf, c[:2])[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[7], hf_logits(hf, PROMPTS["d"])[0], atol=1e-4, rtol=0)


def test_greedy_32_tokens_equal_transformers_generate(tiny):
    _, path, hf = tiny
    pipe = LocalPipeline([load_stage(path, LayerRange(0, 4))])
    ours = pipe.greedy(PROMPTS, 32)  # all four sequences decode together in one batch
    for name, ids in PROMPTS.items():
        assert ours[name] == hf_greedy(hf, ids, 32), name


@pytest.mark.parametrize("cuts", [(2,), (1, 3)])
def test_split_ranges_chain_to_the_unsplit_logits(tiny, cuts):
    _, path, _ = tiny
    whole = LocalPipeline([load_stage(path, LayerRange(0, 4))])
    bounds = (0, *cuts, 4)
    readers = [CheckpointReader(path) for _ in (*cuts, 4)]
    stages = [load_stage(path, LayerRange(s, e), reader=r) for (s, e), r in zip(itertools.pairwise(bounds), readers)]
    split = LocalPipeline(stages)
    for ids in (PROMPTS["a"], PROMPTS["c"]):
        torch.testing.assert_close(
            split.step({ids[0]: ids}, all_logits=True),
            whole.step({ids[0]: ids}, all_logits=True),
            atol=1e-5,
            rtol=0,
        )
    config = ModelConfig.from_checkpoint(path)
    for (s, e), reader in zip(itertools.pairwise(bounds), readers):
        owned = set(owned_tensor_names(config, LayerRange(s, e)).values())
        if config.tie_word_embeddings and e == 4:
            owned = owned - {"lm_head.weight"} | {"model.embed_tokens.weight"}
        assert set(reader.read) == owned
        assert len(reader.read) == len(owned)  # nothing read twice
        assert all(
            n.startswith(("model.embed_tokens", "model.norm", "lm_head")) or s <= int(n.split(".")[2]) < e
            for n in reader.read
        )


def test_sharded_checkpoint_opens_only_the_shards_it_needs(tmp_path):
    hf = make_tiny_checkpoint("llama3", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    reader = CheckpointReader(tmp_path)
    stage = load_stage(tmp_path, LayerRange(2, 4), reader=reader)
    opened = set(reader._handles)
    needed = {index["weight_map"][n] for n in reader.read}
    assert opened == needed
    assert len(opened) < len(set(index["weight_map"].values()))
    first = load_stage(tmp_path, LayerRange(0, 2))
    logits = LocalPipeline([first, stage]).step({"s": PROMPTS["a"]}, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS["a"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_transformers_at_the_same_dtype(tmp_path, dtype):
    hf = make_tiny_checkpoint("smollm2", tmp_path).to(dtype)
    pipe = LocalPipeline([load_stage(tmp_path, LayerRange(0, 4), dtype=dtype)])
    ours = pipe.step({"s": PROMPTS["a"]}, all_logits=True)
    theirs = hf_logits(hf, PROMPTS["a"])
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 0.1
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.9
    from layerline.stage_worker.layouts import PackedLinear, can_pack

    packed = [m for m in pipe.stages[0].modules() if isinstance(m, PackedLinear)]  # bfloat16 packs, alone
    assert len(packed) == (4 * 4 + 1 if can_pack(dtype, "cpu") else 0) and all(m.plain is None for m in packed)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint("llama3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_stage(tmp_path, LayerRange(2, 4))  # a range that does not need it still loads
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_stage(tmp_path, LayerRange(0, 2))


def test_unsupported_architecture_is_refused_naming_the_field(tmp_path):
    make_tiny_checkpoint("llama3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="model_type = 'gpt2' is not supported"):
        ModelConfig.from_dict({**raw, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="hidden_act = 'gelu'"):
        ModelConfig.from_dict({**raw, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="rope_type = 'yarn'"):
        ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"):
        ModelConfig.from_dict({**raw, "num_key_value_heads": 3})
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "mamba"}))
    with pytest.raises(ConfigError, match="model_type = 'mamba'"):
        load_stage(tmp_path, LayerRange(0, 1))


@pytest.mark.parametrize("text", ["0:0", "3:2", "-1:2", "0:5", "4:5", "2", "a:b"])
def test_bad_layer_ranges_are_refused(text):
    with pytest.raises(ConfigError, match=r"layer range"):
        LayerRange.parse(text, num_layers=4)


def test_layer_range_parses_half_open():
    rng = LayerRange.parse("0:4", num_layers=4)
    assert (rng.start, rng.end, len(rng), str(rng)) == (0, 4, 4, "[0, 4)")
    assert rng.is_first and rng.is_last(4)


@pytest.mark.parametrize("vocab,blocks", [(48, 8), (20, 4), (6, 2), (7, 1)])
def test_lm_head_blocks_give_the_plain_product_in_vocabulary_order(vocab, blocks):
    from layerline.stage_worker.layouts import LMHead

    weight = torch.randn(vocab, 5)  # the checkpoint's [vocab, hidden]
    head = LMHead(5, vocab)
    head.weight_blocks = torch.nn.Parameter(LMHead.blocked(weight))
    assert head.weight_blocks.shape == (blocks, 5, vocab // blocks)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 5)
        torch.testing.assert_close(head(x), x @ weight.t())


@pytest.mark.parametrize("layout", ["both", "packed", "plain"])
def test_every_weight_layout_matches_transformers(tiny, layout):
    """Prefill (many rows: the packed weights, oneDNN's or fma_blocks') and decode (one row: the
    plain ones under `both`, unless fma_blocks' kernel serves) give transformers' logits and greedy
    tokens whatever the layout."""
    from layerline.stage_worker.fma_blocks import block_kernel
    from layerline.stage_worker.layouts import PackedLinear

    _, path, hf = tiny
    stage = load_stage(path, LayerRange(0, 4), weight_layout=layout)
    packed = [m for m in stage.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == (0 if layout == "plain" else 4 * 4 + 1)  # qkv, o, gate_up, down per layer; head
    assert all((m.plain is not None) == (layout == "both" and block_kernel(torch.float32) is None) for m in packed)
    ids = PROMPTS["a"]
    torch.testing.assert_close(
        LocalPipeline([stage]).step({"s": ids}, all_logits=True), hf_logits(hf, ids), atol=1e-4, rtol=0
    )
    assert LocalPipeline([stage]).greedy({"b": PROMPTS["b"]}, 8)["b"] == hf_greedy(hf, PROMPTS["b"], 8)


def test_unknown_weight_layout_is_refused(tmp_path):
    make_tiny_checkpoint("llama3", tmp_path)
    with pytest.raises(ValueError, match="weight layout 'dense' is not one of both, packed, plain"):
        load_stage(tmp_path, LayerRange(0, 4), weight_layout="dense")


@pytest.mark.parametrize("row_products", ["kernel", "blocks", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_decoding_row_on_plain_tensors_equals_the_modules_and_transformers(
    tiny, threads, row_products, monkeypatch, request
):
    """A step of one token of one sequence whose KV is one run of slots skips the modules
    (`StageModel._one_row`, with the weights in output blocks on 2 threads): the same logits as
    the modules give for the same step, on a first, a last and a whole stage, and transformers';
    with the row products of the compiled kernel (row_kernel.py, where it compiles, fma_blocks'
    kernel kept off so that the plain modules stay), of fma_blocks' (where it builds) and of torch."""
    from dataclasses import replace

    from layerline.stage_worker import fma_blocks, row_kernel

    from .pipeline import cache_for

    monkeypatch.setenv(row_kernel.ENV, "torch" if row_products == "torch" else "kernel")
    fma_blocks.block_kernel.cache_clear()
    request.addfinalizer(fma_blocks.block_kernel.cache_clear)
    if row_products == "kernel":
        monkeypatch.setattr(fma_blocks, "block_kernel", lambda dtype: None)
    row_kernel.row_kernel.cache_clear()
    request.addfinalizer(row_kernel.row_kernel.cache_clear)

    _, path, hf = tiny
    whole = [load_stage(path, LayerRange(0, 4))]
    chains = [whole, [load_stage(path, LayerRange(0, 2)), load_stage(path, LayerRange(2, 4))]]
    ids = list(PROMPTS["a"])
    for stages in chains:
        for stage in stages:
            stage.set_threads(threads)
        fast, plain = [cache_for(s) for s in stages], [cache_for(s) for s in stages]
        tokens, seen = list(ids), []
        new = tokens
        for _ in range(6):
            outs = []
            for caches, one_row in ((fast, True), (plain, False)):
                x = torch.tensor(new)
                for stage, cache in zip(stages, caches):
                    cache.reserve("s", len(new))
                    layout = cache.plan_step(["s"], [len(new)], sliding_window=stage.config.sliding_window)
                    if len(new) == 1 and stage.config.sliding_window is None:
                        assert layout.decode_slots is not None
                    if not one_row:
                        layout = replace(layout, decode_slots=None)
                    with torch.no_grad():
                        x = stage(x, cache=cache, layout=layout, logit_rows=layout.last_rows())
                outs.append(x)
            torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
            torch.testing.assert_close(outs[0][-1], hf_logits(hf, tokens)[-1], atol=1e-4, rtol=0)
            new = [int(outs[0][-1].argmax())]
            tokens.append(new[0])
            seen.append(new[0])
        if stages[0].config.sliding_window is None:  # a window past its length takes the general path
            assert stages[0].row_path is not None
            plan = stages[0].row_path.plan(threads)
            assert plan is not None
            bound = getattr(plan.layers[0].gate_up.product, "__self__", None)
            blocks = row_products == "blocks" and fma_blocks.block_kernel(torch.float32) is not None
            assert isinstance(bound, row_kernel._Bound) == (not blocks and row_kernel.row_kernel() is not None)
            layer = next(iter(stages[0].layers.values()))
            for name, linear in (("qkv", layer.self_attn.qkv_proj), ("down", layer.mlp.down_proj)):
                kept = getattr(linear, "weight_packed", None)  # packed only where the blocks serve
                product = getattr(plan.layers[0], name).product
                assert isinstance(product, fma_blocks.BoundBlocks) == (blocks and fma_blocks.is_blocked(kept))
        assert seen == hf_greedy(hf, ids, 6)


@pytest.mark.parametrize(("dtype", "layout"), [(torch.float32, "packed"), (torch.bfloat16, "both")])
def test_one_decoding_row_runs_off_the_modules_on_packed_weights_too(tmp_path, dtype, layout):
    """A stage whose linear layers keep oneDNN's packed weight (float32 under `packed`, and
    bfloat16 on a CPU with bfloat16 instructions) still takes a lone token off the modules: through
    the packed products (`rows.RowMultiply`: oneDNN's, or fma_blocks' where it serves), or in
    bfloat16 under `both` where no blocks serve through the compiled kernel on the [out, in]
    weights kept beside them where it serves (row_kernel.py): the logits
    the modules give for the same step, and the same greedy tokens, on 2 threads."""
    from dataclasses import replace

    from layerline.stage_worker import row_kernel
    from layerline.stage_worker.layouts import PackedLinear
    from layerline.stage_worker.tiles import blocks_pack

    from .pipeline import cache_for

    make_tiny_checkpoint("smollm2", tmp_path)
    stage = load_stage(tmp_path, LayerRange(0, 4), dtype=dtype, weight_layout=layout)
    stage.set_threads(2)
    packed = [m for m in stage.modules() if isinstance(m, PackedLinear)]
    assert stage.row_path is not None and stage.row_path.plan(2) is not None
    # float32 packs on every CPU oneDNN serves; bfloat16 only on one with bfloat16 instructions
    # (elsewhere its layers keep the plain layouts, whose row path the test above covers).
    assert all(m.plain is None for m in packed) and (packed or dtype == torch.bfloat16)
    rows = dtype == torch.bfloat16 and bool(packed) and not blocks_pack(dtype)
    rows = rows and row_kernel.bf16_row_kernel() is not None
    assert all((m.weight_rows is not None) == rows for m in packed)
    bound = getattr(stage.row_path.plan(2).layers[0].gate_up.product, "__self__", None)
    assert isinstance(bound, row_kernel._Bound) == rows
    caches = {one_row: cache_for(stage) for one_row in (True, False)}
    new, seen = list(PROMPTS["a"]), {True: [], False: []}
    for _ in range(6):
        logits = {}
        for one_row, cache in caches.items():
            cache.reserve("s", len(new))
            layout_ = cache.plan_step(["s"], [len(new)], sliding_window=None)
            with torch.no_grad():
                logits[one_row] = stage(
                    torch.tensor(new),
                    cache=cache,
                    layout=layout_ if one_row else replace(layout_, decode_slots=None),
                    logit_rows=layout_.last_rows(),
                )
            seen[one_row].append(int(logits[one_row][-1].argmax()))
        # bfloat16 (steps of 0.004 near 1): one row's norms round their scale once, in double
        tolerance = 1e-5 if dtype == torch.float32 else 0.03
        torch.testing.assert_close(logits[True], logits[False], atol=tolerance, rtol=0)
        new = [seen[False][-1]]
    assert seen[True] == seen[False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_rows_rotary_gives_the_modules_numbers(tmp_path, dtype):
    """The row path's rotary (`rows.rotary`) against the modules' `x * cos + swap_halves(x) * sin`
    at positions 0, 7 and 4000: in half precision the same kernels in the same order, so the same
    bits (the [d, d] product it replaced rounded each output once instead of three times); in
    float32 one product, equal to rounding."""
    from layerline.stage_worker.llama import StageModel, swap_halves
    from layerline.stage_worker.rows import rotary

    make_tiny_checkpoint("smollm2", tmp_path)
    config = ModelConfig.from_checkpoint(tmp_path)
    stage = StageModel(config, LayerRange(0, 1))
    qk = torch.randn(6, config.head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    for position in (0, 7, 4000):
        cos, sin = stage.rope(torch.tensor([position]), dtype)
        want = qk * cos[0] + swap_halves(qk) * sin[0]
        got = rotary(cos[0], sin[0])(qk)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        else:
            assert torch.equal(got, want), (position, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_give_the_bits_of_the_steps_positions_alone(tmp_path, dtype):
    """`StageModel.rope` reads rows of a table of positions made once (1024 rows or the model's
    context, grown to what a step asks past it, made again for new frequencies): the same bits as
    computing the step's positions alone."""
    from layerline.stage_worker.llama import StageModel

    make_tiny_checkpoint("llama3", tmp_path)  # scaled frequencies: the most arithmetic
    config = ModelConfig.from_checkpoint(tmp_path)
    stage = StageModel(config, LayerRange(0, 1))
    for positions in ([0], [7], [1023], [3, 4, 5, 6], [1024], [5000, 5001], [], [2]):
        at = torch.tensor(positions, dtype=torch.long)
        got, want = stage.rope(at, dtype), stage._rope_rows(at, dtype)
        assert all(torch.equal(g, w) and g.shape == (len(positions), 1, config.head_dim) for g, w in zip(got, want))
    assert config.max_position_embeddings == 256
    assert stage._rope_tables[dtype][1].shape[0] == 5002  # past the context: what was asked
    stage.inv_freq = stage.inv_freq * 2  # new frequencies (as weights.py sets them): a new table
    assert torch.equal(stage.rope(torch.tensor([9]), dtype)[0], stage._rope_rows(torch.tensor([9]), dtype)[0])
    assert stage._rope_tables[dtype][1].shape[0] == 256  # the model's context, not 1024


def test_loading_a_stage_does_not_import_torch_dynamo(tmp_path):
    """A stage is built on the meta device, where arithmetic runs torch's Python reference
    kernels; their first use imports torch._dynamo, over a second of every worker's start. The
    rotary frequencies (Llama 3 scaling: the most arithmetic) are computed on the CPU instead."""
    import subprocess
    import sys

    make_tiny_checkpoint("llama3", tmp_path)
    script = (
        "import sys\n"
        "from layerline.shared.model_config import LayerRange\n"
        "from layerline.stage_worker.weights import load_stage\n"
        f"load_stage({str(tmp_path)!r}, LayerRange(0, 2))\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
