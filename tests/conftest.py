"""Shared fixtures: the real embedded checkpoint, fetched once per machine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The test command installs without bytecode (`pip install --no-compile`, README: Tests), leaving it
# to the first import, which writes what it imports; where the environment sets
# PYTHONDONTWRITEBYTECODE (some machines set it for every process) nothing is ever written, and each
# process the suite starts that imports torch (stage workers, tensor-parallel ranks, relays) compiled
# its modules from source again: `import torch` 4.3 s against 1.7 s from bytecode, measured on
# 2 cores of an Intel Xeon (family 6 model 106). So this process and those it starts write it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The HF-format checkpoint `layerline model fetch` makes from the embedded SmolLM2 GGUF,
    fetched in this process (the command itself is tested in test_model_store.py)."""
    from layerline.model_store import fetch_model

    path = fetch_model()
    assert (path / "config.json").is_file()
    return path


@pytest.fixture(scope="session")
def hf_real(real_model_dir: Path):
    """transformers' tokenizer and model on the fetched checkpoint: the oracle, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly n tokens
    return tok, model


@pytest.fixture(scope="session")
def hf_greedy(hf_real):
    """greedy(prompt text or ids, n) -> the n token ids transformers' `generate` picks.

    Remembered for the session: greedy decoding computes each token from the ones before it
    alone, so a prompt's first n tokens are those of any longer run of it (a run that stopped at
    the end token, shorter than asked, is generated again when as many or more are asked)."""
    import torch

    tok, model = hf_real
    seen: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the longest answer generated

    def greedy(prompt: str | list[int], n: int) -> list[int]:
        ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        key = tuple(ids)
        if len(seen.get(key, ())) < n:
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
            seen[key] = out[0, len(ids) :].tolist()
        return seen[key][:n]

    return greedy
