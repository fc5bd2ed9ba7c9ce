"""The model configuration every process reads: parsed, validated, frozen.

Owns the mapping from a Hugging Face `config.json` of the Llama family (Llama 2 and 3, Mistral,
Qwen2, SmolLM2) to one frozen `ModelConfig`, with transformers' defaults for a missing field,
and the half-open `LayerRange` a stage serves. The coordinator (context length, layer count),
the launcher (how to split the layers) and the stage worker (everything) read the same object.
Knows nothing of torch, weights or the network: every check here is on plain values, and every
refusal names the config field and what would be accepted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# max_position_embeddings when config.json leaves it out: what transformers assumes per family.
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}


class ConfigError(ValueError):
    """A checkpoint's config.json, or a requested layer range, that layerline cannot serve."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base of the rotary frequencies
    rope_type: str  # "default", "linear" or "llama3"
    factor: float = 1.0  # "linear" and "llama3": how much the context was stretched
    low_freq_factor: float = 1.0  # "llama3": wavelengths above orig/low are scaled fully
    high_freq_factor: float = 4.0  # "llama3": wavelengths below orig/high are kept
    original_max_position_embeddings: int = 8192  # "llama3": the pre-scaling context length


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "llama", "mistral" or "qwen2"
    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the MLP
    num_layers: int  # total decoder layers of the whole model
    num_heads: int  # total query heads (before any tensor-parallel split)
    num_kv_heads: int  # total key/value heads (GQA when fewer than num_heads)
    head_dim: int  # width of one attention head
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope: RopeConfig  # rotary position embedding
    max_position_embeddings: int  # longest position the model was configured for
    tie_word_embeddings: bool  # the LM head reuses the embedding matrix
    qkv_bias: bool  # q, k and v projections carry a bias (Qwen2, Llama attention_bias)
    o_bias: bool  # the output projection carries a bias (Llama attention_bias)
    mlp_bias: bool  # gate, up and down projections carry a bias (Llama mlp_bias)
    sliding_window: int | None  # attend only to the last N positions (Mistral), else None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json model_type = {model_type!r} is not supported; "
                f"layerline serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json hidden_act = {act!r} is not supported; only 'silu' is")
        hidden = _positive_int(raw, "hidden_size")
        heads = _positive_int(raw, "num_attention_heads")
        kv_heads = _positive_int(raw, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ConfigError(
                f"config.json num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}"
            )
        head_dim = raw.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"config.json head_dim = {head_dim!r} must be a positive even integer")
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError("config.json pretraining_tp must be 1")
        qkv_bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
        o_bias = model_type != "qwen2" and bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=_positive_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(raw),
            max_position_embeddings=_positive_int(
                raw, "max_position_embeddings", default=DEFAULT_MAX_POSITIONS[model_type]
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=_sliding_window(raw, model_type),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def head_weight(self) -> float:
        """How many decoder layers' worth of weights the LM head is (the work of a decode step)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o, k, v
        layer = attention + 3 * self.hidden_size * self.intermediate_size  # and gate, up, down
        return self.vocab_size * self.hidden_size / layer

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> ModelConfig:
        path = Path(checkpoint) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: not a Hugging Face checkpoint directory") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from None
        return cls.from_dict(raw)


@dataclass(frozen=True)
class LayerRange:
    """The half-open range `[start, end)` of global layer indices one stage serves."""

    start: int
    end: int

    @classmethod
    def parse(cls, text: str, *, num_layers: int | None = None) -> LayerRange:
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ConfigError(f"layer range {text!r} must be START:END, e.g. 0:15")
        rng = cls(int(parts[0]), int(parts[1]))
        if num_layers is not None:
            rng.check(num_layers)
        return rng

    def check(self, num_layers: int) -> None:
        if self.start < 0 or self.end > num_layers or self.start >= self.end:
            raise ConfigError(
                f"layer range {self} is outside [0, {num_layers}) or empty: need 0 <= start < end <= {num_layers}"
            )

    @property
    def is_first(self) -> bool:
        return self.start == 0

    def is_last(self, num_layers: int) -> bool:
        return self.end == num_layers

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.start, self.end))

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def _positive_int(raw: dict[str, Any], key: str, *, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json {key} = {value!r} must be a positive integer")
    return value


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` beside an optional `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json rope_scaling.rope_type = {rope_type!r} is not supported; "
            f"layerline supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta, rope_type="default")
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"config.json rope_scaling.factor = {factor} must be positive")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    if model_type == "qwen2":
        if raw.get("use_sliding_window"):
            raise ConfigError("config.json use_sliding_window = true is not supported for qwen2; set it to false")
        return None
    if model_type != "mistral":
        return None
    window = raw.get("sliding_window")
    if window is None:
        return None
    if not isinstance(window, int) or window <= 0:
        raise ConfigError(f"config.json sliding_window = {window!r} must be a positive integer or null")
    return window
