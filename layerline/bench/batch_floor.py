"""The floor under `layerline bench`'s 32-stream figure: the model's matrix products at 32 rows.

Owns `BatchFloor`. A decode step of B sequences multiplies every weight of the model by B rows,
and at B = 32 those products are most of the step's time. This measures them alone, in the
bench's own process: a stage of the model's shapes holding all its layers, random weights in
the layouts a stage gives them (`apply_layouts`: packed weights where they serve the dtype, as
`--weight-layout both` keeps them: oneDNN's, in bfloat16 on a CPU with AMX the tile kernel's
of stage_worker/tiles.py, or where they serve stage_worker/fma_blocks.py's), and of it only the
linear layers and the LM head, called on random inputs of B rows: no attention, KV cache, norms,
rotary, sampling, scheduler or messages.
`generate(tokens)` times as many such steps as a request decodes tokens, so that its tokens/s
stands beside transformers' batch in the same round.

This floor over transformers' batch is the most an engine multiplying with these kernels could
show over transformers' batch on this machine; layerline's figure over it is how much of the
machine's products a step of layerline keeps. Knows a model by its config's shapes only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from layerline.shared.model_config import LayerRange, ModelConfig


@dataclass
class BatchFloor:
    """The products of one decode step of `rows` sequences, ready to be timed."""

    config: ModelConfig
    rows: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        import torch

        from layerline.stage_worker.layouts import apply_layouts
        from layerline.stage_worker.llama import DecoderLayer, StageModel

        dtype = getattr(torch, self.dtype)
        c = self.config
        with torch.no_grad():
            model = StageModel(c, LayerRange(0, c.num_layers)).to(dtype)
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        self._model = apply_layouts(model, weight_layout="both", dtype=dtype, device="cpu").eval()
        x = {  # an input of each width the products take
            "hidden": torch.randn(self.rows, c.hidden_size, dtype=dtype),
            "heads": torch.randn(self.rows, c.num_heads * c.head_dim, dtype=dtype),
            "mlp": torch.randn(self.rows, c.intermediate_size, dtype=dtype),
        }
        self._products = []  # (linear module, its input): the step's products, in the model's order
        for layer in self._model.layers.values():
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            self._products += [
                (attn.qkv_proj, x["hidden"]),
                (attn.o_proj, x["heads"]),
                (mlp.gate_up_proj, x["hidden"]),
                (mlp.down_proj, x["mlp"]),
            ]
        assert self._model.lm_head is not None
        self._products.append((self._model.lm_head, x["hidden"]))
        self._torch = torch
        self.step()  # warm: oneDNN builds its kernels on the first call of each shape

    @property
    def products(self) -> int:
        """Matrix products in one step: four a layer and the LM head."""
        return len(self._products)

    def step(self) -> float:
        """Seconds of one step's products."""
        with self._torch.inference_mode():
            start = time.perf_counter()
            for linear, x in self._products:
                linear(x)
            return time.perf_counter() - start

    def generate(self, tokens: int) -> float:
        """Tokens/s of `rows` sequences decoding `tokens` tokens each, if a step were only its products."""
        seconds = sum(self.step() for _ in range(tokens))
        return self.rows * tokens / seconds
