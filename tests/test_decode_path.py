"""A decode batch's step over plain tensors (stage_worker/decode_path.py): the modules' numbers to
the bit (logits, hidden states handed on, the KV written), on a first, a last and a whole stage,
with and without biases; and the modules wherever it does not serve."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import decode_path
from layerline.stage_worker.layouts import can_pack
from layerline.stage_worker.weights import load_stage

from .pipeline import cache_for
from .tiny_models import make_tiny_checkpoint

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"),
]
PROMPTS = [[1, 17, 42, 99, 3, 5, 8, 13, 21], [1, 7, 7, 200], [9, 4]]  # three sequences, three lengths


def steps_both_ways(stages, monkeypatch) -> tuple[int, list[list[int]]]:
    """Prefill PROMPTS, then 5 decode steps of all three, through `stages` in order, each step twice
    (the decode path on, and off: the modules) on caches of their own; every output and every pool
    equal to the bit. Returns how many stage steps the decode path served, and the greedy tokens."""
    served = []
    real = decode_path.DecodePath.__call__

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(decode_path.DecodePath, "__call__", counted)
    paths = [stage.decode_path for stage in stages]
    caches = {way: [cache_for(stage) for stage in stages] for way in ("path", "modules")}
    names = [f"s{i}" for i in range(len(PROMPTS))]
    new, tokens = [list(p) for p in PROMPTS], []
    for _ in range(6):
        outs = {}
        for way, way_caches in caches.items():
            x = torch.tensor([t for ids in new for t in ids])
            for stage, cache, path in zip(stages, way_caches, paths, strict=True):
                stage.decode_path = path if way == "path" else None
                for name, ids in zip(names, new, strict=True):
                    cache.reserve(name, len(ids))
                layout = cache.plan_step(names, [len(ids) for ids in new])
                with torch.no_grad():
                    x = stage(x, cache=cache, layout=layout, logit_rows=layout.last_rows())
                if stage is not stages[-1]:
                    outs.setdefault(way, []).append(x)
            outs.setdefault(way, []).append(x)
        for got, want in zip(outs["path"], outs["modules"], strict=True):
            assert torch.equal(got, want), (got - want).abs().max()
        new = [[int(row.argmax())] for row in outs["path"][-1]]
        tokens.append([ids[0] for ids in new])
    for stage, path in zip(stages, paths, strict=True):
        stage.decode_path = path
    for mine, theirs in zip(caches["path"], caches["modules"], strict=True):
        for i in mine.k:
            assert torch.equal(mine.k[i], theirs.k[i]) and torch.equal(mine.v[i], theirs.v[i])
    return sum(served), tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["smollm2", "llama2"])
def test_a_decode_batch_off_the_modules_gives_their_numbers_to_the_bit(tmp_path, monkeypatch, dtype, family):
    make_tiny_checkpoint(family, tmp_path, intermediate_size=128)  # SiLU's kernel takes widths of 32 lanes
    whole = [load_stage(tmp_path, LayerRange(0, 4), dtype=dtype)]
    split = [load_stage(tmp_path, LayerRange(0, 2), dtype=dtype), load_stage(tmp_path, LayerRange(2, 4), dtype=dtype)]
    for stages in (whole, split):
        for stage in stages:
            stage.set_threads(2)
        served, tokens = steps_both_ways(stages, monkeypatch)
        # Five decode steps on each stage, where every linear layer is packed (bfloat16 only on a
        # CPU with bfloat16 instructions; elsewhere the modules run and the path declines).
        assert served == (5 * len(stages) if can_pack(dtype, "cpu") else 0)
        assert len(tokens) == 6 and all(0 <= t < 211 for step in tokens for t in step)


def test_the_decode_path_is_only_where_the_weights_are_packed_and_declines_a_width_its_kernel_does_not_take(
    tmp_path, monkeypatch
):
    make_tiny_checkpoint("smollm2", tmp_path, intermediate_size=128)
    assert load_stage(tmp_path, LayerRange(0, 4), weight_layout="plain").decode_path is None
    assert load_stage(tmp_path, LayerRange(0, 4), quantize="int8").decode_path is None
    odd = tmp_path / "odd"
    make_tiny_checkpoint("smollm2", odd, intermediate_size=104)  # SiLU halves of 104: torch's kernels
    stage = load_stage(odd, LayerRange(0, 4))
    assert stage.decode_path is not None
    served, _ = steps_both_ways([stage], monkeypatch)
    assert served == 0
