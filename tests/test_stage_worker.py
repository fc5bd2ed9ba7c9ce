"""Stage workers as real processes on 127.0.0.1: a two-stage chain, chunking, bad frames, KV."""

from __future__ import annotations

import math
from collections.abc import Iterable

import grpc
import pytest
import torch

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from layerline.shared.model_config import LayerRange
from layerline.stage_worker.codec import chunk
from layerline.stage_worker.settings import openmp_defaults
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline
from .stage_client import StageProcess, StepStream, seq_input
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.cluster  # every test here starts processes

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
MAX_MESSAGE = 4096  # small, so that prefill hidden states must travel in chunks
HIDDEN = 48

PROMPTS = {
    "s1": [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55, 89, 144, 7, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    "s2": [1, 7, 7, 7, 200],
    "s3": [1, 150, 2, 60, 61, 62, 63, 64, 65, 66, 67],
    "s4": [9],
}


class ModelStream(StepStream):
    """A Step stream whose headers name the stage's model: a stage refuses a header naming none."""

    def __init__(self, stage: StageProcess) -> None:
        super().__init__(stage.channel)
        self.model_id = stage.info().model_id

    def send(self, frames: Iterable[stage_pb2.StepFrame]) -> None:
        frames = list(frames)
        for frame in frames:
            if frame.HasField("header") and not frame.header.model_id:
                frame.header.model_id = self.model_id
        super().send(frames)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("stage-ckpt")
    make_tiny_checkpoint("smollm2", path)
    return path


@pytest.fixture(scope="module")
def chain(ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("stage-logs")
    last = StageProcess(ckpt, "2:4", "--max-message-size", str(MAX_MESSAGE), log_dir=logs)
    first = StageProcess(ckpt, "0:2", "--max-message-size", str(MAX_MESSAGE), log_dir=logs)
    try:
        first.wait_serving()
        last.wait_serving()
        yield first, last
    finally:
        codes = first.stop(), last.stop()
    assert codes == (0, 0), (first.log(), last.log())  # SIGTERM stops a stage cleanly


@pytest.fixture(scope="module")
def oracle(ckpt):
    return LocalPipeline([load_stage(ckpt, LayerRange(0, 4))]).greedy(PROMPTS, 16)


def test_info_describes_each_stage(chain):
    first, last = chain
    a, b = first.info(), last.info()
    assert (a.layer_start, a.layer_end, b.layer_start, b.layer_end, a.num_layers) == (0, 2, 2, 4, 4)
    assert a.model_id == b.model_id and len(a.model_id) == 16
    assert a.address == first.address and a.pid == first.proc.pid
    assert a.dtype == tensor_pb2.FLOAT32 and a.device == "cpu" and a.tp_size == 1
    assert a.kv_blocks_free == a.kv_blocks_total > 0
    assert a.state == b.state == common_pb2.WORKER_STATE_SERVING


def test_a_second_stage_on_a_port_in_use_exits_naming_it(chain, ckpt, tmp_path):
    """gRPC would share the port (SO_REUSEPORT) and split its connections; the stage refuses."""
    first, _ = chain
    second = StageProcess(ckpt, "0:2", "--port", str(first.port), log_dir=tmp_path)
    try:
        assert second.proc.wait(timeout=60) == 2
    finally:
        second.stop()
    assert f"error: cannot listen on 127.0.0.1:{first.port}: the port is in use" in second.log()
    assert first.info().state == common_pb2.WORKER_STATE_SERVING and first.proc.poll() is None


def test_two_stage_chain_matches_greedy_oracle_with_mixed_batches(chain, oracle):
    """4 prompts of different lengths: chunked prefills mixed with decodes, one stream."""
    first, last = chain
    before = [stage.info() for stage in chain]
    stream = ModelStream(first)
    got = {s: [] for s in PROMPTS}
    fed = {s: 0 for s in PROMPTS}  # prompt tokens sent so far
    steps = 0
    try:
        for _ in range(40):
            seqs = []
            for sid, prompt in PROMPTS.items():
                if len(got[sid]) == 16:
                    continue
                if fed[sid] < len(prompt):  # prompt chunks of at most 7 tokens
                    n = min(7, len(prompt) - fed[sid])
                    seqs.append(
                        seq_input(
                            sid,
                            range(fed[sid], fed[sid] + n),
                            prompt[fed[sid] : fed[sid] + n],
                            sample=fed[sid] + n == len(prompt),
                        )
                    )
                    fed[sid] += n
                else:
                    pos = len(prompt) + len(got[sid]) - 1
                    seqs.append(seq_input(sid, [pos], [got[sid][-1]]))
            if not seqs:
                break
            result = stream.step(seqs, route=[last.address])
            steps += 1
            assert not result.error.code, result.error.message
            for r in result.sequences:
                assert not r.error.code, r.error.message
                if r.HasField("sampled_token_id"):
                    got[r.sequence_id].append(r.sampled_token_id)
    finally:
        stream.close()
    assert got == oracle
    # Each stage counted every step of the chain as computed once, and the time it took.
    after = [stage.info() for stage in chain]
    assert [a.steps_computed - b.steps_computed for a, b in zip(after, before)] == [steps, steps]
    assert all(a.compute_seconds > b.compute_seconds for a, b in zip(after, before))
    release = stage_pb2.ReleaseRequest(sequence_ids=list(PROMPTS))
    for stage in chain:
        assert stage_pb2_grpc.StageWorkerStub(stage.channel).Release(release).released == 4
        info = stage.info()
        assert info.kv_blocks_free == info.kv_blocks_total


def test_releases_ride_a_step_down_the_whole_route_before_its_work(chain, oracle):
    """The coordinator's evictions from its prefix cache travel in the next step's header."""
    first, last = chain
    free = [stage.info().kv_blocks_free for stage in chain]
    stream = ModelStream(first)
    try:
        kept = stream.step([seq_input("kept", range(len(PROMPTS["s2"])), PROMPTS["s2"])], route=[last.address])
        held = [stage.info().kv_blocks_free for stage in chain]
        assert all(h < f for h, f in zip(held, free))
        # A new sequence, with "kept" freed on each stage just before it: the blocks are reused.
        new = stream.step(
            [seq_input("new", range(len(PROMPTS["s2"])), PROMPTS["s2"])], route=[last.address], release=["kept"]
        )
    finally:
        stream.close()
    assert kept.sequences[0].sampled_token_id == new.sequences[0].sampled_token_id == oracle["s2"][0]
    assert [stage.info().kv_blocks_free for stage in chain] == held  # "new" holds what "kept" held
    release = stage_pb2.ReleaseRequest(sequence_ids=["kept", "new"])
    assert [stage_pb2_grpc.StageWorkerStub(s.channel).Release(release).released for s in chain] == [1, 1]
    assert [stage.info().kv_blocks_free for stage in chain] == free


def test_hidden_states_larger_than_a_message_arrive_in_chunks(chain, ckpt, oracle):
    """Send the last stage a prefill's hidden states directly, cut into many small chunks."""
    _, last = chain
    first_half = load_stage(ckpt, LayerRange(0, 2))
    prompt = PROMPTS["s1"]
    hidden = LocalPipeline([first_half]).step({"c": prompt}, all_logits=True)  # [24, 48]
    nbytes = hidden.numel() * 4
    assert nbytes > MAX_MESSAGE  # one message could not carry it
    stream = ModelStream(last)
    try:
        result = stream.step([seq_input("chunked", range(len(prompt)))], hidden=hidden, chunk_bytes=1000)
    finally:
        stream.close()
    assert math.ceil(nbytes / 1000) == 5
    assert result.sequences[0].sampled_token_id == oracle["s1"][0]
    stage_pb2_grpc.StageWorkerStub(last.channel).Release(stage_pb2.ReleaseRequest(sequence_ids=["chunked"]))


def test_hidden_states_in_the_header_are_one_message_and_must_be_whole(chain, ckpt):
    """A step whose hidden states fit in one chunk travels as a single frame; a part is refused."""
    first, last = chain
    prompt = PROMPTS["s1"]
    hidden = LocalPipeline([load_stage(ckpt, LayerRange(0, 2))]).step({"h": prompt[:10]}, all_logits=True)
    (whole,) = chunk(hidden, hidden.numel() * 4)  # 10 x 48 float32: 1920 bytes, under one message
    header = stage_pb2.StepHeader(step_id=5, sequences=[seq_input("h", range(10))], hidden=whole)
    stream = ModelStream(last)
    try:
        stream.send([stage_pb2.StepFrame(header=header)])
        whole_model = LocalPipeline([load_stage(ckpt, LayerRange(0, 4))])
        assert stream.receive().sequences[0].sampled_token_id == whole_model.greedy({"h": prompt[:10]}, 1)["h"][0]
        part = next(chunk(hidden, 256))
        header = stage_pb2.StepHeader(step_id=6, sequences=[seq_input("p", range(10))], hidden=part)
        stream.send([stage_pb2.StepFrame(header=header)])
        result = stream.receive()
        assert (result.step_id, result.error.code) == (6, INVALID)
        assert f"header.hidden holds 256 of the tensor's {hidden.numel() * 4} bytes" in result.error.message
    finally:
        stream.close()
    stream = ModelStream(first)
    try:  # the first stage embeds token ids: hidden states are refused there
        header = stage_pb2.StepHeader(
            step_id=7,
            sequences=[seq_input("f", [0], [1])],
            route=[last.address],
            hidden=next(chunk(torch.zeros(1, HIDDEN), 1 << 20)),
        )
        stream.send([stage_pb2.StepFrame(header=header)])
        result = stream.receive()
        assert (result.step_id, result.error.code) == (7, INVALID)
        assert "the first stage takes token ids, not hidden states" in result.error.message
    finally:
        stream.close()
    stage_pb2_grpc.StageWorkerStub(last.channel).Release(stage_pb2.ReleaseRequest(sequence_ids=["h"]))


def _frame(**chunk_fields) -> list[stage_pb2.StepFrame]:
    header = stage_pb2.StepHeader(step_id=77, sequences=[seq_input("m", [0, 1])])
    return [
        stage_pb2.StepFrame(header=header),
        stage_pb2.StepFrame(hidden_chunk=tensor_pb2.TensorChunk(**chunk_fields)),
    ]


MALFORMED = {  # name -> (chunk fields, status, words of the message)
    "shape and byte length disagree": (
        dict(dtype=tensor_pb2.FLOAT32, shape=[2, HIDDEN], total_bytes=100, data=b"\0" * 100),
        INVALID,
        "total_bytes = 100",
    ),
    "unknown dtype": (dict(dtype=99, shape=[2, HIDDEN], total_bytes=384, data=b"\0" * 384), INVALID, "unknown dtype"),
    "negative dims": (dict(dtype=tensor_pb2.FLOAT32, shape=[-2, HIDDEN], total_bytes=0), INVALID, "must be >= 0"),
    "2**40 elements, tiny payload": (  # well formed, past a limit: it can never pass as sent
        dict(dtype=tensor_pb2.FLOAT32, shape=[2**20, 2**20], total_bytes=4 * 2**40, data=b"\0" * 8),
        INVALID,
        "max_tensor_bytes",
    ),
    "integer hidden states": (
        dict(dtype=tensor_pb2.INT64, shape=[2, HIDDEN], total_bytes=768, data=b"\0" * 768),
        INVALID,
        "floating dtype",
    ),
    "shape disagrees with positions": (
        dict(dtype=tensor_pb2.FLOAT32, shape=[3, HIDDEN], total_bytes=576, data=b"\0" * 576),
        INVALID,
        "hidden_chunk.shape = [3, 48]: the step's 2 positions need [2, 48]",
    ),
}


def test_malformed_frames_get_their_status_and_the_stage_keeps_serving(chain, ckpt, oracle):
    first, last = chain
    rss_before = last.rss_kib()
    stream = ModelStream(last)
    try:
        for name, (fields, code, message) in MALFORMED.items():
            stream.send(_frame(**fields))
            result = stream.receive()
            assert result.error.code == code, name
            assert message in result.error.message, (name, result.error.message)
    finally:
        stream.close()
    assert last.rss_kib() - rss_before < 64 * 1024  # no allocation for the claimed sizes

    stream = ModelStream(first)
    try:
        stream.step([seq_input("ok", range(5), PROMPTS["s2"])], route=[last.address])
        bad = stream.step(
            [
                seq_input("vocab", [0], [5000]),
                seq_input("ghost", [4], [1]),
                seq_input("ok", [7], [1]),  # skips positions 5 and 6
                seq_input("ok2", [0, 2], [1, 2]),
            ],
            route=[last.address],
        )
        errors = {r.sequence_id: (r.error.code, r.error.message) for r in bad.sequences}
        assert {k: c for k, (c, _) in errors.items()} == {
            "vocab": INVALID,
            "ghost": INVALID,
            "ok": INVALID,
            "ok2": INVALID,
        }
        assert "outside the vocabulary [0, 211)" in errors["vocab"][1]
        assert "unknown sequence id 'ghost'" in errors["ghost"][1]
        assert "start at 7, expected 5" in errors["ok"][1]
        assert "consecutive" in errors["ok2"][1]
        # One id twice in a step: refused whole, as the rows could not be told apart downstream.
        twice = stream.step([seq_input("twice", [0], [1]), seq_input("twice", [0], [1])], route=[last.address])
        assert (twice.error.code, twice.error.message) == (INVALID, "sequence 'twice' appears twice in one step")
        # A repeat of position 4 is refused too; the sequence itself is intact and goes on.
        repeat = stream.step([seq_input("ok", [4], [200])], route=[last.address])
        assert repeat.sequences[0].error.code == INVALID
        good = stream.step([seq_input("ok", [5], [oracle["s2"][0]])], route=[last.address])
        assert good.sequences[0].sampled_token_id == oracle["s2"][1]
    finally:
        stream.close()
    for stage in chain:
        stage_pb2_grpc.StageWorkerStub(stage.channel).Release(stage_pb2.ReleaseRequest(sequence_ids=["ok"]))


def test_hostile_steps_are_refused_one_by_one_and_the_stream_goes_on(chain, ckpt):
    """Each hostile step is answered INVALID_ARGUMENT on its own; the same stream then serves a step."""
    _, last = chain
    model = last.info().model_id
    hidden = LocalPipeline([load_stage(ckpt, LayerRange(0, 2))]).step({"h": PROMPTS["s2"]}, all_logits=True)

    def step(step_id, positions, *chunks, history=(), **fields):
        fields.setdefault("model_id", model)
        seq = seq_input(f"hostile{step_id}", positions)
        seq.history_token_ids.extend(history)
        head = stage_pb2.StepHeader(step_id=step_id, sequences=[seq], **fields)
        return [stage_pb2.StepFrame(header=head), *(stage_pb2.StepFrame(hidden_chunk=c) for c in chunks)]

    f32 = tensor_pb2.FLOAT32
    frames = [
        # 0 elements, 0 bytes, and dims torch cannot build: once the stream's reader died on it.
        *step(1, [0, 1], tensor_pb2.TensorChunk(dtype=f32, shape=[2**62, 2**62, 0], total_bytes=0)),
        # A first chunk claiming 3000 rows for a step of 2: refused before more of it comes.
        *step(
            2,
            [0, 1],
            tensor_pb2.TensorChunk(dtype=f32, shape=[3000, HIDDEN], total_bytes=3000 * HIDDEN * 4, data=bytes(1024)),
        ),
        *step(3, [0, 1], model_id=""),  # no model id
        *step(4, [0], history=range(300)),  # a history past the model's context (256)
        *step(5, [0], route=[last.address] * 65),  # a route of 65 hops
        *step(6, range(len(PROMPTS["s2"])), *chunk(hidden, 1000)),  # a good step, on the same stream
    ]
    results = list(stage_pb2_grpc.StageWorkerStub(last.channel).Step(iter(frames), timeout=60))
    got = {r.step_id: (r.error.code, r.error.message) for r in results}
    assert sorted(got) == [1, 2, 3, 4, 5, 6], got
    assert got[1][0] == INVALID and "shape [4611686018427387904, 4611686018427387904, 0]" in got[1][1]
    assert got[2] == (
        INVALID,
        "hidden_chunk.shape = [3000, 48]: the step's 2 positions need [2, 48] (tokens x hidden_size)",
    )
    assert got[3][0] == INVALID and "model_id is empty" in got[3][1]
    assert got[4] == (INVALID, "sequences[0].history_token_ids holds 300 ids: at most max_history = 256")
    assert got[5] == (INVALID, "route holds 65 entries: at most max_route_hops = 64")
    assert got[6][0] == 0 and next(r for r in results if r.step_id == 6).sequences[0].HasField("sampled_token_id")
    stage_pb2_grpc.StageWorkerStub(last.channel).Release(stage_pb2.ReleaseRequest(sequence_ids=["hostile6"]))


def test_last_stage_answers_a_subscriber_directly_and_the_chain_with_an_acknowledgement(chain, oracle):
    """A step naming a Results stream is answered there; only failures come back along the chain."""
    first, last = chain
    results = stage_pb2_grpc.StageWorkerStub(last.channel).Results
    subscription = results(stage_pb2.ResultsRequest(subscriber="sub"))
    subscription.initial_metadata()  # registered
    prompt = PROMPTS["s3"]

    def header(step_id, seqs, reply_id, route=(last.address,)):
        return [
            stage_pb2.StepFrame(
                header=stage_pb2.StepHeader(
                    step_id=step_id,
                    route=list(route),
                    sequences=seqs,
                    reply=stage_pb2.DirectReply(subscriber="sub", step_id=reply_id),
                )
            )
        ]

    stream = ModelStream(first)
    try:
        stream.send(header(5, [seq_input("d1", range(len(prompt)), prompt)], 900))
        direct = next(subscription)
        assert direct.step_id == 900
        assert [(r.sequence_id, r.sampled_token_id) for r in direct.sequences] == [("d1", oracle["s3"][0])]
        # The first stage drops a sequence (its KV does not reach position 3): a direct result
        # would lack its entry, so the reply is dropped and the chain answers the step whole.
        stream.send(header(6, [seq_input("d2", [0], [1]), seq_input("d3", [3], [1])], 901))
        relayed = stream.receive()  # the first thing on the chain's stream: step 5 had no answer here
        assert relayed.step_id == 6 and not relayed.replied
        assert [(r.sequence_id, r.error.code) for r in relayed.sequences] == [("d2", 0), ("d3", INVALID)]
        stream.send(header(7, [seq_input("d1", [len(prompt)], [oracle["s3"][0]])], 902))
        direct = next(subscription)  # nothing came for 901
        assert (direct.step_id, direct.sequences[0].sampled_token_id) == (902, oracle["s3"][1])
    finally:
        stream.close()
    # The last stage itself answers its upstream with an acknowledgement, which a middle stage
    # would pass up; without a subscriber of that name, with the result.
    stream = ModelStream(last)
    hidden = torch.zeros(1, HIDDEN)
    try:
        frames = header(8, [seq_input("d4", [0])], 903, route=())
        frames[0].header.hidden.CopyFrom(next(chunk(hidden, 1 << 20)))
        ack = stream.send(frames) or stream.receive()
        assert (ack.step_id, ack.replied, len(ack.sequences)) == (8, True, 0)
        assert next(subscription).step_id == 903
        frames = header(9, [seq_input("d4", [1])], 904, route=())
        frames[0].header.reply.subscriber = "nobody"
        frames[0].header.hidden.CopyFrom(next(chunk(hidden, 1 << 20)))
        full = stream.send(frames) or stream.receive()
        assert (full.step_id, full.replied, [r.sequence_id for r in full.sequences]) == (9, False, ["d4"])
    finally:
        stream.close()
        subscription.cancel()
    for stage in chain:
        stage_pb2_grpc.StageWorkerStub(stage.channel).Release(stage_pb2.ReleaseRequest(sequence_ids=["d1", "d2", "d4"]))
    with pytest.raises(grpc.RpcError) as err:
        next(results(stage_pb2.ResultsRequest(subscriber="")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "subscriber must be 1 to 128 bytes, got 0" in err.value.details()


def test_kv_pool_exhaustion_fails_only_the_sequence_that_does_not_fit(ckpt, tmp_path, oracle):
    # 4 layers x 16 tokens x 2 kv heads x 8 dims x 4 bytes x (K and V) = 8 KiB per block.
    stage = StageProcess(ckpt, "0:4", "--kv-memory", "40K", "--kv-block-size", "16", log_dir=tmp_path)
    try:
        stage.wait_serving()
        assert stage.info().kv_blocks_total == 5
        stream = ModelStream(stage)
        result = stream.step(
            [
                seq_input("fits", range(len(PROMPTS["s3"])), PROMPTS["s3"]),  # 1 block
                seq_input("huge", range(70), [3] * 70),  # 5 blocks: only 4 are left
                seq_input("fits2", range(len(PROMPTS["s1"])), PROMPTS["s1"]),  # 2 blocks
            ]
        )
        stream.close()
        codes = [(r.sequence_id, r.error.code) for r in result.sequences]
        assert codes == [("fits", 0), ("huge", EXHAUSTED), ("fits2", 0)]
        assert "'huge' needs 5 more block(s), 4 free" in result.sequences[1].error.message
        assert result.sequences[0].sampled_token_id == oracle["s3"][0]
        assert result.sequences[2].sampled_token_id == oracle["s1"][0]
        assert stage.info().kv_blocks_free == 2
        released = stage_pb2_grpc.StageWorkerStub(stage.channel).Release(
            stage_pb2.ReleaseRequest(sequence_ids=["fits", "huge", "fits2"])
        )
        assert (released.released, released.kv_blocks_free) == (2, 5)
        assert stage.info().kv_blocks_free == 5
    finally:
        assert stage.stop() == 0


def test_bad_command_lines_fail_with_a_clear_message(ckpt, tmp_path):
    import subprocess
    import sys

    for args, message in [
        (["--layers", "0:9"], "layer range [0, 9) is outside [0, 4)"),
        (["--layers", "2:2"], "outside [0, 4) or empty"),
        (["--layers", "0:2", "--kv-memory", "lots"], "size 'lots'"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "layerline", "stage", "--model", str(ckpt), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_stage_runs_openmp_with_the_active_wait_policy_unless_told_otherwise():
    env: dict[str, str] = {"PATH": "/bin"}
    openmp_defaults(env)
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000"}
    for given in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):  # either one set: both kept as given
        env = dict(given)
        openmp_defaults(env)
        assert env == given
