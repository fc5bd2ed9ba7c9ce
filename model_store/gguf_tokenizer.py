"""A GGUF file's vocabulary turned into a Hugging Face fast tokenizer and its config.

This module owns the mapping from llama.cpp's byte-level BPE vocabulary (tokens, token types,
merges, pre-tokenizer name, special token ids, BOS/EOS flags, chat template) to a `tokenizers`
`Tokenizer` (saved as tokenizer.json) and the matching tokenizer_config.json: the pre-tokenizer
equivalent to llama.cpp's, the post-processor that adds BOS/EOS, and which tokens are special.

It knows nothing of the GGUF file format or its reader: `gguf_import` reads and checks the
metadata, raises its errors and hands over a `GGUFVocabulary`, from which building cannot fail.
It never writes files, and never imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`) -> whether digits are split one by one
# before the GPT-2 byte-level regex runs (llama.cpp's STARCODER/SMOLLM/REFACT split `\p{N}`).
GPT2_STYLE_PRE_TOKENIZERS: Final = {
    "smollm": True,
    "starcoder": True,
    "refact": True,
    "gpt-2": False,
    "phi-2": False,
    "default": False,
}
TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_USER_DEFINED: Final = 4


@dataclass(frozen=True)
class GGUFVocabulary:
    """The tokenizer metadata of a GGUF file, read and checked by `gguf_import.read_vocabulary`."""

    tokens: tuple[str, ...]  # tokenizer.ggml.tokens: token i has id i
    token_types: tuple[int, ...]  # tokenizer.ggml.token_type, one per token (3 control, 4 user-defined)
    merges: tuple[tuple[str, str], ...]  # tokenizer.ggml.merges, each two tokens whose concatenation is a token
    pre: str  # tokenizer.ggml.pre, a key of GPT2_STYLE_PRE_TOKENIZERS
    special_ids: Mapping[str, int]  # "bos"/"eos"/"pad"/"unk" -> id in `tokens`, for those the GGUF names
    add_bos: bool  # tokenizer.ggml.add_bos_token (then special_ids has "bos")
    add_eos: bool  # tokenizer.ggml.add_eos_token (then special_ids has "eos")
    chat_template: str | None  # tokenizer.chat_template


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer rebuilt from GGUF metadata, plus the JSON files that describe it."""

    tokenizer: Tokenizer  # the `tokenizers` runtime object, saved as tokenizer.json
    tokenizer_config: dict[str, Any]  # tokenizer_config.json
    special_ids: dict[str, int]  # bos/eos/pad/unk token ids present in the GGUF


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if not GPT2_STYLE_PRE_TOKENIZERS[pre]:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def _post_processor(bos: str | None, eos: str | None, ids: dict[str, int]) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS/EOS insertion when the GGUF asks for them."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None and eos is None:
        return byte_level

    def sequence(piece: str, type_id: int) -> str:  # e.g. "<s>:0 $A:0"
        return " ".join(f"{t}:{type_id}" for t in (bos, piece, eos) if t is not None)

    template = processors.TemplateProcessing(
        single=sequence("$A", 0),
        pair=f"{sequence('$A', 0)} {sequence('$B', 1)}",
        special_tokens=[(t, ids[t]) for t in dict.fromkeys((bos, eos)) if t is not None],
    )
    return processors.Sequence([byte_level, template])


def build_tokenizer(vocab: GGUFVocabulary, *, context_length: int) -> TokenizerFiles:
    """Rebuild the byte-level BPE tokenizer (GGUF `tokenizer.ggml.model` 'gpt2') and its config."""
    token_ids = {tok: i for i, tok in reversed(list(enumerate(vocab.tokens)))}  # first id wins on duplicates
    tokenizer = Tokenizer(models.BPE(vocab=token_ids, merges=list(vocab.merges), fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    kinds = list(zip(vocab.tokens, vocab.token_types))
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok, kind in kinds if kind == TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tok, special=False, normalized=False) for tok, kind in kinds if kind == TOKEN_TYPE_USER_DEFINED]
    )
    special_tokens = {f"{role}_token": vocab.tokens[i] for role, i in vocab.special_ids.items()}
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    tokenizer.post_processor = _post_processor(
        bos if vocab.add_bos else None, eos if vocab.add_eos else None, token_ids
    )

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        **special_tokens,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return TokenizerFiles(tokenizer=tokenizer, tokenizer_config=config, special_ids=dict(vocab.special_ids))
