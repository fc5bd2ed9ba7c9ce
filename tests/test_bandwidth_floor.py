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

from layerline.bench.bandwidth_floor import BandwidthFloor, screened_weight_bytes, weight_bytes
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_through_the_screen_the_head_weighs_what_its_screen_holds(dtype: str) -> None:
    """The head's bytes at the dtype give way to those of its int8 screen's buffers (head_screen.py)."""
    from layerline.stage_worker import fma_blocks
    from layerline.stage_worker.head_screen import HeadScreen

    config = dataclasses.replace(TINY_SHAPES, vocab_size=256)
    head = torch.randn(256, config.hidden_size).to(getattr(torch, dtype))
    if fma_blocks.block_kernel(head.dtype) is None:
        pytest.skip("no block kernel with AVX-512 here")
    screen = HeadScreen(fma_blocks.layout(head), 256)
    held = sum(b.numel() * b.element_size() for b in screen.buffers())
    assert held == 256 * config.hidden_size + 256 * 6
    assert (
        screened_weight_bytes(config, dtype) == weight_bytes(config, dtype) - head.numel() * head.element_size() + held
    )


def test_its_rate_is_the_read_bandwidth_over_those_bytes() -> None:
    floor = BandwidthFloor(TINY_SHAPES, "bfloat16", buffer_bytes=1 << 20)
    assert floor.weight_bytes == weight_bytes(TINY_SHAPES, "bfloat16")
    read, rate = floor.read_bytes_per_s(), floor.tokens_per_s()
    assert math.isfinite(read) and read > 0
    assert math.isfinite(rate) and rate > 0
