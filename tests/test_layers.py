"""The house: moeify's import layers (shared/DESIGN.md, the import-linter contracts in pyproject.toml) hold, and the
contracts catch an upward import or a cycle when one comes back; no module grows past the size the brief allows."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts, on the moeify package found in `tree`."""
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)


def test_the_layer_contracts_hold():
    if not LINT.exists():
        pytest.fail("lint-imports is missing: install the test extras (pip install -e '.[test]')")
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "11 kept, 0 broken" in done.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("tuning/data.py", "from ..carving.conversion import plan_conversion",  # the stage importing the pipeline that runs it
     ["moeify's layers", "the tune stage", "no import cycles"]),  # (and through it, tune's own run module)
    ("formats/config.py", "from ..evaluation.planning import plan_moe", ["moeify's layers", "no import cycles"]),  # settings importing a tool
    ("tuning/state.py", "from .run import tune_output", ["the tune stage", "no import cycles"]),  # inside the package
    ("version.py", "from .tuning.options import TuneOptions", ["moeify's layers"]),  # upward without a cycle
])
def test_the_contracts_catch_an_upward_import_or_a_cycle(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "moeify", tmp_path / "moeify", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "moeify" / module, "a") as fh:
        fh.write(f"\n{line}  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    reported = {name: f"{name}" in done.stdout.split("Broken contracts")[-1] for name in
                ("moeify's layers", "the tune stage", "no import cycles")}
    assert {n for n, hit in reported.items() if hit} == set(broken), done.stdout[-3000:]


def test_no_module_is_past_the_size_a_reader_takes_in():
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in (ROOT / "moeify").rglob("*.py")}
    assert {f: n for f, n in sizes.items() if n > 650} == {}
    assert {f: n for f, n in sizes.items() if f.startswith("moeify/tuning/") and n > 400} == {}
