"""The compiled row kernels chosen for one test: shared by the tests of each kernel's products."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from layerline.shared import cpu as shared_cpu
from layerline.stage_worker import fma_blocks, native, row_kernel, tiles
from layerline.stage_worker.llama import StageModel

from .pipeline import LocalPipeline
from .test_quantize import _dequantized_oracle


def chosen(
    monkeypatch: pytest.MonkeyPatch, chooser: Callable[[], native.PagedAttentionKernel | None], why_not: str
) -> Iterator[native.PagedAttentionKernel]:
    """The library `chooser` (one of row_kernel's cached choosers) picks under
    LAYERLINE_ROW_PRODUCTS=kernel, for one test (skipped with `why_not` where it picks none);
    afterwards its choice is forgotten and torch's thread count restored."""
    threads = torch.get_num_threads()
    monkeypatch.setenv(row_kernel.ENV, "kernel")
    chooser.cache_clear()  # type: ignore[attr-defined]
    kernel = chooser()
    if kernel is None:
        pytest.skip(why_not)
    yield kernel
    chooser.cache_clear()  # type: ignore[attr-defined]
    torch.set_num_threads(threads)


def block_dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.dtype]:
    """A fixture's body: its param's dtype where the block kernel of that dtype builds here and
    packs its weights (not bfloat16 where the AMX tiles take it), chosen for this test only."""

    def choose():
        return fma_blocks.block_kernel(request.param)

    choose.cache_clear = fma_blocks.block_kernel.cache_clear  # type: ignore[attr-defined]
    for _ in chosen(monkeypatch, choose, "no block kernel with AVX-512 here"):
        if not tiles.blocks_pack(request.param):
            pytest.skip(f"the AMX tiles take {request.param} here")
        yield request.param


CPUINFO = {  # /proc/cpuinfo of one CPU of each vendor the rule tells apart
    "intel": "processor\t: 0\nvendor_id\t: GenuineIntel\n\n",
    "intel_amx": "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n\n",
    "amd": "processor\t: 0\nvendor_id\t: AuthenticAMD\n\n",
    "other": "processor\t: 0\n\n",  # no vendor named (not x86)
}


def assert_rule(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    chooser: Callable[[], native.PagedAttentionKernel | None],
    cases: list[tuple[str, str, bool]],
) -> None:
    """`chooser` picks its kernel, or not, as each (CPUINFO name, LAYERLINE_ROW_PRODUCTS, serves)
    case says; its choice forgotten afterwards."""
    for name, text in CPUINFO.items():
        (tmp_path / name).write_text(text)
    try:
        for cpu, choice, serves in cases:
            monkeypatch.setattr(shared_cpu, "CPUINFO", tmp_path / cpu)
            monkeypatch.setenv(row_kernel.ENV, choice)
            chooser.cache_clear()  # type: ignore[attr-defined]
            assert (chooser() is not None) == serves, (cpu, choice)
    finally:
        chooser.cache_clear()  # type: ignore[attr-defined]


def assert_dequantized_logits(stage: StageModel, hf: torch.nn.Module, batch: dict[str, list[int]]) -> None:
    """A lone token a step through a whole quantized `stage`, then a step of one token for each of
    `batch`'s sequences (prefilled first): each step's logits those of transformers `hf` holding the
    weights the stage's layers stand for (`_dequantized_oracle`), to 1e-4 of the largest."""
    oracle = _dequantized_oracle(hf, stage)
    ids = [1, 17, 42, 99, 3]
    pipeline = LocalPipeline([stage])
    pipeline.step({"s": ids[:1]})
    for n in range(2, len(ids) + 1):
        got = pipeline.step({"s": [ids[n - 1]]})[0]  # a step of one token: the row path
        with torch.no_grad():
            want = oracle(torch.tensor([ids[:n]])).logits[0, -1].float()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    pipeline.step(batch)
    got = pipeline.step({name: [11] for name in batch})
    with torch.no_grad():
        want = torch.stack([oracle(torch.tensor([[*p, 11]])).logits[0, -1].float() for p in batch.values()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
