"""The house rules: which way imports point (import-linter's contracts), the package view the
tools read, and how long a source file may grow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
VIEW = ROOT / ".view"
PYPROJECT = ROOT / "pyproject.toml"
MAX_LINES = 400


def _lint_imports(view: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` with the contracts of pyproject.toml, run where `layerline` is `view/layerline`."""
    command = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache", str(PYPROJECT)]
    return subprocess.run(command, cwd=view, capture_output=True, text=True, timeout=240)


@pytest.mark.cluster
def test_the_import_contracts_hold() -> None:
    done = _lint_imports(VIEW)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in done.stdout


@pytest.mark.cluster
def test_a_client_module_that_imports_the_coordinator_and_torch_breaks_two_contracts(tmp_path: Path) -> None:
    """The contracts can fail: the same view, with one more module in the client SDK."""
    view = tmp_path / "layerline"
    view.mkdir()
    for entry in (VIEW / "layerline").iterdir():
        if entry.name != "client":
            (view / entry.name).symlink_to(entry.resolve())
    client = view / "client"
    client.mkdir()
    for module in (ROOT / "client").glob("*.py"):
        (client / module.name).symlink_to(module)
    (client / "_violation.py").write_text("import torch\n\nfrom layerline.coordinator import scheduler\n")
    done = _lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "Rooms: the command line on top" in done.stdout
    assert "layerline.client._violation -> layerline.coordinator.scheduler" in done.stdout
    assert "layerline.client._violation -> torch" in done.stdout
    assert "kept, 2 broken." in done.stdout


def test_the_view_links_every_package_where_python_imports_it() -> None:
    """`.view/layerline` (read by mypy and import-linter) mirrors [tool.setuptools.package-dir]."""
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    view = VIEW / "layerline"
    for package, folder in folders.items():
        if package == "layerline":
            continue
        link = view / package.removeprefix("layerline.")
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), package
    expected = {p.name for p in (ROOT / "layerline").iterdir() if p.name != "__pycache__"}
    expected |= {package.removeprefix("layerline.") for package in folders if package != "layerline"}
    assert {p.name for p in view.iterdir()} == expected
    for name in expected:
        assert (view / name).exists(), f"{view / name} is a broken link"
    listed = {p for p in setuptools["packages"] if p.count(".") == 1}
    assert listed == {f"layerline.{p.name}" for p in view.iterdir() if p.is_dir()}


def test_no_source_file_is_over_400_lines() -> None:
    folders = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"].values()
    too_long = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            if "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"split these by role (STYLE.md): {too_long}"


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """README.md gives one command from a fresh clone to a passing run; .ci/run runs exactly it."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- test-command -->")
    block = readme[start:].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert block in ci, (block, ci)
