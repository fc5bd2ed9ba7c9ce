"""The floor under `layerline bench`'s single-stream figure: a token's weights read at this
machine's memory bandwidth.

Its figures are timings, never asserted; what is asserted is what it counts: the bytes of every
weight a decode step multiplies (the same as a stage's linear layers and LM head hold), in each
dtype, with and without biases.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from layerline.bench.bandwidth_floor import BandwidthFloor, weight_bytes
from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.stage_worker.llama import StageModel

from .tiny_models import TINY_SHAPES


def _linear_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights and biases of a whole-model stage's linear layers (its LM head among them)."""
    model = StageModel(config, LayerRange(0, config.num_layers)).to(dtype)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 * config.num_layers + 1  # fused qkv, o, fused gate/up, down; the head
    return sum(p.numel() * p.element_size() for m in linears for p in m.parameters())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("biases", [False, True])
def test_a_tokens_bytes_are_the_linear_layers_and_the_head(dtype: str, biases: bool) -> None:
    config = dataclasses.replace(TINY_SHAPES, qkv_bias=biases, o_bias=biases, mlp_bias=biases)
    assert weight_bytes(config, dtype) == _linear_bytes(config, getattr(torch, dtype))


def test_its_rate_is_the_read_bandwidth_over_those_bytes() -> None:
    floor = BandwidthFloor(TINY_SHAPES, "bfloat16", buffer_bytes=1 << 20)
    assert floor.weight_bytes == weight_bytes(TINY_SHAPES, "bfloat16")
    read, rate = floor.read_bytes_per_s(), floor.tokens_per_s()
    assert math.isfinite(read) and read > 0
    assert math.isfinite(rate) and rate > 0
