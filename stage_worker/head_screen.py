"""A greedy step's LM head through an int8 screen: the whole head's argmax from a quarter of its bytes.

A lone stream's step reads every weight once, and the head is the largest: SmolLM2's [49152, 576]
is 113 MB of a float32 step's 538 MB (3.7 of 20 ms on 2 cores of an Intel Xeon, family 6 model
207). A step whose every row is greedy (temperature 0, no repetition penalty, no log-probabilities;
drafted tokens' checks too, `speculation.verify` drawing as `sample` does) needs only each row's
argmax. `HeadScreen` keeps an int8 copy of the head (quantize.quantize_int8: one code a weight, one
scale an output; 28 MB for SmolLM2) and for each output j a bound c_j such that the head's output
y_j = x . w_j and the screen's s_j = x . w'_j (w'_j the codes times the scale) differ by at most
||x|| c_j for any row x, both products' float32 rounding included: c_j = ||w_j - w'_j|| +
2 g (||w_j|| + ||w'_j||), g = n u / (1 - n u), n = inputs + 16, u = 2^-24 (a sum of n products in
any order errs by at most g times the sum of their magnitudes, at most ||x|| ||w_j|| by
Cauchy-Schwarz; the screen's scaling adds one rounding; blocks.c adds an absolute slack for sums
below float32's normal numbers). x times the codes (blocks.c's int8 product, the codes in the
float32 blocks' order) then rules out every output whose upper bound falls below another's lower
bound; blocks.c computes the few left as the whole product computes them, to the bit, and the
first largest of them is the whole product's argmax (`torch.argmax`'s answer: ties go to the
first). In bfloat16, where the head rounds each output to bfloat16, the bounds widen by that
rounding. Over 257 greedy steps of 8 prompts on SmolLM2 in float32, 4 outputs were left at the
median, 54 at most; past 512 left, or anything not finite, the whole head is read instead.

It serves a head in fma_blocks' layout (Intel's CPUs without AMX; the only layout whose sums it
reproduces), without a bias, on one rank (layouts.py makes it; `keeps_head_screen` says where),
for up to MAX_ROWS rows a step; `LAYERLINE_GREEDY_SCREEN=off` turns it off. Its codes, scales and
bounds are the model's buffers (`StageModel.head_screen`: counted in what a stage holds, and by
`layerline plan`). What it returns is not the logits: each row's winning logit at its winner and
-inf elsewhere, which `sampler.greedy` reads as it would read the whole row.

Knows the head's layout and the bound; nothing of models, steps or the network.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from .fma_blocks import BLOCK, block_kernel, is_blocked
from .quantize import quantize_int8

log = logging.getLogger(__name__)

ENV = "LAYERLINE_GREEDY_SCREEN"  # auto (the default): screen where it serves; off: never
ROWS_AT_ONCE = 4096  # outputs whose codes and bounds are made at once when the screen is made (`_made`)
# The most rows a step screens at once, by the head's dtype: more, and the whole head is read. The
# head alone, SmolLM2's, cold (1.5 GB read between calls), random rows, 2 threads, Intel Xeon family
# 6 model 207, ms, whole against screened: float32 1 row 4.06 / 1.56, 4 rows 4.99 / 2.29, 8 rows
# 4.44 / 2.81, 12 rows 4.64 / 3.67, 16 rows 5.72 / 5.01; bfloat16 1 row 1.92 / 1.44, 2 rows 1.96 /
# 1.59, 4 rows 2.68 / 2.21, 6 rows 2.46 / 2.45, 8 rows 2.58 / 3.00.
MAX_ROWS = {torch.float32: 12, torch.bfloat16: 4}


def enabled() -> bool:
    """Whether LAYERLINE_GREEDY_SCREEN lets a stage make a screen (its default `auto` does)."""
    return os.environ.get(ENV, "auto") != "off"


class HeadScreen(nn.Module):
    """The argmax of x W^T for each of a few rows x, W a head in fma_blocks' layout, read through its int8 codes."""

    codes: torch.Tensor  # [out / 32, in, 32] int8 (`_made`)
    scales: torch.Tensor  # [out] bfloat16
    bounds: torch.Tensor  # [vocab] float32: c_j of the module's doc

    def __init__(self, blocked: torch.Tensor, vocab: int) -> None:
        super().__init__()
        dtype, fan_in = blocked.dtype, blocked.shape[1]
        kernel = block_kernel(dtype)
        if kernel is None:
            raise ValueError(f"the {dtype} block kernel does not serve on this CPU")
        if not is_blocked(blocked) or not blocked.is_contiguous() or blocked.device.type != "cpu":
            raise ValueError(f"weight {list(blocked.shape)} {dtype}: not a contiguous CPU block layout")
        self.blocked, self.vocab = blocked, vocab  # the head's weight: not a buffer of this module
        codes, scales, bounds = _made(blocked)
        self.register_buffer("codes", codes)  # [out / 32, in, 32], as float32's blocks
        self.register_buffer("scales", scales)
        self.register_buffer("bounds", bounds[:vocab].contiguous())
        self._linear, self._argmax = kernel.unchecked["blocks_i8_linear"], kernel.unchecked["blocks_screened_argmax"]
        self._bf16, self._fan_in = int(dtype == torch.bfloat16), fan_in
        self.max_rows = MAX_ROWS[dtype]

    @classmethod
    def of(cls, head: nn.Module | None, vocab: int) -> HeadScreen | None:
        """The screen of a last stage's `head` (a layouts.PackedLinear), or None where it does not
        serve (see the module's doc), said in the log when it does."""
        if not enabled() or head is None or getattr(head, "bias", None) is not None:
            return None
        blocked = getattr(head, "weight_packed", None)
        if not isinstance(blocked, torch.Tensor) or not is_blocked(blocked):
            return None
        if not 0 < vocab <= blocked.shape[0] * BLOCK or block_kernel(blocked.dtype) is None:
            return None
        screen = cls(blocked, vocab)
        mb = sum(b.numel() * b.element_size() for b in screen.buffers()) / 1e6
        log.info("greedy steps read the LM head through its int8 screen (head_screen.py): %.1f MB more", mb)
        return screen

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [R, in] (the final norm's rows, the head's dtype) -> [R, vocab] float32: at each row's
        argmax of the head its logit, -inf elsewhere; None for more than `max_rows` rows (MAX_ROWS),
        and where blocks.c leaves a row to the whole head (not finite, too many outputs left,
        subnormals flushed)."""
        if x.dim() != 2 or x.shape[1] != self._fan_in or x.dtype != self.blocked.dtype:
            raise ValueError(f"rows of {self._fan_in} {self.blocked.dtype}, not {list(x.shape)} {x.dtype}")
        rows = x.shape[0]
        if not 0 < rows <= self.max_rows:
            return None
        x = x.contiguous()
        screen = self.products(x.float() if self._bf16 else x)  # [R, out]: each row becomes its answer
        out, row_bytes = screen.shape[1], self._fan_in * x.element_size()
        shared = (self.blocked.data_ptr(), self.bounds.data_ptr(), self.vocab, self._fan_in, self._bf16)
        for r in range(rows):
            if self._argmax(x.data_ptr() + r * row_bytes, shared[0], screen.data_ptr() + r * out * 4, *shared[1:]) < 0:
                return None
        return screen[:, : self.vocab]

    def products(self, x: torch.Tensor) -> torch.Tensor:
        """Contiguous float32 rows x [R, in] times the codes, each output scaled: s [R, out]."""
        screen = torch.empty(x.shape[0], self.scales.shape[0])
        codes, scales, threads = self.codes.data_ptr(), self.scales.data_ptr(), torch.get_num_threads()
        if self._linear(
            x.data_ptr(), codes, scales, x.shape[0], screen.shape[1], self._fan_in, threads, screen.data_ptr()
        ):
            raise RuntimeError("the int8 block product was not built for this CPU")
        return screen


def _made(blocked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The screen of a head in a block layout (fma_blocks.layout): its int8 codes as blocks.c's int8
    product reads them, [out / 32, in, 32] with element (b, k, j) output 32b + j's code of input k
    (the float32 blocks' order, a byte each); their bfloat16 scales [out] (quantize.quantize_int8);
    each output's bound c_j (the module's doc), in float32 and raised by what float32's norms can
    err (a sum of `in` positive squares, a square root, a subtraction and the terms' sum: a relative
    (in + 2) u at most; raised by twice that). Made ROWS_AT_ONCE outputs at a time, so that making
    it holds little beyond what it keeps."""
    blocks, fan_in = blocked.shape[0], blocked.shape[1]
    order = (0, 2, 3, 1) if blocked.dtype == torch.float32 else (0, 3, 2, 1)  # to (b, h, i, k)
    n = fan_in + 16
    g, up = n * 2.0**-24 / (1 - n * 2.0**-24), 1 + 2 * (fan_in + 2) * 2.0**-24
    codes = torch.empty(blocks, fan_in, BLOCK, dtype=torch.int8)
    scales, bounds = torch.empty(blocks * BLOCK, dtype=torch.bfloat16), torch.empty(blocks * BLOCK)
    step = ROWS_AT_ONCE // BLOCK
    for b in range(0, blocks, step):
        w = blocked[b : b + step].permute(*order).reshape(-1, fan_in).float()  # [rows, in]
        part, part_scales = quantize_int8(w)
        codes[b : b + step] = part.view(-1, BLOCK, fan_in).transpose(1, 2)
        scales[b * BLOCK : (b + step) * BLOCK] = part_scales
        screened = part.float() * part_scales.float()[:, None]  # exact: a 7-bit code times an 8-bit scale
        error = (w - screened).norm(dim=1) + 2 * g * (w.norm(dim=1) + screened.norm(dim=1))
        bounds[b * BLOCK : (b + step) * BLOCK] = error * up
    return codes, scales, bounds
