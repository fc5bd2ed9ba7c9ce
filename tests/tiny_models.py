"""Tiny random checkpoints of each supported family, written by transformers (the oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

from layerline.shared.model_config import ModelConfig

# A config of shapes only (no checkpoint), for what knows a model by its shapes: the bench's floors.
TINY_SHAPES = ModelConfig.from_dict(
    dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
)

FAMILIES = {
    # GQA and Llama 3 rope scaling (factor applies: original context shorter than the test's).
    "llama3": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rope_theta=500000.0,
    ),
    # Llama 2 style: multi-head attention, with attention and MLP biases.
    "llama2": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True
    ),
    # Mistral: GQA and a sliding window shorter than the test sequences.
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=7, head_dim=16),
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # For tensor parallelism at tp 2 and 3: 6 heads, 1 KV head (replicated on every rank).
    "tp_mqa": dict(model_type="llama", num_attention_heads=6, num_key_value_heads=1, intermediate_size=96),
    # 6 heads, 3 KV heads, q/k/v bias, tied embeddings: tp 3 gives each rank one KV head.
    "tp_gqa": dict(
        model_type="qwen2", num_attention_heads=6, num_key_value_heads=3, intermediate_size=96, tie_word_embeddings=True
    ),
    # SmolLM2 shape: Llama with GQA 3:1 and tied embeddings.
    "smollm2": dict(
        model_type="llama", num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0
    ),
}


def make_tiny_checkpoint(
    family: str,
    out: Path,
    *,
    num_layers: int = 4,
    vocab_size: int = 211,
    hidden_size: int = 48,
    seed: int = 0,
    max_shard_size: str | None = None,
    intermediate_size: int | None = None,
):
    """Write a random tiny model of `family` to `out` and return the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    if spec.get("head_dim") is None:
        spec["head_dim"] = hidden_size // spec["num_attention_heads"]
    if intermediate_size is not None:
        spec["intermediate_size"] = intermediate_size
    spec.setdefault("intermediate_size", 2 * hidden_size + 8)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random init is tiny; make every tensor (norms, biases) non-trivial
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return model


def write_byte_tokenizer(out: Path) -> int:
    """A byte-level tokenizer with no merges and a plain chat template in `out` (ids 0-2 special,
    then one per byte).

    Enough for the coordinator to serve a tiny checkpoint end to end; returns the vocabulary size.
    """
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]  # bos 1 and eos 2, as make_tiny_checkpoint's config says
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(specials + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(out / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )
    return len(vocab)
