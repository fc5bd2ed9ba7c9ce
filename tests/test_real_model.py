"""End-to-end truth on the real pretrained SmolLM2-135M-Instruct that `model fetch` makes."""

from __future__ import annotations

import pytest
import torch

from layerline.stage_worker.model_config import LayerRange
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def hf(real_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return tok, model


@pytest.fixture(scope="module")
def ours(real_model_dir):
    # Two stages, as a cluster would split it.
    return [load_stage(real_model_dir, LayerRange(0, 15)), load_stage(real_model_dir, LayerRange(15, 30))]


def test_greedy_32_tokens_equal_transformers(hf, ours):
    tok, model = hf
    prompts = {str(i): tok(p)["input_ids"] for i, p in enumerate(PROMPTS)}
    got = LocalPipeline(ours).greedy(prompts, 32)  # all three decode in one batch
    for key, ids in prompts.items():
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
        assert got[key] == ref[0, len(ids):].tolist(), PROMPTS[int(key)]


def test_chat_answers_the_capital_of_france(hf, ours):
    tok, _ = hf
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text)["input_ids"]
    out = LocalPipeline(ours).greedy({"q": ids}, 24)["q"]
    answer = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in answer, answer
