"""Generated protos match the .proto files, import cleanly, and keep their wire contract."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from layerline.protos import regen

GENERATED = sorted(p.stem for p in regen.PROTO_PACKAGE_DIR.glob("*_pb2*.py"))


@pytest.fixture(scope="module")
def fresh() -> dict[str, bytes]:
    return regen.generate()


@pytest.mark.cluster
def test_committed_modules_are_fresh() -> None:
    """The one command CI and developers run; fails until `python -m layerline.protos.regen`."""
    done = subprocess.run(
        [sys.executable, "-m", "layerline.protos.regen", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_generation_is_deterministic(fresh: dict[str, bytes]) -> None:
    assert regen.generate() == fresh


def test_check_detects_stale_missing_and_orphaned_files(fresh: dict[str, bytes], tmp_path: Path) -> None:
    regen.write(fresh, tmp_path)
    assert regen.stale_files(fresh, tmp_path) == []
    (tmp_path / "stage_pb2.py").write_bytes(fresh["stage_pb2.py"] + b"\n")
    (tmp_path / "tensor_pb2.pyi").unlink()
    (tmp_path / "old_pb2_grpc.py").write_text("")
    assert regen.stale_files(fresh, tmp_path) == [
        "old_pb2_grpc.py",
        "stage_pb2.py",
        "tensor_pb2.pyi",
    ]
    assert regen.write(fresh, tmp_path) == ["old_pb2_grpc.py", "stage_pb2.py", "tensor_pb2.pyi"]
    assert regen.stale_files(fresh, tmp_path) == []
    assert not (tmp_path / "old_pb2_grpc.py").exists()


def test_services_have_grpc_modules_and_messages_have_stubs(fresh: dict[str, bytes]) -> None:
    names = set(fresh)
    for proto in ("tensor", "common", "stage", "coordinator"):
        assert {f"{proto}_pb2.py", f"{proto}_pb2.pyi"} <= names
    assert {n for n in names if n.endswith("_grpc.py")} == {
        "stage_pb2_grpc.py",
        "coordinator_pb2_grpc.py",
    }


@pytest.mark.parametrize("module", GENERATED)
def test_generated_module_imports(module: str) -> None:
    mod = importlib.import_module(f"layerline.protos.v1.{module}")
    if module.endswith("_pb2"):
        assert mod.DESCRIPTOR.package == "layerline.v1"
        assert mod.DESCRIPTOR.name == f"layerline/protos/v1/{module.removesuffix('_pb2')}.proto"


@pytest.mark.cluster
def test_client_side_protos_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from layerline.protos.v1 import coordinator_pb2, coordinator_pb2_grpc\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_step_frame_is_a_header_or_a_hidden_chunk() -> None:
    from layerline.protos.v1 import stage_pb2, tensor_pb2

    frame = stage_pb2.StepFrame(header=stage_pb2.StepHeader(step_id=7, route=["b:1"]))
    assert frame.WhichOneof("frame") == "header"
    frame.hidden_chunk.CopyFrom(tensor_pb2.TensorChunk(offset=0, data=b"x"))
    assert frame.WhichOneof("frame") == "hidden_chunk"
    assert not frame.HasField("header")


def test_sampling_params_distinguish_absent_from_zero() -> None:
    from layerline.protos.v1 import common_pb2

    absent = common_pb2.SamplingParams()
    greedy = common_pb2.SamplingParams(temperature=0.0, seed=0, logprobs=0)
    wire = common_pb2.SamplingParams.FromString(greedy.SerializeToString())
    for field in ("temperature", "seed", "logprobs", "top_p", "repetition_penalty"):
        assert not absent.HasField(field)
    for field in ("temperature", "seed", "logprobs"):
        assert wire.HasField(field)
