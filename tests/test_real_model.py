"""End-to-end truth on the real pretrained SmolLM2-135M-Instruct that `model fetch` makes."""

from __future__ import annotations

import pytest

from layerline.shared.model_config import LayerRange
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def ours(real_model_dir):
    # Two stages, as a cluster would split it.
    return [load_stage(real_model_dir, LayerRange(0, 15)), load_stage(real_model_dir, LayerRange(15, 30))]


def test_greedy_32_tokens_equal_transformers(hf_real, hf_greedy, ours):
    tok, _ = hf_real
    prompts = {str(i): tok(p)["input_ids"] for i, p in enumerate(PROMPTS)}
    got = LocalPipeline(ours).greedy(prompts, 32)  # all three decode in one batch
    for key, ids in prompts.items():
        assert got[key] == hf_greedy(ids, 32), PROMPTS[int(key)]


def test_chat_answers_the_capital_of_france(hf_real, ours):
    tok, _ = hf_real
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text)["input_ids"]
    out = LocalPipeline(ours).greedy({"q": ids}, 24)["q"]
    answer = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in answer, answer
