"""`layerline bench` records what it ran on (layerline/bench/machine.py): the CPU as /proc/cpuinfo
names it, its logical CPUs, the instruction sets the kernels depend on, and which kernels served."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from layerline.bench.machine import FLAGS, this_machine
from layerline.bench.run import BenchResult
from layerline.stage_worker.int4_rows import int4_row_kernel
from layerline.stage_worker.paged_attention import compiled_kernel
from layerline.stage_worker.row_kernel import bf16_row_kernel, int8_row_kernel, row_kernel
from layerline.stage_worker.sampler import argmax_kernel
from layerline.stage_worker.tiles import blocks_pack, tile_kernel

pytestmark = pytest.mark.timeout(120)


def test_the_bench_records_the_cpu_and_the_kernels_that_served():
    machine = this_machine()
    assert machine["cpus"] == os.cpu_count()
    info = Path("/proc/cpuinfo")
    if info.exists():
        lines = info.read_text().splitlines()
        named = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        flags = next(set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags"))
        assert machine["cpu"] == named[0]
        assert machine["flags"] == [flag for flag in FLAGS if flag in flags]
    f32, bf16 = torch.float32, torch.bfloat16
    assert machine["kernels"] == {
        "decode_attention": "compiled" if compiled_kernel() is not None else "torch",
        "float32_products": "fma_blocks" if blocks_pack(f32) else "onednn",
        "bfloat16_products": "amx_tiles" if tile_kernel() else "fma_blocks" if blocks_pack(bf16) else "onednn",
        "float32_row_products": "fma_blocks" if blocks_pack(f32) else "compiled" if row_kernel() else "torch",
        "bfloat16_row_products": "fma_blocks" if blocks_pack(bf16) else "compiled" if bf16_row_kernel() else "torch",
        "int8_row_products": "compiled" if int8_row_kernel() is not None else "torch",
        "int4_row_products": "compiled" if int4_row_kernel() is not None else "torch",
        "greedy_argmax": "compiled" if argmax_kernel() is not None else "torch",
    }
    result = BenchResult(model="m", dtype="bfloat16", threads=2, new_tokens=1, rounds=1, machine=machine)
    assert asdict(result)["machine"]["kernels"] == machine["kernels"]  # what --json writes


def test_the_cpu_is_read_from_cpuinfo_and_falls_back_to_the_platform(tmp_path, monkeypatch):
    import platform

    from layerline.shared import cpu

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu avx2 amx_tile\n\n"
        "processor\t: 1\n"
    )
    monkeypatch.setattr(cpu, "CPUINFO", info)
    assert cpu.cpu_name() == "Some CPU @ 2.0GHz" and cpu.cpu_flags() == {"fpu", "avx2", "amx_tile"}
    assert cpu.cpu_vendor() == "AuthenticAMD"
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "missing")
    assert cpu.cpu_name() == (platform.processor() or platform.machine()) and cpu.cpu_flags() == frozenset()
    assert cpu.cpu_vendor() == ""
