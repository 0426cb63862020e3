"""What the tune-stage tests share: a tiny dense model and its untuned carve (module-wide: each test copies it), the
runs' short settings, and comparisons of outputs' weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import build_dense, built_once
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.tuning import TuneOptions
from test_calibrate import CALIB

HELD_BACK = Path(__file__).with_name("held_back.py")  # moeify's CLI, its ranks held back where MOEIFY_TEST_HOLD says
# a short schedule: windows of 64 tokens, 16 windows a step
CARVE = dict(experts=4, top_k=2, **CALIB)


@pytest.fixture(scope="module")
def carved(tmp_path_factory, tokenizer_dir):
    """A tiny dense model and its untuned carve, read-only (each test copies the carve)."""
    def build(root: Path) -> None:
        dense = build_dense(root / "dense", tokenizer_dir, num_hidden_layers=3, initializer_range=0.3)  # FFNs matter
        run_conversion(plan_conversion(dense, build_config(**CARVE)), root / "carve")

    root = built_once(tmp_path_factory, "tune-stage", build)  # one for the three tune-stage files' groups
    return root / "dense", root / "carve"


def copy_output(carve: Path, to: Path) -> Path:
    shutil.copytree(carve, to)
    return to


def torchrun_cmd(entry: list[str], launcher: tuple[str, ...] = ()) -> list[str]:
    """torchrun starting 2 CPU processes (gloo) of `entry` (a script and its arguments, or -m moeify and its)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher, *entry]


def held_back_cmd(args: list[str], launcher: tuple[str, ...] = ()) -> list[str]:
    """torchrun starting 2 processes of `moeify ARGS` through tests/held_back.py."""
    return torchrun_cmd([str(HELD_BACK), *args], launcher)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_identical(a: Path, b: Path) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    different = [n for n in ta if not torch.equal(ta[n], tb[n])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def assert_trained_alike(a: Path, b: Path, carve: Path, bound: float = 0.05) -> None:
    """Every tensor of outputs a and b within `bound` of what tuning moved it from the carve (float rounding that
    Adam's normalised steps carry into the weights); tensors tuning did not move, bit-identical."""
    ta, tb, tc = tensors_of(a), tensors_of(b), tensors_of(carve)
    assert ta.keys() == tb.keys()
    for name in ta:
        moved = (ta[name].float() - tc[name].float()).abs().max().item()
        if moved:
            assert (ta[name].float() - tb[name].float()).abs().max().item() < bound * moved, name
        else:
            assert torch.equal(ta[name], tb[name]), name


def one_and_two_processes(dense: Path, carve: Path, tmp_path: Path, flags: list[str],
                           autocast: str = "auto") -> tuple[dict, dict]:
    """`moeify tune` of two copies of the carve, in one process and under torchrun with 2 CPU processes (gloo):
    (the run of each, as its report.json records it); the outputs are tmp_path/one and tmp_path/two."""
    one, two = copy_output(carve, tmp_path / "one"), copy_output(carve, tmp_path / "two")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOEIFY_AUTOCAST": autocast}
    subprocess.run([sys.executable, "-m", "moeify", "tune", str(dense), str(one)] + flags, env=env, check=True,
                   capture_output=True)
    res = subprocess.run(torchrun_cmd(["-m", "moeify", "tune", str(dense), str(two), *flags]), env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return tuple(json.loads((p / "report.json").read_text())["tuning"]["runs"][0] for p in (one, two))


def interrupt_at(step_tokens: int):
    """A progress callback that sends this process SIGINT once tuning has passed `step_tokens` tokens (the stage's
    handler asks the run to save and stop at the end of the step)."""
    sent = []

    def progress(stage, done, total, note=""):
        if stage == "tuning" and done >= step_tokens and not sent:
            sent.append(done)
            os.kill(os.getpid(), signal.SIGINT)

    return progress


OPTS = TuneOptions(tokens=12 * 1024, generated=0.25, lr=0.02)  # a large step: a short run that visibly learns
