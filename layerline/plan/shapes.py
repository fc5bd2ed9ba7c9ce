"""What a model weighs: parameters, bytes per rank and stage, KV cache per token, and memory per device.

Owns finding a model's config (a name of the configs shipped here, a checkpoint directory or a bare
`config.json`: no weights needed) and the arithmetic on its shapes. The counts follow how a layerline
stage holds its tensors (stage_worker/sharding.py): a tensor-parallel rank holds 1/tp of the heads,
of the MLP width and of the vocabulary rows; key/value heads are replicated when tp exceeds them;
norms are whole on every rank; the LM head is a tensor of its own, tied or not. How many layouts
of each matrix a stage keeps is the caller's `copies`. Knows nothing of devices, speed or the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layerline.shared.model_config import ConfigError, ModelConfig

CONFIGS = Path(__file__).parent / "configs"  # config.json of models one can plan for by name
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PREFILL_CHUNK_TOKENS = 512  # the coordinator's default token budget: the largest step a stage computes
GIB = 1024**3


def known_configs() -> list[str]:
    """The model names `--model` takes without a checkpoint."""
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def load_model_config(model: str) -> tuple[str, ModelConfig]:
    """A model's name and config from a shipped name, a checkpoint directory or a config.json file."""
    shipped = CONFIGS / f"{model}.json"
    path = Path(model)
    if shipped.is_file():
        return model, ModelConfig.from_dict(json.loads(shipped.read_text()))
    if path.is_dir():
        return path.name, ModelConfig.from_checkpoint(path)
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"--model {model} is not valid JSON: {err}") from None
        return path.parent.name or path.stem, ModelConfig.from_dict(raw)
    raise ConfigError(
        f"--model {model!r} is neither a known name ({', '.join(known_configs())}), "
        "a checkpoint directory nor a config.json file"
    )


@dataclass(frozen=True)
class Placement:
    """One stage of a layout: its layers, on `tp` ranks."""

    start: int
    end: int
    tp: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the LM head


@dataclass(frozen=True)
class Memory:
    """Bytes one device (one rank) of a stage holds."""

    weights: int
    kv_cache: int
    activations: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.runtime


def kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    """Key/value heads one rank holds: a share, or one replicated head when tp exceeds them."""
    return config.num_kv_heads // tp if config.num_kv_heads >= tp else 1


def can_split(config: ModelConfig, tp: int) -> bool:
    """Whether layerline can cut this model's tensors over `tp` ranks (the rules of sharding.py)."""
    heads, kv = config.num_heads, config.num_kv_heads
    return heads % tp == 0 and config.intermediate_size % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def layer_matrix_params_per_rank(config: ModelConfig, tp: int) -> int:
    """The weight matrices' parameters of one decoder layer on one of `tp` ranks: q, k, v and o
    (q, k, v split by columns, o by rows) and the MLP's gate, up and down."""
    h, d = config.hidden_size, config.head_dim
    q = config.num_heads // tp * d
    kv = kv_heads_per_rank(config, tp) * d
    return h * q + 2 * h * kv + q * h + 3 * h * (config.intermediate_size // tp)


def layer_params_per_rank(config: ModelConfig, tp: int) -> int:
    """Parameters of one decoder layer on one of `tp` ranks: its matrices, biases and norms."""
    h, d = config.hidden_size, config.head_dim
    q = config.num_heads // tp * d
    kv = kv_heads_per_rank(config, tp) * d
    biases = (q + 2 * kv if config.qkv_bias else 0) + (h if config.o_bias else 0)
    if config.mlp_bias:
        biases += 2 * (config.intermediate_size // tp) + h
    return layer_matrix_params_per_rank(config, tp) + biases + 2 * h  # and the two RMSNorms, whole on every rank


def vocab_rows_per_rank(config: ModelConfig, tp: int) -> int:
    return -(-config.vocab_size // tp)


def stage_params_per_rank(config: ModelConfig, stage: Placement, *, copies: int = 1) -> int:
    """Parameters one rank of `stage` holds: its layers, and the embedding, norm and head it owns;
    each weight matrix and the head `copies` times (a CPU stage's `--weight-layout both` keeps two
    layouts of them: stage_worker/layouts.py's `weight_copies`). The head is a tensor of its own
    even where the checkpoint ties it to the embedding: a stage lays it out in column blocks
    (layouts.LMHead), so the two are never one tensor."""
    layers = stage.end - stage.start
    params = layers * (
        layer_params_per_rank(config, stage.tp) + (copies - 1) * layer_matrix_params_per_rank(config, stage.tp)
    )
    table = vocab_rows_per_rank(config, stage.tp) * config.hidden_size
    if stage.first:
        params += table
    if stage.last:
        params += config.hidden_size + copies * table  # the final norm and the head
    return params


def streamed_params_per_token(config: ModelConfig, stage: Placement) -> int:
    """Parameters one rank reads to advance a token: one copy of all but the embedding (a lookup of one row)."""
    table = vocab_rows_per_rank(config, stage.tp) * config.hidden_size
    return stage_params_per_rank(config, stage) - (table if stage.first else 0)


def kv_bytes_per_token(config: ModelConfig, stage: Placement, dtype: str) -> int:
    """KV cache one rank of `stage` holds for one token of one sequence: K and V of each of its layers."""
    per_layer = 2 * kv_heads_per_rank(config, stage.tp) * config.head_dim * DTYPE_BYTES[dtype]
    return (stage.end - stage.start) * per_layer


def activation_bytes(config: ModelConfig, stage: Placement, dtype: str, *, concurrency: int) -> int:
    """The largest step's transient tensors on one rank: a prompt chunk's hidden states, its q/k/v and
    MLP intermediates for one layer at a time, and float32 logits of every sequence on the last stage."""
    tokens = PREFILL_CHUNK_TOKENS
    h = config.hidden_size
    width = 3 * h + (config.num_heads // stage.tp) * config.head_dim * 2 + 3 * config.intermediate_size // stage.tp
    hidden = tokens * width * DTYPE_BYTES[dtype]
    logits = concurrency * vocab_rows_per_rank(config, 1) * 4 if stage.last else 0  # gathered on every rank
    return hidden + logits


def memory_per_rank(
    config: ModelConfig,
    stage: Placement,
    dtype: str,
    *,
    context: int,
    concurrency: int,
    runtime_bytes: int,
    copies: int = 1,
    screened: bool = False,
) -> Memory:
    """What one device of `stage` holds with `concurrency` sequences of `context` tokens on its
    chain, `copies` of each weight matrix (see `stage_params_per_rank`); where `screened` (the
    machine's stages keep one: stage_worker/head_screen.py), the LM head's int8 screen too."""
    return Memory(
        weights=stage_params_per_rank(config, stage, copies=copies) * DTYPE_BYTES[dtype]
        + (screen_bytes_per_rank(config, stage) if screened else 0),
        kv_cache=kv_bytes_per_token(config, stage, dtype) * context * concurrency,
        activations=activation_bytes(config, stage, dtype, concurrency=concurrency),
        runtime=runtime_bytes,
    )


def screen_bytes_per_rank(config: ModelConfig, stage: Placement) -> int:
    """The LM head's int8 screen a last stage of one rank keeps where its head is a whole number of
    blocks of 32 outputs (stage_worker/head_screen.py: a code a weight, a bfloat16 scale and a float32
    bound an output; tests/test_plan_memory.py checks it against what a stage holds)."""
    if not stage.last or stage.tp != 1 or config.vocab_size % 32:
        return 0
    return config.vocab_size * (config.hidden_size + 2 + 4)


def hidden_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """What a stage sends the next one for each token: its hidden state."""
    return config.hidden_size * DTYPE_BYTES[dtype]


def flops_per_token(config: ModelConfig, stage: Placement, *, context: int) -> float:
    """Multiply-adds (x2) one rank spends on a token: its weights' matmuls and attention over `context`."""
    attention = 4 * (config.num_heads // stage.tp) * config.head_dim * context * (stage.end - stage.start)
    return 2.0 * streamed_params_per_token(config, stage) + attention
