"""`layerline plan`'s weights per rank are the bytes a loaded stage holds: the copies each weight
layout keeps (`--weight-layout both` keeps two layouts of every matrix where it pays), and the LM
head a tensor of its own even where the checkpoint ties it to the embedding."""

from __future__ import annotations

import json

import pytest
import torch

from layerline.plan.profile import MachineProfile, ProfileError
from layerline.plan.shapes import Placement, load_model_config, memory_per_rank
from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.stage_worker.layouts import can_pack, keeps_head_screen, weight_copies
from layerline.stage_worker.row_kernel import bf16_row_kernel
from layerline.stage_worker.tiles import blocks_pack
from layerline.stage_worker.weights import held_bytes, load_stage

from .test_plan import a_profile
from .tiny_models import make_tiny_checkpoint


# tied; tied with q/k/v biases; untied; a vocabulary of whole blocks of 32 (the head's screen where it serves)
@pytest.fixture(scope="module", params=["smollm2", "qwen2", "llama3", "smollm2-256"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    family, _, vocab = request.param.partition("-")
    make_tiny_checkpoint(family, out, num_layers=4, **({"vocab_size": int(vocab)} if vocab else {}))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["both", "packed", "plain"])
@pytest.mark.parametrize("span", [(0, 4), (0, 1), (1, 4)])
def test_the_planned_weights_are_what_a_loaded_stage_holds(checkpoint, dtype, layout, span) -> None:
    config = ModelConfig.from_checkpoint(checkpoint)
    stage = load_stage(checkpoint, LayerRange(*span), dtype=getattr(torch, dtype), weight_layout=layout)
    copies = weight_copies(layout, getattr(torch, dtype), "cpu", 1)
    place = Placement(*span, tp=1, first=span[0] == 0, last=span[1] == config.num_layers)
    screened = keeps_head_screen(getattr(torch, dtype)) and layout != "plain"  # the screen of a packed head
    planned = memory_per_rank(
        config, place, dtype, context=1, concurrency=1, runtime_bytes=0, copies=copies, screened=screened
    )
    assert planned.weights == held_bytes(stage)
    assert (stage.head_screen is not None) == (screened and place.last and config.vocab_size % 32 == 0)
    # Two copies exactly where `both` keeps a second layout on this machine, one everywhere else.
    second = layout == "both" and can_pack(getattr(torch, dtype), "cpu")
    second = second and not blocks_pack(getattr(torch, dtype))  # the blocks are the only copy
    second = second and (dtype == "float32" or bf16_row_kernel() is not None)
    assert copies == 1 + second


def test_smollm2_in_float32_under_both_by_hand() -> None:
    """The embedded model on one CPU stage: every matrix twice (the plain one beside oneDNN's), the
    head's two layouts besides the embedding it is tied to: what its stage reports, 1189 MB."""
    _, config = load_model_config("smollm2-135m-instruct")
    matrices = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536  # q and o; k and v; gate, up, down
    assert matrices == 3_538_944
    table = 49152 * 576
    params = 30 * (2 * matrices + 2 * 576) + table + 2 * table + 576  # the embedding, the head twice, the norm
    whole = Placement(0, 30, tp=1, first=True, last=True)
    both = memory_per_rank(config, whole, "float32", context=1, concurrency=1, runtime_bytes=0, copies=2)
    assert both.weights == 4 * params == 1_189_225_728
    one = memory_per_rank(config, whole, "float32", context=1, concurrency=1, runtime_bytes=0)
    assert one.weights == 4 * (30 * (matrices + 2 * 576) + 2 * table + 576) == 651_306_240
    # A rank of tp 3 under `packed`: what test_tensor_parallel.py's tp 3 cluster reports of its rank.
    third = Placement(0, 30, tp=3, first=True, last=True)
    packed = memory_per_rank(config, third, "float32", context=1, concurrency=1, runtime_bytes=0, copies=1)
    assert packed.weights == 54_298_944 * 4


def test_a_cpu_plan_counts_the_profiles_copies() -> None:
    from layerline.plan.predict import Layout, Workload, predict

    from .test_plan import machine

    _, config = load_model_config("smollm2-135m-instruct")
    work = Workload("float32", 64, 1, 16)
    layout = Layout(1, 1, 1, ((0, 30),))
    two = predict(config, layout, machine("cpu", profile=a_profile()), work).memory.weights
    one = a_profile(weight_copies={"float32": {"1": 1, "2": 1}})
    assert two == 1_189_225_728
    assert predict(config, layout, machine("cpu", profile=one), work).memory.weights == 651_306_240
    # A dtype the profile does not name keeps one copy (float16: nothing packs it on a CPU).
    assert a_profile().copies("float16", 1) == 1 and a_profile().copies("bfloat16", 2) == 1


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"float32": {"1": 3}}, "must be 1 or 2"),
        ({"float32": {"4": 1}}, '"1" and "2"'),
        ({"float32": 2}, '"1" and "2"'),
        ([], "must be a JSON object"),
        ({"float32": {"1": True}}, "must be 1 or 2"),
    ],
)
def test_a_profile_with_bad_copies_is_refused(bad, says) -> None:
    raw = json.loads(json.dumps(a_profile().__dict__))
    raw["weight_copies"] = bad
    with pytest.raises(ProfileError, match="weight_copies") as e:
        MachineProfile.from_dict(raw)
    assert says in str(e.value)
    raw.pop("weight_copies")
    # before the copies were counted; bfloat16 kept 1, then 2 on Intel without AMX; the loops' step
    # times; the layer stack's, before the head's screen was counted
    for old in (3, 4, 5, 6, 7):
        raw["version"] = old
        with pytest.raises(ProfileError, match=f"version {old}, this layerline reads 8: calibrate again"):
            MachineProfile.from_dict(raw)


@pytest.mark.parametrize("bad", [{"float32": 1}, {"float32": "yes"}, [True]])
def test_a_profile_with_bad_screens_is_refused(bad) -> None:
    raw = json.loads(json.dumps(a_profile().__dict__))
    raw["head_screen"] = bad
    with pytest.raises(ProfileError, match="head_screen must map each dtype to true or false"):
        MachineProfile.from_dict(raw)
