"""A product by one weight laid out for a compiled kernel, its checks made once (tiles.py's AMX
tiles, fma_blocks.py's FMA blocks).

Owns `LaidOut`: the kernel's function of (x, w, b, rows, out, in, threads, y) -> status, the weight
in that kernel's layout, its bias, and what a call checks of its rows. Knows nothing of the layouts
themselves: each kernel's module checks its weight before it makes one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class LaidOut:
    """x W^T + b for rows x [..., in] of `dtype` on the CPU, by `weight` (laid out for `fn`, the
    kernel's function, from the library at `path`) and `bias` ([out] or None, checked here): a call
    checks only its rows. It holds the tensors and reads their addresses at each call (a tensor's
    storage can be swapped). `name` names the layout in errors; `failure(rows)` is raised where
    the kernel says it could not multiply them."""

    def __init__(
        self,
        fn: Callable[..., Any],
        path: object,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        out: int,
        fan_in: int,
        dtype: torch.dtype,
        name: str,
        failure: Callable[[int], Exception],
    ) -> None:
        kind = str(dtype).removeprefix("torch.")
        if bias is not None and not (bias.shape == (out,) and bias.dtype == dtype and bias.is_contiguous()):
            raise ValueError(f"a bias of {out} contiguous {kind} for these {name}, not {list(bias.shape)} {bias.dtype}")
        if bias is not None and bias.device.type != "cpu":
            raise ValueError(f"a bias on the CPU for these {name}")
        self._fn, self._path, self._failure, self._name, self._kind = fn, path, failure, name, kind
        self._weight, self._bias, self._out, self._in, self._dtype = weight, bias, out, fan_in, dtype

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        """What a call hands the kernel besides the rows: the laid-out weight, the bias, out and in."""
        return self._weight, self._bias, self._out, self._in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A step's rows are [rows, in] and contiguous already: as they are, a call checks four things.
        if x.dim() == 2 and x.dtype == self._dtype and x.shape[1] == self._in and x.is_cpu:
            rows = x if x.is_contiguous() and not x.is_neg() else x.resolve_neg().contiguous()
            n = rows.shape[0]
            y = torch.empty(n, self._out, dtype=self._dtype)  # no gradient kept, as oneDNN's
            w, b = self._weight.data_ptr(), None if self._bias is None else self._bias.data_ptr()
            if n and self._fn(rows.data_ptr(), w, b, n, self._out, self._in, torch.get_num_threads(), y.data_ptr()):
                raise self._failure(n)
            return y
        if x.dim() == 0 or x.shape[-1] != self._in or x.dtype != self._dtype or x.device.type != "cpu":
            shape = list(self._weight.shape)
            raise ValueError(
                f"rows {list(x.shape)} {x.dtype} for {self._name} {shape}: in {self._in}, {self._kind}, CPU"
            )
        return self(x.reshape(-1, self._in)).view(*x.shape[:-1], self._out)
