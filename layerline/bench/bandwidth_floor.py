"""The floor under `layerline bench`'s single-stream figure: this machine's memory bandwidth.

Owns `BandwidthFloor`. A lone stream's token multiplies every weight of the model by one row, so
each of its bytes comes from memory once a token (the model is larger than the caches) and
little else does: at one row the products are bound by how fast the cores read memory, not by
how fast they multiply. This measures that speed, in the bench's own process on its threads, as
torch reads it: the best of a few sums over a float32 buffer far larger than the last cache.
The weights' bytes a token reads (`weight_bytes`: the model's linear layers and its LM head at
the run's dtype; norms and one embedding row are next to nothing) over that speed is the least
time any engine reading them could take a token here (`screened_weight_bytes`: where a greedy
step reads the head through its int8 screen, the least for such a step); transformers' time over
it is the most any engine could show over transformers, and our stage's rate over its rate is how
much of the machine a lone stream keeps. Measured in seven bench runs on 2 cores of an Intel
Xeon with AMX (issue 21's nineteenth session): 28-33 GB/s; SmolLM2 reads 538 MB a token in
float32, 16-19 ms, against transformers' 38-39 ms (2.16-2.33x), and 269 MB in bfloat16 (4.5-4.8x);
through the screen 453 and 241 MB.

Knows a model by its config's shapes only; nothing of clusters or the network.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from layerline.shared.model_config import ModelConfig

BUFFER_BYTES = 1 << 30  # read once a pass: far past the last cache of the machines this runs on
PASSES = 4  # the best of these is kept: a pass slowed by a neighbour says nothing of the memory


def weight_bytes(config: ModelConfig, dtype: str) -> int:
    """Bytes of the weights a decode step reads once whatever its rows: each layer's q, k, v, o,
    gate, up and down projections (biases too where the config has them) and the LM head."""
    import torch

    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    if c.qkv_bias:
        per_layer += q + 2 * kv
    if c.o_bias:
        per_layer += c.hidden_size
    if c.mlp_bias:
        per_layer += 2 * c.intermediate_size + c.hidden_size
    elements = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    return elements * getattr(torch, dtype).itemsize


def screened_weight_bytes(config: ModelConfig, dtype: str) -> int:
    """`weight_bytes` where a greedy lone row reads the LM head through its int8 screen instead
    (stage_worker/head_screen.py: a code a weight, a bfloat16 scale and a float32 bound an output;
    the few outputs it leaves, a few KB each, not counted)."""
    import torch

    head = config.vocab_size * config.hidden_size
    return weight_bytes(config, dtype) - head * getattr(torch, dtype).itemsize + head + config.vocab_size * 6


@dataclass
class BandwidthFloor:
    """The read bandwidth of this process's threads, and what it allows a lone stream of `config`."""

    config: ModelConfig
    dtype: str = "float32"
    buffer_bytes: int = BUFFER_BYTES

    def __post_init__(self) -> None:
        import torch

        self._torch = torch
        self._buffer = torch.ones(self.buffer_bytes // 4, dtype=torch.float32)  # touched: its pages exist
        self.weight_bytes = weight_bytes(self.config, self.dtype)

    def read_bytes_per_s(self) -> float:
        """The best of `PASSES` reads of the whole buffer (a sum), in bytes a second."""
        best = float("inf")
        with self._torch.inference_mode():
            for _ in range(PASSES):
                start = time.perf_counter()
                self._buffer.sum()
                best = min(best, time.perf_counter() - start)
        return self._buffer.numel() * 4 / best

    def tokens_per_s(self) -> float:
        """A lone stream's tokens a second if a token took only the time to read its weights once."""
        return self.read_bytes_per_s() / self.weight_bytes
