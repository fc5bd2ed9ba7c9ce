"""What `layerline bench` ran on: the CPU and which of layerline's kernels served there.

The figures differ from machine to machine (bfloat16 instructions or not, AMX or not), so a run
records the CPU's model, its logical CPUs, the instruction sets the kernels depend on, and which
way the stages computed: the compiled decode attention or torch's operations, bfloat16 products
on AMX tiles (stage_worker/tiles.py) or oneDNN's, a lone float32, bfloat16 or int8 row's products
through the compiled kernels (stage_worker/row_kernel.py) or torch's, an int4 layer's few rows
(stage_worker/int4_rows.py) through the compiled kernels or torch's, float32 and bfloat16
products on FMAs in blocks (stage_worker/fma_blocks.py: every row count, a lone row too), and
greedy rows' argmax through the compiled kernel (kernels/argmax.c) or torch's reductions. The
stages decide the same way, in the same environment and kernel cache, on the same machine. Reads
/proc/cpuinfo where there is one.
"""

from __future__ import annotations

import os

from layerline.shared.cpu import cpu_flags, cpu_name

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # what the kernels' speed depends on


def this_machine() -> dict[str, object]:
    """{"cpu": model name, "cpus": logical CPUs, "flags": those of FLAGS it has, "kernels": {...}}."""
    import torch

    from layerline.stage_worker.int4_rows import int4_row_kernel
    from layerline.stage_worker.paged_attention import compiled_kernel
    from layerline.stage_worker.row_kernel import bf16_row_kernel, int8_row_kernel, row_kernel
    from layerline.stage_worker.sampler import argmax_kernel
    from layerline.stage_worker.tiles import blocks_pack, tile_kernel

    flags, f32, bf16 = cpu_flags(), torch.float32, torch.bfloat16
    bf16_rows = "fma_blocks" if blocks_pack(bf16) else "compiled" if bf16_row_kernel() else "torch"
    return {
        "cpu": cpu_name(),
        "cpus": os.cpu_count() or 1,
        "flags": [flag for flag in FLAGS if flag in flags],
        "kernels": {
            "decode_attention": "compiled" if compiled_kernel() is not None else "torch",
            "float32_products": "fma_blocks" if blocks_pack(f32) else "onednn",
            "bfloat16_products": "amx_tiles" if tile_kernel() else "fma_blocks" if blocks_pack(bf16) else "onednn",
            "float32_row_products": "fma_blocks" if blocks_pack(f32) else "compiled" if row_kernel() else "torch",
            "bfloat16_row_products": bf16_rows,
            "int8_row_products": "compiled" if int8_row_kernel() is not None else "torch",
            "int4_row_products": "compiled" if int4_row_kernel() is not None else "torch",
            "greedy_argmax": "compiled" if argmax_kernel() is not None else "torch",
        },
    }
