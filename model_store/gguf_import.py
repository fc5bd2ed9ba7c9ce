"""Conversion of a Llama-family GGUF file into a Hugging Face checkpoint directory.

This module owns everything about reading GGUF: validating the file, reading the hyperparameters
and the tokenizer's vocabulary from its metadata, mapping llama.cpp tensor names to Hugging Face
names, dequantizing to float32, undoing llama.cpp's row permutation of the q/k projections, and
writing `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and
`generation_config.json` atomically. Turning the checked vocabulary into a `tokenizers` tokenizer
and its config is `gguf_tokenizer`'s job. It knows nothing about the model cache or fetching
(`store`) and never imports torch or transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from .gguf_tokenizer import GPT2_STYLE_PRE_TOKENIZERS, GGUFVocabulary, build_tokenizer

GGUF_MAGIC: Final = b"GGUF"
SUPPORTED_ARCHITECTURES: Final = ("llama",)
_ARCHITECTURE_HINTS: Final = {
    "qwen2": "Qwen2 needs q/k/v projection biases and its own pre-tokenizer, which layerline's "
    "Llama model does not implement",
}


class GGUFImportError(ValueError):
    """The GGUF file cannot be converted; the message names the file, key or tensor at fault."""


@dataclass(frozen=True)
class LlamaHParams:
    """The hyperparameters of a Llama model, as Hugging Face's LlamaConfig names them."""

    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the MLP's hidden layer
    num_hidden_layers: int  # number of decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (grouped-query attention when fewer)
    head_dim: int  # width of one attention head
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base frequency
    max_position_embeddings: int  # trained context length
    vocab_size: int  # rows of the embedding matrix
    tie_word_embeddings: bool  # the LM head reuses the embedding (no `output.weight`)
    rope_linear_factor: float | None  # linear RoPE scaling factor, None when unscaled


def open_gguf(path: Path) -> GGUFReader:
    """Open and parse a GGUF file, turning every way it can be malformed into GGUFImportError."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    size = path.stat().st_size
    if size == 0:
        raise GGUFImportError(f"{path}: the file is empty, not a GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (starts with {magic!r}, expected the magic {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise GGUFImportError(f"{path}: GGUF file is truncated or corrupt ({exc})") from exc
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GGUFImportError(
                f"{path}: GGUF file is truncated: tensor {tensor.name!r} ends at byte {end} "
                f"but the file has {size} bytes"
            )
    return reader


def _field(reader: GGUFReader, key: str, kind: type, default: Any = ...) -> Any:
    """The value of metadata `key`, checked to be of `kind`; missing and no default: an error."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFImportError(f"GGUF metadata is missing the required key {key!r}")
        return default
    try:
        value = field.contents()
    except (UnicodeDecodeError, IndexError, ValueError) as exc:
        raise GGUFImportError(f"GGUF metadata key {key!r} is corrupt ({exc})") from exc
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise GGUFImportError(f"GGUF metadata key {key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _float32_value(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (GGUF stores 1e-5 as float32)."""
    return float(str(np.float32(value)))


def read_architecture(reader: GGUFReader) -> str:
    """`general.architecture`, refused unless layerline can serve it."""
    arch = _field(reader, "general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = _ARCHITECTURE_HINTS.get(arch, "it is not a Llama-family model")
        raise GGUFImportError(
            f"unsupported general.architecture {arch!r}: layerline imports only "
            f"{', '.join(repr(a) for a in SUPPORTED_ARCHITECTURES)} ({hint})"
        )
    return arch


def read_hparams(reader: GGUFReader, arch: str) -> LlamaHParams:
    """The model's hyperparameters from `{arch}.*` metadata and the tensor shapes."""
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFImportError("GGUF file has no tensor 'token_embd.weight' (the token embedding)")
    hidden = _field(reader, f"{arch}.embedding_length", int)
    n_head = _field(reader, f"{arch}.attention.head_count", int)
    n_head_kv = _field(reader, f"{arch}.attention.head_count_kv", int, n_head)
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv != 0:
        raise GGUFImportError(
            f"{arch}.attention.head_count ({n_head}) must be a positive multiple of "
            f"{arch}.attention.head_count_kv ({n_head_kv})"
        )
    head_dim = _field(reader, f"{arch}.attention.key_length", int, hidden // n_head)
    value_dim = _field(reader, f"{arch}.attention.value_length", int, head_dim)
    rope_dim = _field(reader, f"{arch}.rope.dimension_count", int, head_dim)
    if value_dim != head_dim or rope_dim != head_dim or head_dim % 2 != 0:
        raise GGUFImportError(
            f"unsupported attention geometry: key_length {head_dim}, value_length {value_dim}, "
            f"rope.dimension_count {rope_dim} (layerline needs them equal and even)"
        )
    if _field(reader, f"{arch}.expert_count", int, 0) > 0:
        raise GGUFImportError(f"{arch}.expert_count > 0: mixture-of-experts models are unsupported")
    if "rope_freqs.weight" in tensors:
        raise GGUFImportError("tensor 'rope_freqs.weight' (Llama 3.1 RoPE scaling) is unsupported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", str, "none")
    linear_factor: float | None = None
    if scaling == "linear":
        linear_factor = _float32_value(_field(reader, f"{arch}.rope.scaling.factor", float))
    elif scaling != "none":
        raise GGUFImportError(f"{arch}.rope.scaling.type {scaling!r} is unsupported")
    # GGUF lists dimensions innermost first: token_embd is [hidden, vocab].
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    return LlamaHParams(
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length", int),
        num_hidden_layers=_field(reader, f"{arch}.block_count", int),
        num_attention_heads=n_head,
        num_key_value_heads=n_head_kv,
        head_dim=head_dim,
        rms_norm_eps=_float32_value(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", float)),
        rope_theta=_float32_value(_field(reader, f"{arch}.rope.freq_base", float, 10000.0)),
        max_position_embeddings=_field(reader, f"{arch}.context_length", int),
        vocab_size=vocab_size,
        tie_word_embeddings="output.weight" not in tensors,
        rope_linear_factor=linear_factor,
    )


def read_vocabulary(reader: GGUFReader) -> GGUFVocabulary:
    """The byte-level BPE vocabulary (GGUF `tokenizer.ggml.model` 'gpt2') from the metadata, checked."""
    kind = _field(reader, "tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise GGUFImportError(
            f"unsupported tokenizer.ggml.model {kind!r}: layerline imports only byte-level BPE "
            "tokenizers ('gpt2'); SentencePiece ('llama') tokenizers are not supported yet"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens", list)
    merge_lines: list[str] = _field(reader, "tokenizer.ggml.merges", list)
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", list, [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise GGUFImportError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    known = set(tokens)
    merges: list[tuple[str, str]] = []
    for line in merge_lines:
        parts = line.split(" ")
        if len(parts) != 2 or any(t not in known for t in (*parts, "".join(parts))):
            raise GGUFImportError(
                f"tokenizer.ggml.merges has a malformed merge {line!r} (not two tokens whose concatenation is a token)"
            )
        merges.append((parts[0], parts[1]))
    pre = _field(reader, "tokenizer.ggml.pre", str, "default")
    if pre not in GPT2_STYLE_PRE_TOKENIZERS:
        raise GGUFImportError(
            f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(GPT2_STYLE_PRE_TOKENIZERS))})"
        )
    special_ids: dict[str, int] = {}
    for role, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
        ("unk", "unknown_token_id"),
    ):
        token_id = _field(reader, f"tokenizer.ggml.{key}", int, None)
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise GGUFImportError(f"tokenizer.ggml.{key} is {token_id}, outside the {len(tokens)}-token vocabulary")
        special_ids[role] = token_id
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", bool, False)
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", bool, False)
    if (add_bos and "bos" not in special_ids) or (add_eos and "eos" not in special_ids):
        raise GGUFImportError("tokenizer.ggml.add_bos/eos_token is set but the token id is missing")
    return GGUFVocabulary(
        tokens=tuple(tokens),
        token_types=tuple(token_types),
        merges=tuple(merges),
        pre=pre,
        special_ids=special_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=_field(reader, "tokenizer.chat_template", str, None),
    )


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in the rows of a q/k projection.

    llama.cpp's converter applied `w.reshape(n_head, 2, rows // n_head // 2, cols)
    .swapaxes(1, 2).reshape(rows, cols)`; this is its inverse.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    # (rows, cols) -> (n_head, half, 2, cols) -> (n_head, 2, half, cols) -> (rows, cols)
    return np.ascontiguousarray(weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


def tensor_plan(hp: LlamaHParams, tensors: list[ReaderTensor]) -> list[tuple[ReaderTensor, str, int | None]]:
    """(GGUF tensor, HF name, heads to un-permute by) for every tensor, with shapes checked."""
    q_rows, kv_rows = hp.num_attention_heads * hp.head_dim, hp.num_key_value_heads * hp.head_dim
    h, f = hp.hidden_size, hp.intermediate_size
    n_q, n_kv = hp.num_attention_heads, hp.num_key_value_heads
    # GGUF name -> (HF name, HF shape (out, in), heads of the row permutation)
    expected: dict[str, tuple[str, tuple[int, ...], int | None]] = {
        "token_embd.weight": ("model.embed_tokens.weight", (hp.vocab_size, h), None),
        "output_norm.weight": ("model.norm.weight", (h,), None),
    }
    if not hp.tie_word_embeddings:
        expected["output.weight"] = ("lm_head.weight", (hp.vocab_size, h), None)
    for i in range(hp.num_hidden_layers):
        layer = f"model.layers.{i}"
        expected |= {
            f"blk.{i}.attn_norm.weight": (f"{layer}.input_layernorm.weight", (h,), None),
            f"blk.{i}.attn_q.weight": (f"{layer}.self_attn.q_proj.weight", (q_rows, h), n_q),
            f"blk.{i}.attn_k.weight": (f"{layer}.self_attn.k_proj.weight", (kv_rows, h), n_kv),
            f"blk.{i}.attn_v.weight": (f"{layer}.self_attn.v_proj.weight", (kv_rows, h), None),
            f"blk.{i}.attn_output.weight": (f"{layer}.self_attn.o_proj.weight", (h, q_rows), None),
            f"blk.{i}.ffn_norm.weight": (f"{layer}.post_attention_layernorm.weight", (h,), None),
            f"blk.{i}.ffn_gate.weight": (f"{layer}.mlp.gate_proj.weight", (f, h), None),
            f"blk.{i}.ffn_up.weight": (f"{layer}.mlp.up_proj.weight", (f, h), None),
            f"blk.{i}.ffn_down.weight": (f"{layer}.mlp.down_proj.weight", (h, f), None),
        }
    by_name = {t.name: t for t in tensors}
    unknown = sorted(set(by_name) - set(expected))
    if unknown:
        raise GGUFImportError(f"GGUF has tensors a Llama model does not use: {', '.join(unknown[:8])}")
    missing = [name for name in expected if name not in by_name]
    if missing:
        raise GGUFImportError(f"GGUF is missing tensors: {', '.join(missing[:8])}")
    plan: list[tuple[ReaderTensor, str, int | None]] = []
    for name, (hf_name, shape, heads) in expected.items():
        tensor = by_name[name]
        actual = tuple(int(d) for d in reversed(tensor.shape))  # GGUF order is innermost first
        if actual != shape:
            raise GGUFImportError(f"tensor {name!r} has shape {actual}, expected {shape}")
        plan.append((tensor, hf_name, heads))
    return plan


def load_tensor(tensor: ReaderTensor, heads: int | None) -> np.ndarray:
    """Dequantize one GGUF tensor to a float32 array in HF layout (out, in)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFImportError(
            f"tensor {tensor.name!r}: quantization {GGMLQuantizationType(tensor.tensor_type).name} "
            "cannot be dequantized by the gguf package"
        ) from exc
    values = np.array(values, dtype=np.float32).reshape(shape)  # copies out of the memory map
    return unpermute_qk(values, heads) if heads is not None else values


def hf_config(hp: LlamaHParams, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json for transformers' LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_hidden_layers,
        "num_attention_heads": hp.num_attention_heads,
        "num_key_value_heads": hp.num_key_value_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": (
            {"rope_type": "linear", "factor": hp.rope_linear_factor} if hp.rope_linear_factor is not None else None
        ),
        "max_position_embeddings": hp.max_position_embeddings,
        "vocab_size": hp.vocab_size,
        "tie_word_embeddings": hp.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"),
        "torch_dtype": "float32",
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _move_into_place(staging: Path, out: Path, *, overwrite: bool) -> None:
    """Rename the finished staging directory to `out`, replacing `out` only when allowed."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    elif out.exists():
        if not overwrite:
            raise GGUFImportError(f"{out} already exists (pass --force to replace it)")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
    for path in staging.iterdir():
        os.chmod(path, 0o644)  # mkdtemp and safetensors create owner-only files
    os.chmod(staging, 0o755)
    os.rename(staging, out)


def import_gguf(gguf_path: Path, out: Path, *, overwrite: bool = False, progress: bool = True) -> Path:
    """Convert `gguf_path` into an HF checkpoint directory at `out`; returns `out`.

    The directory appears complete or not at all: files are written into a staging directory
    next to `out`, which is renamed once everything is on disk.
    """
    gguf_path, out = Path(gguf_path), Path(out)
    reader = open_gguf(gguf_path)
    arch = read_architecture(reader)
    hp = read_hparams(reader, arch)
    tok = build_tokenizer(read_vocabulary(reader), context_length=hp.max_position_embeddings)
    if tok.tokenizer.get_vocab_size() > hp.vocab_size:
        raise GGUFImportError(
            f"the tokenizer has {tok.tokenizer.get_vocab_size()} tokens but the embedding only {hp.vocab_size} rows"
        )
    plan = tensor_plan(hp, reader.tensors)
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise GGUFImportError(f"{out} already exists (pass --force to replace it)")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        weights: dict[str, np.ndarray] = {}
        for tensor, hf_name, heads in tqdm(
            plan,
            desc=f"converting {gguf_path.name}",
            unit="tensor",
            file=sys.stderr,
            disable=not progress,
        ):
            weights[hf_name] = load_tensor(tensor, heads)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        del weights
        _write_json(staging / "config.json", hf_config(hp, tok.special_ids))
        generation = {
            f"{role}_token_id": tok.special_ids[role] for role in ("bos", "eos", "pad") if role in tok.special_ids
        }
        _write_json(staging / "generation_config.json", generation)
        tok.tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tok.tokenizer_config)
        _move_into_place(staging, out, overwrite=overwrite)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out
