"""GGUF import: a tiny random Llama written as GGUF the way llama.cpp's converter does it must
come back as a Hugging Face checkpoint with identical tensors, identical logits and an
equivalent tokenizer; malformed or unsupported files must fail with a message naming the cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from layerline.cli import main
from layerline.model_store.gguf_import import GGUFImportError, import_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<tool>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog 1234567890.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time, there was a little model that could serve tokens.",
    "def add(a, b):\n    return a + b  # numbers: 42, 3.14, 2025, 1234 1234 1234",
]
SAMPLE = "<|im_start|>user\nWhat is 12 + 345? The fox <tool> jumps!<|im_end|>\n"


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]  # id -> token string
    merges: list[str]  # "a b" merge rules, highest priority first
    token_types: list[int]  # GGUF token types: 1 normal, 3 control, 4 user defined
    reference: Tokenizer  # the tokenizer the vocabulary came from


def train_vocab() -> TinyVocab:
    """A ~300-token byte-level BPE trained on a few sentences, plus a user-defined token.

    It is trained without splitting digits, so that it has multi-digit tokens, and then used
    with llama.cpp's 'smollm' pre-tokenizer, which splits digits one by one: an importer that
    forgets the digit split encodes numbers differently.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.add_tokens([USER_DEFINED])
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    tokens.append(USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    assert tok.token_to_id(USER_DEFINED) == len(tokens) - 1
    assert any(len(t) > 1 and t.isdigit() for t in tokens), "the corpus must yield multi-digit tokens"
    return TinyVocab(tokens=tokens, merges=merges, token_types=types, reference=tok)


def make_model(vocab_size: int, *, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # initialized to ones: make a mix-up detectable
                param.uniform_(0.5, 1.5)
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp names, q/k permuted as llama.cpp's converter does."""
    cfg = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, g in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if g == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif g == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{g}.weight"] = w
    return out


def write_gguf(
    path: Path,
    model: LlamaForCausalLM,
    vocab: TinyVocab,
    *,
    arch: str = "llama",
    quantize: Iterable[str] = (),
    skip_keys: Iterable[str] = (),
    tokenizer_model: str = "gpt2",
    add_bos: bool = False,
) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would; returns the (permuted) tensors as written, before quantizing."""
    cfg, skip = model.config, set(skip_keys)
    w = gguf.GGUFWriter(str(path), arch)
    meta: dict[str, Callable[[], None]] = {
        "block_count": lambda: w.add_block_count(cfg.num_hidden_layers),
        "context_length": lambda: w.add_context_length(cfg.max_position_embeddings),
        "embedding_length": lambda: w.add_embedding_length(cfg.hidden_size),
        "feed_forward_length": lambda: w.add_feed_forward_length(cfg.intermediate_size),
        "attention.head_count": lambda: w.add_head_count(cfg.num_attention_heads),
        "attention.head_count_kv": lambda: w.add_head_count_kv(cfg.num_key_value_heads),
        "attention.layer_norm_rms_epsilon": lambda: w.add_layer_norm_rms_eps(cfg.rms_norm_eps),
        "rope.freq_base": lambda: w.add_rope_freq_base(cfg.rope_parameters["rope_theta"]),
        "rope.dimension_count": lambda: w.add_rope_dimension_count(cfg.head_dim),
        "vocab_size": lambda: w.add_vocab_size(cfg.vocab_size),
    }
    for key, add in meta.items():
        if key not in skip:
            add()
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    tensors = gguf_tensors(model)
    for name, value in tensors.items():
        if name in quantize:
            w.add_tensor(
                name,
                gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def vocab() -> TinyVocab:
    return train_vocab()


@pytest.fixture(scope="module")
def untied(vocab: TinyVocab, tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    model = make_model(len(vocab.tokens), tied=False)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model, vocab)
    return model, path


def logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tensors_and_logits_round_trip(vocab: TinyVocab, tmp_path: Path, tied: bool) -> None:
    model = make_model(len(vocab.tokens), tied=tied)
    write_gguf(tmp_path / "tiny.gguf", model, vocab)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "ckpt", progress=False)

    weights = load_file(str(out / "model.safetensors"))
    expected = {k: v.numpy() for k, v in model.state_dict().items()}
    if tied:
        del expected["lm_head.weight"]
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], value, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (50000.0, 1e-5)
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, len(vocab.tokens))

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.rope_parameters["rope_theta"] == 50000.0
    ids = [5, 17, 200, 3, len(vocab.tokens) - 1, 42, 99, 150]
    np.testing.assert_allclose(logits(loaded, ids), logits(model, ids), atol=1e-5, rtol=0)


def test_q8_0_tensors_are_dequantized_and_unpermuted(vocab: TinyVocab, tmp_path: Path) -> None:
    model = make_model(len(vocab.tokens), tied=False)
    quantized = {"blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_up.weight"}
    write_gguf(tmp_path / "q8.gguf", model, vocab, quantize=quantized)
    out = import_gguf(tmp_path / "q8.gguf", tmp_path / "ckpt", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ):
        original = model.state_dict()[name].numpy()
        # Q8_0 keeps 8 bits per value plus a scale per 32: error <= half a step of the block max.
        np.testing.assert_allclose(weights[name], original, atol=np.abs(original).max() / 127, rtol=0)
        assert not np.array_equal(weights[name], original), f"{name} should have been quantized"
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.v_proj.weight"],
        model.state_dict()["model.layers.0.self_attn.v_proj.weight"].numpy(),
    )


def test_tokenizer_matches_the_source_vocabulary(
    vocab: TinyVocab, untied: tuple[LlamaForCausalLM, Path], tmp_path: Path
) -> None:
    out = import_gguf(untied[1], tmp_path / "ckpt", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in [*CORPUS, SAMPLE, "  spaces\tand\nnewlines 007 ünïcödé 🙂"]:
        assert ours.encode(text).ids == vocab.reference.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    sample = ours.encode(SAMPLE).ids
    assert sample[0] == 1 and vocab.tokens.index(USER_DEFINED) in sample
    assert USER_DEFINED in ours.decode(sample, skip_special_tokens=True)
    assert "<|im_start|>" not in ours.decode(sample, skip_special_tokens=True)

    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["add_bos_token"] is False
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    hf = AutoTokenizer.from_pretrained(out)
    assert hf(SAMPLE)["input_ids"] == sample
    chat = hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_token(vocab: TinyVocab, tmp_path: Path) -> None:
    write_gguf(tmp_path / "bos.gguf", make_model(len(vocab.tokens), tied=False), vocab, add_bos=True)
    out = import_gguf(tmp_path / "bos.gguf", tmp_path / "ckpt", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    plain = vocab.reference.encode("The fox 12").ids
    assert ours.encode("The fox 12").ids == [1, *plain]
    assert ours.encode("The fox 12", add_special_tokens=False).ids == plain
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    assert AutoTokenizer.from_pretrained(out)("The fox 12")["input_ids"] == [1, *plain]


def test_existing_output_is_kept_unless_forced(untied: tuple[LlamaForCausalLM, Path], tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(untied[1], out, progress=False)
    assert (out / "keep.txt").exists()
    import_gguf(untied[1], out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left behind


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (os.urandom(4096), "not a GGUF file"),
        (b"GGUF", "truncated or corrupt"),
    ],
)
def test_not_a_gguf_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [100, 2000, 0.5, 0.999], ids=["header", "metadata", "half", "last-bytes"])
def test_truncated_gguf(untied: tuple[LlamaForCausalLM, Path], tmp_path: Path, keep: float) -> None:
    data = untied[1].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(keep if keep >= 1 else len(data) * keep)])
    with pytest.raises(GGUFImportError, match="truncated"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out", progress=False)


def test_unsupported_architecture(vocab: TinyVocab, tmp_path: Path) -> None:
    write_gguf(tmp_path / "gpt2.gguf", make_model(len(vocab.tokens), tied=False), vocab, arch="gpt2")
    with pytest.raises(GGUFImportError, match=r"general\.architecture 'gpt2'"):
        import_gguf(tmp_path / "gpt2.gguf", tmp_path / "out", progress=False)


def test_missing_metadata_key(vocab: TinyVocab, tmp_path: Path) -> None:
    model = make_model(len(vocab.tokens), tied=False)
    write_gguf(tmp_path / "nokey.gguf", model, vocab, skip_keys={"attention.head_count"})
    with pytest.raises(GGUFImportError, match=r"missing the required key 'llama\.attention\.head_count'"):
        import_gguf(tmp_path / "nokey.gguf", tmp_path / "out", progress=False)


def test_sentencepiece_tokenizer_is_refused(vocab: TinyVocab, tmp_path: Path) -> None:
    model = make_model(len(vocab.tokens), tied=False)
    write_gguf(tmp_path / "spm.gguf", model, vocab, tokenizer_model="llama")
    with pytest.raises(GGUFImportError, match=r"unsupported tokenizer\.ggml\.model 'llama'"):
        import_gguf(tmp_path / "spm.gguf", tmp_path / "out", progress=False)


@pytest.mark.cluster
def test_cli_reports_errors_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(1000))
    result = subprocess.run(
        [sys.executable, "-m", "layerline", "model", "import-gguf", str(bad), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "not a GGUF file" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_imports(untied: tuple[LlamaForCausalLM, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert main(["model", "import-gguf", str(untied[1]), str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert main(["model", "import-gguf", str(untied[1]), str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
