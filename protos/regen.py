"""Regenerates the committed Python modules of layerline's wire format from `protos/v1/*.proto`.

    python -m layerline.protos.regen          # rewrite protos/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m layerline.protos.regen --check   # exit 1 if they differ from a fresh compile

The proto files import each other as "layerline/protos/v1/<name>.proto"; protoc sees `protos/` as
the virtual directory `layerline/protos` (`-Ilayerline/protos=<repo>/protos`), so the generated
modules import each other as `from layerline.protos.v1 import tensor_pb2`. protoc writes into a
temporary directory, and the result is compared with or copied over the committed files.
`_pb2_grpc.py` modules are kept only for protos that declare a service.

The output depends only on the .proto files and the installed grpcio-tools (which bundles protoc
and stamps its protobuf version into the output); this script owns nothing else and knows nothing
of what the messages mean.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTOS_DIR = Path(__file__).resolve().parent  # the repository's protos/ folder
PROTO_PACKAGE_DIR = PROTOS_DIR / "v1"  # .proto sources and the generated modules
VIRTUAL_ROOT = "layerline/protos"  # what protos/ is called on protoc's include path
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_SERVICE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)


def _proto_files() -> list[Path]:
    return sorted(PROTO_PACKAGE_DIR.glob("*.proto"))


def _is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def generate() -> dict[str, bytes]:
    """Compiles every .proto in protos/v1; returns {file name: content} of the modules to keep."""
    protos = _proto_files()
    if not protos:
        raise SystemExit(f"no .proto files in {PROTO_PACKAGE_DIR}")
    virtual = [f"{VIRTUAL_ROOT}/v1/{p.name}" for p in protos]
    with_services = [f"{VIRTUAL_ROOT}/v1/{p.name}" for p in protos if _SERVICE.search(p.read_text("utf-8"))]
    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="layerline-protoc-") as tmp:
        base = [
            "grpc_tools.protoc",
            f"-I{VIRTUAL_ROOT}={PROTOS_DIR}",
            f"-I{well_known}",
        ]
        messages = [*base, f"--python_out={tmp}", f"--pyi_out={tmp}", *virtual]
        if protoc.main(messages) != 0:
            raise SystemExit("protoc failed on the message modules (see its errors above)")
        if with_services:
            services = [*base, f"--grpc_python_out={tmp}", *with_services]
            if protoc.main(services) != 0:
                raise SystemExit("protoc failed on the service modules (see its errors above)")
        out_dir = Path(tmp) / VIRTUAL_ROOT / "v1"
        return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir()) if _is_generated(p)}


def stale_files(fresh: dict[str, bytes], out_dir: Path) -> list[str]:
    """Names of generated files in out_dir that are missing, different, or no longer generated."""
    committed = {p.name for p in out_dir.iterdir() if _is_generated(p)}
    stale = [
        name for name, content in fresh.items() if name not in committed or (out_dir / name).read_bytes() != content
    ]
    stale.extend(name for name in committed if name not in fresh)
    return sorted(stale)


def write(fresh: dict[str, bytes], out_dir: Path) -> list[str]:
    """Makes out_dir's generated files equal fresh; returns the names changed or removed."""
    changed = stale_files(fresh, out_dir)
    for name in changed:
        target = out_dir / name
        if name in fresh:
            target.write_bytes(fresh[name])
        else:
            target.unlink()
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layerline.protos.regen", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the committed modules differ from a fresh compile",
    )
    args = parser.parse_args(argv)
    fresh = generate()
    if args.check:
        stale = stale_files(fresh, PROTO_PACKAGE_DIR)
        if stale:
            tools = importlib.metadata.version("grpcio-tools")
            print(
                f"stale generated protos in {PROTO_PACKAGE_DIR}: {', '.join(stale)}\n"
                f"(compiled with grpcio-tools {tools}); run: python -m layerline.protos.regen",
                file=sys.stderr,
            )
            return 1
        print(f"generated protos are up to date ({len(fresh)} files)")
        return 0
    changed = write(fresh, PROTO_PACKAGE_DIR)
    print(f"regenerated {len(fresh)} files in {PROTO_PACKAGE_DIR}; changed: {changed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
