"""A token's numbers do not depend on how its sequence was split into steps: on the CPU, where the
compiled kernel reads the pools, every token attends as a decode row (kv_cache.plan_step's
`token_rows`), and the kernel computes a sequence's consecutive rows together, each to the bit as
alone (kernels/paged_attention.c, `attend_rows`). Before, a prompt attended through torch's kernel,
whose sums over a row's weights are blocked by how many rows came with it: in bfloat16 a prompt
after a copied prefix (the chat template's system prompt) answered greedily otherwise than whole."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import kernel_args
from layerline.stage_worker.paged_attention import compiled_kernel
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(180)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@pytest.fixture(scope="module")
def kernel():
    found = compiled_kernel()
    if found is None:
        pytest.skip("no compiled attention kernel on this machine: prompts attend through torch's")
    return found


@DTYPES
@pytest.mark.parametrize(("d", "block", "first", "count"), [(64, 16, 1, 70), (64, 16, 40, 19), (16, 4, 3, 29)])
def test_a_sequences_rows_together_are_each_rows_bits_alone(kernel, dtype, d, block, first, count):
    """Consecutive rows of one sequence in one call (runs of up to 8, blocks crossed, contexts not
    multiples of 16), between lone rows of other sequences, equal each row's own call to the bit."""
    kvh, h, slots = 3, 9, 64 * block
    gen = torch.Generator().manual_seed(d + first)
    k_pool, v_pool = (torch.randn(slots, kvh, d, generator=gen).to(dtype) for _ in range(2))
    blocks = torch.randperm(64, generator=gen).tolist()  # each sequence's blocks anywhere in the pools
    need = -(-(first + count - 1) // block)
    tables = {"other": blocks[:2], "s": blocks[2 : 2 + need], "last": blocks[2 + need : 3 + need]}
    rows = [("other", 2 * block - 1)] + [("s", first + i) for i in range(count)] + [("last", block // 2)]
    width = max(len(t) for t in tables.values())
    padded = torch.tensor([tables[n] + [0] * (width - len(tables[n])) for n, _ in rows])
    lens = torch.tensor([length for _, length in rows])
    q = torch.randn(len(rows), h, d, generator=gen).to(dtype)
    together = kernel(q, k_pool, v_pool, kernel_args.decode_batch(padded, lens, block=block, slots=slots))
    for i in range(len(rows)):
        alone = kernel_args.decode_batch(padded[i : i + 1], lens[i : i + 1], block=block, slots=slots)
        assert torch.equal(together[i : i + 1], kernel(q[i : i + 1], k_pool, v_pool, alone)), rows[i]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("token_rows")
    make_tiny_checkpoint("smollm2", path, hidden_size=96)  # 6 heads of 16, 2 kv heads
    return path


PROMPT = [3 + (i * 37) % 200 for i in range(70)]


def split_ways(stages, *, token_rows: bool) -> dict[str, torch.Tensor]:
    """The logits of PROMPT's last token, the prompt fed whole, in two chunks, after its first 38
    tokens' KV copied from another sequence, and one token a step, beside another sequence and alone
    (a lone row's own path, rows.py, where it serves)."""
    out = {}
    whole = LocalPipeline(stages, token_rows=token_rows)
    out["whole"] = whole.step({"s": PROMPT})
    chunks = LocalPipeline(stages, token_rows=token_rows)
    chunks.step({"s": PROMPT[:38]})
    out["in two chunks"] = chunks.step({"s": PROMPT[38:]})
    copied = LocalPipeline(stages, token_rows=token_rows)
    copied.step({"lender": [*PROMPT[:38], 7, 7]})
    for cache in copied.caches:
        cache.copy_prefix("lender", "s", 38, room_for=len(PROMPT) - 38)
    out["after a copied prefix"] = copied.step({"s": PROMPT[38:]})
    beside, alone = LocalPipeline(stages, token_rows=token_rows), LocalPipeline(stages, token_rows=token_rows)
    beside.step({"other": PROMPT[:5]})
    for i, t in enumerate(PROMPT):
        out["a token a step, beside another sequence"] = beside.step({"s": [t], "other": [PROMPT[i % 5]]})[:1]
        out["a token a step, alone"] = alone.step({"s": [t]})
    return out


@DTYPES
def test_a_prompts_last_logits_are_the_same_bits_however_it_was_split(kernel, ckpt, dtype):
    stages = [load_stage(ckpt, LayerRange(0, 2), dtype=dtype), load_stage(ckpt, LayerRange(2, 4), dtype=dtype)]
    if not _rows_are_alike(stages[0], dtype):
        pytest.skip("a product's rows are not the same bits in batches of different sizes here")
    ways = split_ways(stages, token_rows=True)
    paths = [stage.row_path for stage in stages]
    try:  # a lone row through the modules, as on a tensor-parallel rank (no row path there)
        for stage in stages:
            stage.row_path = None
        modules = LocalPipeline(stages, token_rows=True)
        for t in PROMPT:
            ways["a token a step, alone, through the modules"] = modules.step({"s": [t]})
    finally:
        for stage, path in zip(stages, paths, strict=True):
            stage.row_path = path
    for name, logits in ways.items():
        assert torch.equal(logits, ways["whole"]), name


def _rows_are_alike(stage, dtype) -> bool:
    """Whether this machine's products give a row the same bits in a batch of 70, 32, 2 and 1 (each
    product of a layer, and the head where the stage holds it)."""
    layer = next(iter(stage.layers.values()))
    hidden, attn = stage.config.hidden_size, layer.self_attn
    products = [
        (attn.qkv_proj, hidden),
        (attn.o_proj, attn.heads_per_rank * attn.head_dim),
        (layer.mlp.gate_up_proj, hidden),
        (layer.mlp.down_proj, stage.shards.intermediate),
    ]
    if stage.lm_head is not None:
        products.append((stage.lm_head, hidden))
    with torch.no_grad():
        for product, fan_in in products:
            x = torch.randn(70, fan_in, generator=torch.Generator().manual_seed(1)).to(dtype)
            whole = product(x)
            for first in (38, 68, 69):
                if not torch.equal(whole[first:], product(x[first:].contiguous())):
                    return False
    return True


@pytest.mark.real_model
@pytest.mark.timeout(300)
def test_smollm2_in_bfloat16_answers_alike_after_a_copied_system_prompt(real_model_dir, hf_real):
    """The embedded model in bfloat16: a chat prompt after its system prompt's KV copied from
    another sequence gives its last token the logits of the prompt computed whole, to the bit (it
    gave other greedy tokens than whole before)."""
    tok, _ = hf_real

    def chat(text: str) -> list[int]:
        turn = [{"role": "user", "content": text}]
        return list(tok.apply_chat_template(turn, add_generation_prompt=True, return_dict=False))

    ids, other = chat("Rewrite in the passive voice: the cat chased the dog."), chat("Hello")
    system = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)  # what prefix sharing copies
    assert system >= 20  # the template's system prompt, and the user turn's start
    stage = load_stage(real_model_dir, LayerRange(0, 30), dtype=torch.bfloat16)
    if not _rows_are_alike(stage, torch.bfloat16):
        pytest.skip("a product's rows are not the same bits in batches of different sizes here")
    whole = LocalPipeline([stage], num_blocks=32, token_rows=True)
    copied = LocalPipeline([stage], num_blocks=32, token_rows=True)
    copied.step({"lender": other})
    copied.caches[0].copy_prefix("lender", "s", system, room_for=len(ids) - system)
    assert torch.equal(copied.step({"s": ids[system:]}), whole.step({"s": ids}))
