"""`layerline plan`: memory arithmetic by hand for published configurations, feasibility, how the
recommendation moves with the target and the links, the emitted command and files, the profile file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from layerline.cli import build_parser, main
from layerline.client import Client
from layerline.plan.emit import compose_text, k8s_text
from layerline.plan.hardware import LINKS, SpecError, parse_devices, parse_link, parse_links
from layerline.plan.predict import CostModel, Layout, Machine, Workload, predict
from layerline.plan.profile import MachineProfile, ProfileError
from layerline.plan.recommend import Target, make_plan
from layerline.plan.shapes import Placement, load_model_config, memory_per_rank

from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint

GB = 10**9


def machine(devices: str, links: str | None = None, profile: MachineProfile | None = None) -> Machine:
    nodes = parse_devices(devices)
    intra, inter = parse_links(links, nodes)
    return Machine(nodes[0].device, len(nodes), nodes[0].count, intra, inter, profile)


def a_profile(**changes: object) -> MachineProfile:
    """A made-up 4-core machine (the figures are round, not this machine's)."""
    rates = {"1": {"1": 4e9, "4": 16e9, "16": 50e9, "64": 80e9, "256": 100e9}}
    rates["4"] = {r: 3 * v for r, v in rates["1"].items()}
    profile = MachineProfile(
        cpu="test CPU",
        cores=4,
        memory_bytes=16 * 2**30,
        torch_version="2.13.0",
        bandwidth_bytes_s=8e9,
        matmul_flops={"float32": rates, "bfloat16": rates},
        small_matmul_flops={"float32": rates, "bfloat16": rates},
        layer_overhead_s={"float32": 150e-6, "bfloat16": 200e-6},
        stage_step_s={"float32": 300e-6, "bfloat16": 300e-6},
        step_overhead_s=2e-3,
        hop_s=0.5e-3,
        allreduce_s={"2": 80e-6, "3": 120e-6},
        allreduce_bytes_s={"2": 2e9, "3": 1e9},
        runtime_bytes=400 * 2**20,
        cluster_compute_factor=1.0,
        weight_copies={"float32": {"1": 2, "2": 2}, "bfloat16": {"1": 2, "2": 1}},
        head_screen={"float32": False, "bfloat16": False},
    )
    return replace(profile, **changes)  # type: ignore[arg-type]


# --- memory, by hand ----------------------------------------------------------------------------


def test_llama_2_70b_float16_on_two_80gb_devices_at_tp_2_by_hand() -> None:
    _, config = load_model_config("llama-2-70b")
    # One rank of tp 2 holds half the heads (32 of 64 query, 4 of 8 KV, 128 wide) and half the MLP:
    q = o = 8192 * 32 * 128  # 33,554,432 each
    k = v = 8192 * 4 * 128  # 4,194,304 each
    mlp = 3 * 8192 * (28672 // 2)  # gate, up, down: 352,321,536
    norms = 2 * 8192
    layer = q + k + v + o + mlp + norms
    assert layer == 427_835_392
    table = (32000 // 2) * 8192  # half the vocabulary rows of the embedding, and of the head
    params = 80 * layer + 2 * table + 8192  # and the final norm
    assert params == 34_488_983_552  # half of Llama-2-70B's 68.98 billion
    stage = Placement(0, 80, tp=2, first=True, last=True)
    memory = memory_per_rank(config, stage, "float16", context=4096, concurrency=8, runtime_bytes=2 * 2**30)
    assert memory.weights == 2 * params == 68_977_967_104
    # KV: per token and layer, K and V of 4 heads of 128 in float16; 4096 tokens of 8 sequences.
    assert memory.kv_cache == 80 * 2 * 4 * 128 * 2 * 4096 * 8 == 5_368_709_120
    plan = make_plan("llama-2-70b", config, machine("2xH100"), Workload("float16", 4096, 8, 512), Target())
    by_shape = {(p.layout.tp, p.layout.pp, p.layout.dp): p for p in plan.predictions}
    assert by_shape[(2, 1, 1)].fits and by_shape[(2, 1, 1)].memory.weights == memory.weights
    assert by_shape[(2, 1, 1)].memory.total < 80 * GB
    assert not by_shape[(1, 1, 1)].fits  # 138 GB of weights on one 80 GB device
    # Whole: 855,638,016 matmul parameters a layer and its two norms; both tables whole.
    assert by_shape[(1, 1, 1)].memory.weights == 2 * (80 * (855_638_016 + 2 * 8192) + 2 * 32000 * 8192 + 8192)


def test_llama_3_8b_bfloat16_by_hand() -> None:
    _, config = load_model_config("llama-3-8b")
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096  # q, o; k, v; MLP; norms
    params = 32 * layer + 2 * 128256 * 4096 + 4096  # untied embedding and head, final norm
    assert params == 8_030_261_248  # the published 8.03 billion
    stage = Placement(0, 32, tp=1, first=True, last=True)
    memory = memory_per_rank(config, stage, "bfloat16", context=8192, concurrency=1, runtime_bytes=0)
    assert memory.weights == 2 * params
    assert memory.kv_cache == 32 * 2 * 8 * 128 * 2 * 8192 == 1_073_741_824  # 128 KiB a token
    # Two stages split the layers and the tables: the first holds the embedding, the last the head.
    first = memory_per_rank(
        config, Placement(0, 16, 1, True, False), "bfloat16", context=1, concurrency=1, runtime_bytes=0
    )
    last = memory_per_rank(
        config, Placement(16, 32, 1, False, True), "bfloat16", context=1, concurrency=1, runtime_bytes=0
    )
    assert first.weights == 2 * (16 * layer + 128256 * 4096)
    assert last.weights == 2 * (16 * layer + 128256 * 4096 + 4096)


# --- feasibility and the choice ---------------------------------------------------------------


def test_a_layout_that_does_not_fit_is_marked_and_never_recommended() -> None:
    _, config = load_model_config("llama-2-70b")
    work = Workload("float16", 4096, 8, 512)
    alone = make_plan("llama-2-70b", config, machine("1xH100"), work, Target())
    assert [p.fits for p in alone.predictions] == [False]
    assert alone.recommended is None and "no layout fits" in alone.reason
    eight = make_plan("llama-2-70b", config, machine("8xL4"), work, Target(latency_ms=1.0))
    assert any(not p.fits for p in eight.predictions) and eight.recommended is not None
    assert eight.recommended.fits and "no layout meets the target" in eight.reason
    for p in eight.predictions:  # the fastest layouts do not fit: the one recommended is the best that does
        if p.decode_tok_s > eight.recommended.decode_tok_s:
            assert not p.fits


def test_one_device_that_fits_and_meets_the_target_is_not_distributed() -> None:
    _, config = load_model_config("llama-3-8b")
    plan = make_plan("llama-3-8b", config, machine("2xH100"), Workload("bfloat16", 4096, 8, 512), Target(latency_ms=50))
    assert plan.recommended is not None and plan.recommended.layout.ranks == 1
    assert plan.reason.startswith("do not distribute: it fits on one device")


def test_the_recommendation_follows_the_target() -> None:
    _, config = load_model_config("llama-3-8b")
    devices = machine("2xH100")
    work = Workload("bfloat16", 4096, 64, 512)
    free = make_plan("llama-3-8b", config, devices, work, Target())
    assert free.recommended is not None and free.recommended.layout.ranks == 1
    one = free.recommended
    two = {(p.layout.tp, p.layout.pp, p.layout.dp): p for p in free.predictions}
    # A latency between one device's and tp 2's: tp 2 reads half the weights a token.
    tight = (1000 / one.decode_tok_s + 1000 / two[(2, 1, 1)].decode_tok_s) / 2
    plan = make_plan("llama-3-8b", config, devices, work, Target(latency_ms=tight))
    assert plan.recommended is not None and plan.recommended.layout.tp == 2
    assert 1000 / plan.recommended.decode_tok_s <= tight
    # A throughput beyond one device's: two devices, as tp 2 or 2 replicas, whichever gives more.
    more = one.aggregate_tok_s * 1.3
    plan = make_plan("llama-3-8b", config, devices, work, Target(throughput_tok_s=more))
    assert plan.recommended is not None and plan.recommended.layout.ranks == 2
    assert plan.recommended.aggregate_tok_s >= more
    # And no layout reaches a throughput far beyond: the closest is recommended, saying so.
    plan = make_plan("llama-3-8b", config, devices, work, Target(throughput_tok_s=one.aggregate_tok_s * 100))
    assert plan.recommended is not None and "no layout meets the target" in plan.reason


def test_slow_links_between_devices_move_the_plan_from_tensor_to_pipeline_parallelism() -> None:
    _, config = load_model_config("llama-2-70b")
    work = Workload("float16", 4096, 1, 512)
    target = Target(latency_ms=40)
    fast = make_plan("llama-2-70b", config, machine("8xH100"), work, target)
    assert fast.recommended is not None and fast.recommended.layout.tp > 1 and fast.recommended.layout.pp == 1
    # A millisecond per message between devices: every layer's two all-reduces cost more than a hop.
    slow = make_plan("llama-2-70b", config, machine("8xH100", "1gbit:1ms"), work, target)
    assert slow.recommended is not None and slow.recommended.layout.tp == 1 and slow.recommended.layout.pp > 1
    assert "no layout meets the target" in slow.reason


def test_a_slower_link_between_hosts_slows_a_chain_across_them_and_nothing_else() -> None:
    _, config = load_model_config("smollm2-135m-instruct")
    work = Workload("float32", 256, 1, 64)
    two_stages = Layout(1, 2, 1, ((0, 19), (19, 30)))
    near = predict(config, two_stages, machine("cpu,cpu", "1gbit:1ms", a_profile()), work)
    far = predict(config, two_stages, machine("cpu,cpu", "1gbit:5ms", a_profile()), work)
    assert near.inter_node_hops == far.inter_node_hops == 2  # there, and the token back to the coordinator
    assert 1 / far.decode_tok_s - 1 / near.decode_tok_s == pytest.approx(2 * 4e-3)
    one = Layout(1, 1, 1, ((0, 30),))
    assert predict(config, one, machine("cpu,cpu", "1gbit:5ms", a_profile()), work).decode_tok_s == pytest.approx(
        predict(config, one, machine("cpu,cpu", "1gbit:1ms", a_profile()), work).decode_tok_s
    )


def test_local_stages_share_the_cores_and_a_prompt_chunk_takes_them() -> None:
    _, config = load_model_config("smollm2-135m-instruct")
    cpu = machine("cpu", profile=a_profile())
    work = Workload("float32", 512, 8, 300)
    one = predict(config, Layout(1, 1, 1, ((0, 30),)), cpu, work)
    tp3 = predict(config, Layout(3, 1, 1, ((0, 30),)), cpu, work)
    # A lone stream on one stage takes all 4 cores (3x one's rate here); tp 3's ranks one each, and all-reduce.
    assert one.decode_tok_s > tp3.decode_tok_s
    many = predict(config, Layout(1, 1, 6, ((0, 30),)), cpu, Workload("float32", 512, 64, 300))
    few = predict(config, Layout(1, 1, 2, ((0, 30),)), cpu, Workload("float32", 512, 64, 300))
    assert many.aggregate_tok_s < 3 * few.aggregate_tok_s  # 6 replicas on 4 cores: not 3 times 2


def test_local_chains_run_one_micro_batch_at_a_time_and_hosts_of_their_own_pipeline() -> None:
    """On one CPU host (`up`, --depth 1) a 2-stage chain's many streams go through both stages as
    one micro-batch on all the cores; on two hosts each stage takes one of two micro-batches."""

    _, config = load_model_config("smollm2-135m-instruct")
    work = Workload("float32", 512, 8, 300)
    layout = Layout(1, 2, 1, ((0, 17), (17, 30)))
    local = machine("cpu", profile=a_profile())
    cost = CostModel(config, local, work, layout)
    stages = layout.stages(config.num_layers)
    one_round = sum(cost.stage(s, 8, context=512, alone=True) for s in stages)
    one_round += cost.step_overhead() + cost.hop(crossing=False)
    assert predict(config, layout, local, work).aggregate_tok_s == pytest.approx(8 / one_round)
    hosts = machine("cpu,cpu", profile=a_profile())
    two = CostModel(config, hosts, work, layout)
    halves = [two.stage(s, 4, context=512, alone=False) for s in stages]
    pipelined = predict(config, layout, hosts, work).aggregate_tok_s
    assert pipelined <= 8 / (2 * max(halves)) and pipelined != pytest.approx(8 / one_round)


def test_matmul_rates_are_read_at_the_model_s_width() -> None:
    """The embedded model's width reads the small layers' rates, a wide model's the wide ones',
    and a width between them lies between them, in log space."""
    from layerline.plan.profile import SMALL_HIDDEN, WIDE_HIDDEN

    wide = a_profile().matmul_flops["float32"]
    small = {t: {r: v / 4 for r, v in by_rows.items()} for t, by_rows in wide.items()}
    profile = a_profile(small_matmul_flops={"float32": small})
    assert profile.matmul_rate("float32", 1, 1, hidden=SMALL_HIDDEN) == pytest.approx(1e9)
    assert profile.matmul_rate("float32", 1, 1, hidden=WIDE_HIDDEN) == pytest.approx(4e9)
    assert profile.matmul_rate("float32", 1, 1, hidden=8192) == pytest.approx(4e9)  # clamped
    between = int((SMALL_HIDDEN * WIDE_HIDDEN) ** 0.5)
    assert profile.matmul_rate("float32", 1, 1, hidden=between) == pytest.approx(2e9, rel=1e-3)


def test_a_dtype_the_profile_did_not_measure_is_named() -> None:
    """A CPU without bfloat16 instructions is calibrated in float32 only; planning bfloat16 on it says so."""
    from layerline.plan.profile import ProfileError

    _, config = load_model_config("smollm2-135m-instruct")
    rates = a_profile().matmul_flops["float32"]
    cpu = machine("cpu", profile=a_profile(matmul_flops={"float32": rates}))
    with pytest.raises(ProfileError, match=r"no matmul rates for dtype bfloat16 \(measured: float32; bfloat16 only"):
        predict(config, Layout(1, 1, 1, ((0, 30),)), cpu, Workload("bfloat16", 512, 1, 16))


# --- specs and errors ---------------------------------------------------------------------------


def test_specs_parse_and_bad_ones_name_the_flag() -> None:
    nodes = parse_devices("4xL4,4xL4")
    assert [(n.device, n.count) for n in nodes] == [("l4", 4), ("l4", 4)]
    assert parse_links(None, nodes) == (LINKS["pcie4"], LINKS["eth100"])
    link = parse_link("25gbit:50us")
    assert link.bytes_per_s == 25e9 / 8 and link.latency_s == pytest.approx(50e-6)
    with pytest.raises(SpecError, match=r"--devices .*unknown device 'B200'"):
        parse_devices("2xB200")
    with pytest.raises(SpecError, match=r"--devices .*same device"):
        parse_devices("2xH100,2xL4")
    with pytest.raises(SpecError, match=r"--links .*RATE:LATENCY"):
        parse_link("fast")


def test_cli_refuses_a_context_beyond_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-2-70b", "--devices", "2xH100", "--context", "9000"]) == 2
    assert "--context 9000 is longer than the model's max_position_embeddings = 4096" in capsys.readouterr().err


def test_cli_json_has_the_documented_shape(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama-2-70b", "--devices", "2xH100", "--dtype", "float16", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"tp", "pp", "dp", "layers", "memory_per_device_bytes", "decode_tok_s", "aggregate_tok_s", "ttft_ms", "fits"}
    assert keys <= set(out["layouts"][0]) and keys <= set(out["recommended"])
    assert (out["recommended"]["tp"], out["recommended"]["pp"]) == (2, 1) and out["reason"]


def test_a_bare_config_json_is_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "my-model" / "config.json"
    config.parent.mkdir()
    shutil.copy(Path(__file__).parents[1] / "layerline/plan/configs/llama-3-8b.json", config)
    assert main(["plan", "--model", str(config), "--devices", "1xH100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "my-model"


# --- the profile ---------------------------------------------------------------------------------


def test_the_profile_round_trips_and_a_bad_value_is_named(tmp_path: Path) -> None:
    profile = a_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert MachineProfile.load(path) == profile
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "hop_s": -1}))
    with pytest.raises(ProfileError, match=r"hop_s = -1 must be a positive number"):
        MachineProfile.load(path)
    path.write_text(json.dumps({**raw, "matmul_flops": {"float32": {"1": {"1": "fast"}}}}))
    with pytest.raises(ProfileError, match=r"matmul_flops\['float32'\]\['1'\]\['1'\]"):
        MachineProfile.load(path)
    with pytest.raises(ProfileError, match="run `layerline plan --calibrate`"):
        MachineProfile.load(tmp_path / "absent.json")
    path.write_text(json.dumps({**raw, "allreduce_bytes_s": {"2": 2e9}}))
    with pytest.raises(ProfileError, match="allreduce_s and allreduce_bytes_s must name the same tp sizes"):
        MachineProfile.load(path)
    path.write_text(json.dumps({**raw, "cluster_compute_factor": 0}))
    with pytest.raises(ProfileError, match="cluster_compute_factor = 0 must be a positive number"):
        MachineProfile.load(path)
    assert profile.matmul_rate("float32", 1, 8) == pytest.approx((16e9 * 50e9) ** 0.5)  # halfway in log rows
    assert profile.matmul_rate("float32", 2, 1) == pytest.approx(4e9 + (12e9 - 4e9) / 3)  # 2 of 1..4 threads


# --- what it emits ---------------------------------------------------------------------------------


def test_emitted_compose_and_manifests_are_valid_and_cover_every_layer(tmp_path: Path) -> None:
    layout = Layout(2, 2, 2, ((0, 41), (41, 80)))
    compose = compose_text("llama-2-70b", layout, dtype="float16", gpu=True, kv_bytes=3 * 2**30)
    (tmp_path / "compose.yaml").write_text(compose)
    checker = [str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec"]
    done = subprocess.run([*checker, str(tmp_path / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    services = yaml.safe_load(compose)["services"]
    stages = [s for name, s in services.items() if name.startswith("stage-")]
    assert len(stages) == 4
    parser = build_parser()
    ranges = sorted(parser.parse_args(["stage", *s["command"]]).layers for s in stages)
    assert all(parser.parse_args(["stage", *s["command"]]).device == "cuda" for s in stages)
    assert ranges == ["0:41", "0:41", "41:80", "41:80"]
    objects = list(yaml.safe_load_all(k8s_text("llama-2-70b", layout, dtype="float16", gpu=True, kv_bytes=3 * 2**30)))
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    sets = [o for o in objects if o["kind"] == "StatefulSet"]
    assert [s["spec"]["replicas"] for s in sets] == [2, 2]
    for s in sets:
        container = s["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        stage = parser.parse_args(["stage", *container["args"]])
        assert (stage.tp, stage.device, stage.kv_memory) == (2, "cuda", "3072M")


def test_an_emitted_distributed_up_command_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    one_thread = a_profile().matmul_flops["float32"]["1"]
    poor = {"1": one_thread, "4": {r: 1.2 * v for r, v in one_thread.items()}}
    a_profile(matmul_flops={"float32": poor, "bfloat16": poor}, small_matmul_flops={"float32": poor}).save(profile)
    # SmolLM2 on made-up 4 cores that one process's threads hardly share: tp 3 reads a third of the
    # weights a token in each of 3 processes, where one process on 4 threads is only 1.2x as fast.
    plan = ["plan", "--model", "smollm2-135m-instruct", "--profile", str(profile), "--target-latency", "50"]
    assert main([*plan, "--emit", "up"]) == 0
    command = capsys.readouterr().out.split()
    parsed = build_parser().parse_args(command[1:])
    assert parsed.split == "weights"  # as the plan split them
    assert (parsed.model, parsed.stages, parsed.tp, parsed.replicas, parsed.dtype) == (
        "smollm2-135m-instruct",
        1,
        3,
        1,
        "float32",
    )


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_emitted_up_command_parses_and_starts(
    real_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    make_tiny_checkpoint("smollm2", model, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, model / name)
    profile = tmp_path / "profile.json"
    a_profile().save(profile)
    args = ["plan", "--model", str(model), "--devices", "cpu", "--profile", str(profile), "--context", "128"]
    assert main([*args, "--emit", "up"]) == 0
    command = capsys.readouterr().out.split()
    assert command[:2] == ["layerline", "up"]
    parsed = build_parser().parse_args(command[1:])
    # A tiny model is all overhead: one process, not distributed.
    assert (parsed.model, parsed.stages, parsed.tp, parsed.replicas) == (str(model), 1, 1, 1)
    assert parsed.kv_memory == "16M"  # 8 sequences of 128 tokens need far less: the least it asks
    port = free_port()
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "layerline", *command[1:], "--port", str(port), "--kv-memory", "16M"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    try:
        deadline = time.monotonic() + 180
        while "layerline ready" not in out.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, out.read_text()[-3000:]
            time.sleep(0.2)
        assert "layerline ready" in out.read_text(), out.read_text()[-3000:]
        with Client(f"127.0.0.1:{port}") as client:
            status = client.cluster()
            assert len(status.chains) == parsed.replicas
            assert len(client.generate("Once upon a time", max_tokens=4, temperature=0.0).token_ids) >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, out.read_text()[-3000:]


# --- the measurements' own code, briefly -------------------------------------------------------------


def test_calibration_times_layerline_s_own_engine_and_gloo() -> None:
    from layerline.plan.calibrate import NARROW, _Engine, measure_allreduce

    engine = _Engine(NARROW, 2, "float32", 1)
    assert engine.params > 0 and 0 < engine.decode(4, 2) < 5 and 0 < engine.prefill(16, 1) < 5
    assert not engine.engine.cache.sequences()  # every timed sequence released
    token, bytes_s = measure_allreduce(2, ceiling_bytes_s=30e9)  # a memory's read speed on these machines
    assert 0 < token < 1 and 1e6 < bytes_s <= 30e9  # loopback moves more than 1 MB/s, and no faster than memory


def test_an_all_reduce_s_rate_beyond_a_token_is_held_to_the_ceiling_when_noise_hides_it() -> None:
    from layerline.plan.calibrate import ALLREDUCE_BYTES, ALLREDUCE_CHUNK_ROWS, beyond_rate

    extra = (ALLREDUCE_CHUNK_ROWS - 1) * ALLREDUCE_BYTES
    assert beyond_rate(1e-3, ceiling_bytes_s=30e9) == extra / 1e-3
    # The chunk added no more than the token (once: 1e-6 s floor, 1.03e12 B/s): the ceiling, not a terabyte a second.
    for beyond in (1e-9, 0.0, -2e-4):
        assert beyond_rate(beyond, ceiling_bytes_s=30e9) == pytest.approx(30e9, rel=1e-12)


def test_an_all_reduce_costs_a_token_s_time_and_its_bytes_beyond() -> None:
    """A prompt chunk's all-reduces carry all its rows: tp 3's first token of a long prompt was
    predicted at 0.6-0.7x its time when every all-reduce cost one token's."""
    profile = a_profile()
    assert profile.allreduce(1, 10**9) == 0.0
    assert profile.allreduce(2) == profile.allreduce(2, 16384) == pytest.approx(80e-6)
    assert profile.allreduce(2, 16384 + 2 * 10**6) == pytest.approx(80e-6 + 1e-3)  # 2 MB more at 2 GB/s
    assert profile.allreduce(5, 16384 + 10**6) == pytest.approx(2 * (120e-6 + 1e-3))  # a ring twice tp 3's
    _, config = load_model_config("smollm2-135m-instruct")
    cpu = machine("cpu", profile=profile)
    work = Workload("float32", 512, 8, 512)
    tp3 = CostModel(config, cpu, work, Layout(3, 1, 1, ((0, 30),)))
    (stage,) = Layout(3, 1, 1, ((0, 30),)).stages(30)
    slower = CostModel(
        config, machine("cpu", profile=replace(profile, allreduce_bytes_s={"2": 2e9, "3": 0.5e9})), work, tp3.layout
    )
    chunk = 512 * 576 * 4  # the all-reduced bytes of a 512-token prompt chunk, each of 61 all-reduces
    added = 61 * (chunk - 16384) * (1 / 0.5e9 - 1 / 1e9)
    assert slower.stage(stage, 512, context=512, prefill=True, alone=True) - tp3.stage(
        stage, 512, context=512, prefill=True, alone=True
    ) == pytest.approx(added)
    assert slower.stage(stage, 1, context=512, alone=True) == tp3.stage(stage, 1, context=512, alone=True)


def test_a_stage_s_compute_is_scaled_by_the_cluster_s_measured_factor() -> None:
    _, config = load_model_config("smollm2-135m-instruct")
    work = Workload("float32", 512, 8, 300)
    layout = Layout(1, 2, 1, ((0, 18), (18, 30)))
    stages = layout.stages(30)
    plain = CostModel(config, machine("cpu", profile=a_profile()), work, layout)
    slow = CostModel(config, machine("cpu", profile=a_profile(cluster_compute_factor=1.25)), work, layout)
    for stage in stages:
        for rows in (1, 8, 300):
            assert slow.stage(stage, rows, context=64) == pytest.approx(1.25 * plain.stage(stage, rows, context=64))


def test_the_model_s_thread_rules_are_the_engine_s() -> None:
    # The engine: a step alone on its chain takes prefill_threads, any other max_threads, whatever
    # its size (tests/test_engine.py). The model: the chain's share alone, the stage's otherwise.

    _, config = load_model_config("smollm2-135m-instruct")
    work = Workload("float32", 256, 1, 64)
    cost = CostModel(config, machine("cpu", profile=a_profile()), work, Layout(1, 2, 1, ((0, 19), (19, 30))))
    assert (cost.cpu_threads(alone=True), cost.cpu_threads(alone=False)) == (4, 2)  # 4 cores, 2 stages


def test_the_check_predicts_every_layout_it_measures(real_model_dir: Path) -> None:
    from layerline.plan.check import CHECKED, FIGURES, Row, predictions
    from layerline.shared.model_config import ModelConfig

    config = ModelConfig.from_checkpoint(real_model_dir)
    predicted = predictions(config, a_profile(), real_model_dir, new_tokens=16, concurrency=4, dtype="float32")
    assert set(predicted) == set(CHECKED)
    assert all(predicted[name][f] > 0 for name in CHECKED for f in FIGURES)
    assert Row("1 stage", "ttft_ms", predicted=100.0, measured=80.0).within
    assert not Row("1 stage", "ttft_ms", predicted=100.0, measured=79.0).within  # 21 over 79 is 26.6%


def test_the_check_s_link_rows_are_two_hosts_sharing_this_machine_s_cores(real_model_dir: Path) -> None:
    """The link rows predict the lab as it is: two namespaces of this machine (its cores shared,
    each stage on its share), a 1 Gbit/s link whose delay each token crosses twice."""
    from layerline.plan import check_links
    from layerline.plan.check import FIGURES, predictions
    from layerline.shared.model_config import ModelConfig

    config = ModelConfig.from_checkpoint(real_model_dir)
    profile = a_profile()
    lab = check_links.lab_machine(profile, 5.0)
    assert (lab.nodes, lab.core_hosts, lab.inter.latency_s, lab.inter.bytes_per_s) == (2, 1, 0.005, 1.25e8)
    layout = Layout(1, 2, 1, check_links.split(config, profile))
    cost = CostModel(config, lab, Workload("float32", 64, 8, 16), layout)
    assert (cost.threads, cost.prefill_threads) == (profile.cores // 2, profile.cores)  # as the lab's stages run
    across = check_links.link_predictions(
        config, profile, short=16, long=300, new_tokens=16, concurrency=4, dtype="float32"
    )
    local = predictions(config, profile, real_model_dir, new_tokens=16, concurrency=4, dtype="float32")["2 stages"]
    one, five = across["2 stages, 1 ms link"], across["2 stages, 5 ms link"]
    assert set(one) == set(five) == set(FIGURES)
    # A lone stream pays each extra ms of delay twice a token.
    gap = 1 / five["decode_tok_s"] - 1 / one["decode_tok_s"]
    assert gap == pytest.approx(2 * 0.004, rel=1e-6)
    assert local["decode_tok_s"] > one["decode_tok_s"] > five["decode_tok_s"]


def test_tensor_parallel_ranks_beyond_the_cores_take_waves() -> None:
    """Ranks meet at every all-reduce: with more threads than cores the last computes after the
    others (3 ranks on 2 cores take twice a rank's time, not the 1.5x of sharing them evenly)."""
    from layerline.plan.predict import waves

    assert [waves(t, 2) for t in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    _, config = load_model_config("smollm2-135m-instruct")
    work, layout = Workload("float32", 512, 1, 64), Layout(3, 1, 1, ((0, 30),))
    (stage,) = layout.stages(30)
    quiet = {"allreduce_s": {"2": 1e-12, "3": 1e-12}, "allreduce_bytes_s": {"2": 1e30, "3": 1e30}}
    on = {
        cores: CostModel(config, machine("cpu", profile=a_profile(cores=cores, **quiet)), work, layout)
        for cores in (2, 4)
    }
    assert on[2].threads == on[4].threads == 1  # a thread a rank either way
    # The same rank's work: on 4 cores all three at once, on 2 in two waves (even sharing: 1.5x).
    ratio = on[2].stage(stage, 1, context=64, alone=True) / on[4].stage(stage, 1, context=64, alone=True)
    assert ratio == pytest.approx(2.0)
