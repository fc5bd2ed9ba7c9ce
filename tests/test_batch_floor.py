"""The floor under `layerline bench`'s 32-stream figures: the model's products at 32 rows, alone.

Its figures are timings, never asserted; what is asserted is what it times: four products a
layer and the LM head, in the layouts a stage gives its weights, on inputs of the rows asked.
"""

from __future__ import annotations

import math

import torch

from layerline.bench.batch_floor import BatchFloor
from layerline.stage_worker.layouts import PackedLinear

from .tiny_models import TINY_SHAPES


def test_a_step_is_every_layers_four_products_and_the_head_at_the_rows_asked() -> None:
    floor = BatchFloor(TINY_SHAPES, rows=5)
    assert floor.products == 4 * 4 + 1
    widths = []
    with torch.inference_mode():
        for linear, x in floor._products:
            assert isinstance(linear, PackedLinear)  # float32 on CPU: the packed weights a stage multiplies 5 rows by
            widths.append(tuple(linear(x).shape))
    # fused qkv (4 + 2 * 2 heads of 8), o, fused gate/up, down; then the head
    assert widths == [(5, 64), (5, 32), (5, 128), (5, 32)] * 4 + [(5, 96)]
    rate = floor.generate(3)
    assert math.isfinite(rate) and rate > 0
