"""Rotary position embedding's inverse frequencies for a model's `RopeConfig`: plain, linear or
Llama 3 scaling (the tables of cos and sin built from them are StageModel.rope's, llama.py).

Knows the model config's rope fields and torch's arithmetic; nothing of layers, caches or steps.
"""

from __future__ import annotations

import torch

from layerline.shared.model_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with linear or Llama 3 scaling applied.

    Always on the CPU, even under `torch.device("meta")`: meta arithmetic runs torch's Python
    reference kernels, whose first use imports torch._dynamo (over a second of a worker's start)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq
