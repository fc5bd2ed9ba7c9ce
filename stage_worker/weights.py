"""Reading a stage's own tensors from a Hugging Face safetensors checkpoint, and nothing else.

Owns: finding which file holds each tensor (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`), reading exactly the tensors a layer range owns (recorded in
`CheckpointReader.read`, so tests can prove nothing else was touched), and under tensor
parallelism only this rank's piece of each (the plan is sharding.py's), fusing q, k, v and
gate, up, building a `StageModel` from them (then handing it to layouts.py), the model id: a
digest of the config and of every tensor's name, dtype and shape, and the bytes a loaded stage
holds (`held_bytes`, what its worker reports).

Knows nothing of the network, of how the model is run, or of the layouts its weights take.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from layerline.shared.model_config import ConfigError, LayerRange, ModelConfig

from .layouts import apply_layouts
from .llama import StageModel
from .parallel import SINGLE_RANK, TensorParallel
from .rotary import rope_inv_freq
from .settings import check_quantize, check_weight_layout
from .sharding import ZEROS, Piece, piece_for

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing files or tensors a stage needs."""


class CheckpointReader:
    """Lazily opens the safetensors files of a checkpoint and reads single tensors by name."""

    def __init__(self, checkpoint: str | Path) -> None:
        self.root = Path(checkpoint)
        self.files = _tensor_files(self.root)  # tensor name -> file name
        self.read: list[str] = []  # names of the tensors read so far, in order
        self.slices: list[tuple[str, int, int, int]] = []  # (name, dim, start, end) of sliced reads
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint {self.root} has no tensor {name!r}")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(self.root / file), framework="pt")
        return handle

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, from the file's header, without reading the data."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, piece: Piece | None = None) -> torch.Tensor:
        """The whole tensor, or only rows (dim 0) or columns (dim 1) [start, end) of it."""
        handle = self._handle(name)
        self.read.append(name)
        if piece is None:
            return handle.get_tensor(name)
        dim, start, end = piece
        self.slices.append((name, dim, start, end))
        stored = handle.get_slice(name)
        return stored[start:end] if dim == 0 else stored[:, start:end]


def owned_tensor_names(config: ModelConfig, layers: LayerRange) -> dict[str, str]:
    """Map each unfused parameter of a stage (as in the checkpoint, without the `model.`
    prefix) to the checkpoint tensor it loads from. `load_stage` then fuses q, k, v and gate, up.
    """
    names: dict[str, str] = {}
    if layers.is_first:
        names["embed_tokens.weight"] = "model.embed_tokens.weight"
    for i in layers:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"layers.{i}.self_attn.{proj}.weight"] = f"model.layers.{i}.self_attn.{proj}.weight"
        biased: tuple[str, ...] = ("q_proj", "k_proj", "v_proj") if config.qkv_bias else ()
        biased += ("o_proj",) if config.o_bias else ()
        for proj in biased:
            names[f"layers.{i}.self_attn.{proj}.bias"] = f"model.layers.{i}.self_attn.{proj}.bias"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"layers.{i}.mlp.{proj}.weight"] = f"model.layers.{i}.mlp.{proj}.weight"
            if config.mlp_bias:
                names[f"layers.{i}.mlp.{proj}.bias"] = f"model.layers.{i}.mlp.{proj}.bias"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names[f"layers.{i}.{norm}.weight"] = f"model.layers.{i}.{norm}.weight"
    if layers.is_last(config.num_layers):
        names["norm.weight"] = "model.norm.weight"
        names["lm_head.weight"] = "lm_head.weight"
    return names


def load_stage(
    checkpoint: str | Path,
    layers: LayerRange,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    reader: CheckpointReader | None = None,
    tp: TensorParallel = SINGLE_RANK,
    weight_layout: str = "both",
    quantize: str = "none",
) -> StageModel:
    """Build the `StageModel` of `layers`, reading only the tensors it owns.

    Under tensor parallelism (`tp.size > 1`) each rank reads only its own slice of each tensor
    (sliced reads from the file, never the whole tensor then cut). `weight_layout` says
    whether float32 linear layers on CPU are also, or only, kept packed for oneDNN, and whether
    bfloat16 ones keep their [out, in] weight for single rows beside the packed one (layouts.py);
    `quantize` ("int8", "int4") makes the linear layers and the LM head quantized instead.
    """
    check_weight_layout(weight_layout)
    check_quantize(quantize)
    config = config or ModelConfig.from_checkpoint(checkpoint)
    layers.check(config.num_layers)
    reader = reader or CheckpointReader(checkpoint)
    with torch.device("meta"):
        model = StageModel(config, layers, tp=tp)
    state = _read_state(reader, model, tp=tp, dtype=dtype, device=device)
    model.load_state_dict(_fused(state, layers), strict=True, assign=True)
    del state  # the model now holds the only references, so layouts can free each plain weight
    model.inv_freq = rope_inv_freq(config.rope, config.head_dim).to(device)
    apply_layouts(model, weight_layout=weight_layout, dtype=dtype, device=device, quantize=quantize)
    model.set_threads(torch.get_num_threads())  # until the engine decides per step
    return model.eval()


def _read_state(
    reader: CheckpointReader,
    model: StageModel,
    *,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """The unfused parameters of `model` (on meta), each this rank's piece of its checkpoint tensor."""
    config = model.config
    loaded: dict[tuple[str, Piece | None], torch.Tensor] = {}  # (name, piece) -> tensor: a tied head is shared
    state: dict[str, torch.Tensor] = {}
    for param, name in owned_tensor_names(config, model.layer_range).items():
        source = _tied_source(reader, config) if param == "lm_head.weight" and name not in reader else name
        expected = _expected_shape(config, param)
        piece = piece_for(param, config=config, shards=model.shards, tp=tp)
        if piece == ZEROS:  # a row-parallel bias: added once, by rank 0
            state[param] = torch.zeros(expected, device=device, dtype=dtype)
            continue
        if (source, piece) not in loaded:
            if reader.shape(source) != expected:
                raise CheckpointError(
                    f"checkpoint tensor {source!r} has shape {reader.shape(source)}, the config needs {expected}"
                )
            tensor = reader.get(source, piece)
            if param in ("embed_tokens.weight", "lm_head.weight"):  # pad the vocabulary rows
                tensor = F.pad(tensor, (0, 0, 0, model.shards.vocab_per_rank - tensor.shape[0]))
            loaded[(source, piece)] = tensor.to(device=device, dtype=dtype)
        state[param] = loaded[(source, piece)]
    return state


def _tied_source(reader: CheckpointReader, config: ModelConfig) -> str:
    """Where a head without its own tensor loads from: the embedding, if the config ties them."""
    if not config.tie_word_embeddings:
        raise CheckpointError(
            f"checkpoint {reader.root} has no tensor 'lm_head.weight' and its config does not tie word embeddings"
        )
    return "model.embed_tokens.weight"


def _expected_shape(config: ModelConfig, param: str) -> tuple[int, ...]:
    hidden, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    module, _, what = param.rpartition(".")  # "layers.3.self_attn.q_proj", "weight"
    kind = module.rpartition(".")[2]  # "q_proj"
    out_in = {
        "embed_tokens": (config.vocab_size, hidden),
        "lm_head": (config.vocab_size, hidden),
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }.get(kind, (hidden,))  # the norms
    return out_in if what == "weight" else out_in[:1]


def _fused(state: dict[str, torch.Tensor], layers: LayerRange) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with q, k, v fused into one qkv_proj and gate, up into one
    gate_up_proj (rows stacked: [q | k | v], [gate | up]), each part dropped once fused."""
    for i in layers:
        for fused, parts in (
            (f"layers.{i}.self_attn.qkv_proj", [f"layers.{i}.self_attn.{p}_proj" for p in "qkv"]),
            (f"layers.{i}.mlp.gate_up_proj", [f"layers.{i}.mlp.{p}_proj" for p in ("gate", "up")]),
        ):
            state[f"{fused}.weight"] = torch.cat([state.pop(f"{p}.weight") for p in parts])
            biases = [state.pop(f"{p}.bias", None) for p in parts]
            if biases[0] is not None:
                state[f"{fused}.bias"] = torch.cat(biases)  # type: ignore[arg-type]
    return state


def model_id(checkpoint: str | Path, *, quantize: str = "none") -> str:
    """A digest of the config and of every tensor's name, dtype and shape (not its bytes), and of
    the `quantize` scheme unless "none": quantized weights are other weights, so the coordinator
    never chains them with float ones, and a failover never moves a sequence between the two."""
    root = Path(checkpoint)
    config = json.loads((root / "config.json").read_text())
    config.pop("transformers_version", None)
    config.pop("_name_or_path", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    headers: dict[str, object] = {}
    for file in sorted(set(_tensor_files(root).values())):
        with safe_open(str(root / file), framework="pt") as tensors:
            for name in tensors.keys():
                stored = tensors.get_slice(name)
                headers[name] = [stored.get_dtype(), stored.get_shape()]  # e.g. ["BF16", [576, 1536]]
    digest.update(json.dumps(headers, sort_keys=True).encode())
    if quantize != "none":
        digest.update(f"quantize={quantize}".encode())
    return digest.hexdigest()[:16]


def _tensor_files(root: Path) -> dict[str, str]:
    if not (root / "config.json").is_file():
        raise ConfigError(f"{root} is not a checkpoint directory: it has no config.json")
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if missing:
            raise CheckpointError(f"checkpoint {root} is missing shard file(s): {', '.join(missing)}")
        return dict(weight_map)
    single = root / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"checkpoint {root} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as tensors:
        return dict.fromkeys(tensors.keys(), SINGLE_FILE)


def held_bytes(model: nn.Module) -> int:
    """Bytes of the tensors `model` holds, parameters and buffers, each memory counted once: a
    tensor sharing another's storage (a packed layer's bias, the plain one's) adds nothing.
    oneDNN's packed weights have no storage to compare; each is its own."""
    storages: dict[int, int] = {}
    for t in model.state_dict(keep_vars=True).values():
        if t.is_mkldnn:
            storages[id(t)] = t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
