"""`moeify tune OUT --tune-text` on an upcycle or merge across processes (torchrun, 2 CPU processes, gloo): the model
sharded by FSDP2, each step's windows split by rank. Two processes end where one does on the same tokens (float32:
the relative difference of every tensor's update), for a full-width upcycle, a fine-grained one and a merge; the
expert load of the curve is counted over both ranks' tokens; a rank killed mid-run, then --resume, ends with the
uninterrupted run's weights, and so does one stopped by SIGTERM to rank 0 (rank 1 stuck in a step) or by Ctrl-C of
torchrun; a rank held back at each phase finishes with them; a rank that never arrives ends the other within the
timeout; `accelerate launch` ends with torchrun's weights. The ranks are held back by tests/held_back.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import build_dense, built_once, corpus_text, read_json
from tuning_fixtures import HELD_BACK, assert_identical, copy_output, held_back_cmd, tensors_of

# 5 steps of 2 windows of 128 tokens (the tiny models' max_position_embeddings), a snapshot after every step
FLAGS = ["--tokens", "1280", "--lr", "0.03", "--step-tokens", "256", "--save-every", "0"]
PHASES = ["checking the inputs", "loading the model", "the training loop", "saving a snapshot", "writing the output"]
UPDATE_RTOL = 1e-4  # float32 sums in another order (gloo's reduce-scatter, the per-rank backward): ~1e-6 measured


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tokenizer_dir):
    """A full-width upcycle (E4 top-2), a fine-grained one (E4 G2 top-2) and a merge of two sources, in float32,
    each trained by one process (the reference) and by two; read-only."""
    def build(root: Path) -> None:
        import moeify
        from moeify.upcycling.upcycle import UpcycleSettings, plan_upcycle, run_upcycle

        (root / "train.txt").write_text(corpus_text(12000))
        dense = build_dense(root / "dense", tokenizer_dir)
        for name, g in (("full", 1), ("fine", 2)):
            run_upcycle(plan_upcycle(dense, UpcycleSettings(copies=4, granularity=g, top_k=2, symmetry="noise",
                                                            dtype="float32")), root / name)
        other = build_dense(root / "other", tokenizer_dir, seed=1)
        moeify.merge([dense, other], root / "merge", dtype="float32")
        for name in ("full", "fine", "merge"):
            for runner, to in ((_one, "one"), (_two, "two")):
                out = copy_output(root / name, root / f"{name}-{to}")
                res = runner(["tune", str(out), "--tune-text", str(root / "train.txt"), *FLAGS])
                assert res.returncode == 0, res.stderr[-3000:]

    return built_once(tmp_path_factory, "train-processes", build)


def _env(hold: str = "", **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEIFY_")}
    return {**env, "OMP_NUM_THREADS": "1", "MOEIFY_AUTOCAST": "off", "MOEIFY_TEST_HOLD": hold, **extra}


def _one(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeify", *args], env=_env(), capture_output=True, text=True,
                          timeout=600)


def _two(args: list[str], hold: str = "", launcher: tuple[str, ...] = (), **env) -> subprocess.CompletedProcess:
    return subprocess.run(held_back_cmd(args, launcher), env=_env(hold, **env), capture_output=True, text=True,
                          timeout=600)


def _update_differences(base: Path, a: Path, b: Path) -> dict[str, float]:
    """Per tensor that trained: |update_a - update_b| / |update_a| (Frobenius norms)."""
    w0, wa, wb = tensors_of(base), tensors_of(a), tensors_of(b)
    diffs = {}
    for k in w0:
        da, db = wa[k].double() - w0[k].double(), wb[k].double() - w0[k].double()
        if da.norm() > 0:
            diffs[k] = ((da - db).norm() / da.norm()).item()
    return diffs


@pytest.mark.parametrize("name", ["full", "fine", "merge"])
def test_two_processes_equal_one_on_the_same_tokens(outputs, name):
    diffs = _update_differences(outputs / name, outputs / f"{name}-one", outputs / f"{name}-two")
    assert any("experts" in k for k in diffs) and any(k.endswith("moe.gate.weight") for k in diffs)  # routers
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < UPDATE_RTOL, (worst, diffs[worst])
    one, two = (read_json(outputs / f"{name}-{n}" / "report.json")["training"]["runs"][-1] for n in ("one", "two"))
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["held_out_after"]["loss"] == pytest.approx(one["held_out_after"]["loss"], abs=1e-4)


def test_the_expert_load_is_counted_over_every_ranks_tokens(outputs):
    """The curve's loss, balance, busiest expert and starved experts of two processes are one process's: each rank
    counts its own windows, and the counts are summed over the ranks (one rank alone would see half the tokens)."""
    one, two = (read_json(outputs / f"full-{n}" / "report.json")["training"]["runs"][-1] for n in ("one", "two"))
    assert len(one["curve"]) == len(two["curve"]) == 5
    for a, b in zip(one["curve"], two["curve"]):
        assert (a["step"], a["tokens"], a["starved"]) == (b["step"], b["tokens"], b["starved"])
        assert a["max_load"] == pytest.approx(b["max_load"], abs=2e-3)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4) and a["balance"] == pytest.approx(b["balance"], abs=1e-4)


def test_kill_9_of_one_rank_then_resume_equals_the_uninterrupted_run(outputs, tmp_path):
    """SIGKILL of rank 1 in step 3: rank 0 ends with one line; --resume under torchrun continues from the snapshot of
    step 2 and ends with the uninterrupted two-process run's weights, bit for bit."""
    out = copy_output(outputs / "full", tmp_path / "out")
    text = str(outputs / "train.txt")
    res = _two(["tune", str(out), "--tune-text", text, *FLAGS], "1|step 3|kill", launcher=("--monitor-interval", "3"))
    assert res.returncode != 0
    errors = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("error:")]
    assert errors and errors[0].startswith("error: rank 0: another rank stopped during step 3 of the training loop"), \
        (res.stdout + res.stderr)[-3000:]
    assert read_json(Path(str(out) + ".moeify-tune") / "state.json")["meta"]["step"] == 2
    refused = _one(["tune", str(out), "--resume"])
    assert refused.returncode == 2 and "saved by a run across 2 process(es); this one has 1" in refused.stdout + \
        refused.stderr
    res = _two(["tune", str(out), "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert_identical(outputs / "full-two", out)
    assert not Path(str(out) + ".moeify-tune").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_held_back_at_every_phase_finishes_as_the_undelayed_run(outputs, tmp_path, rank):
    out = copy_output(outputs / "full", tmp_path / "out")
    hold = ";".join(f"{rank}|{phase}|1.5" for phase in PHASES)
    res = _two(["tune", str(out), "--tune-text", str(outputs / "train.txt"), *FLAGS], hold)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len([ln for ln in res.stderr.splitlines() if ln.startswith("held_back:")]) == len(PHASES)
    assert_identical(outputs / "full-two", out)


def test_a_rank_that_never_arrives_ends_the_other_within_the_timeout(outputs, tmp_path):
    out = copy_output(outputs / "full", tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    proc = subprocess.Popen(held_back_cmd(["tune", str(out), "--tune-text", str(outputs / "train.txt"), *FLAGS,
                                      "--timeout", "4"]),
                            env=_env("1|the training loop|forever|before", MOEIFY_STOP_GRACE="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    held_at, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("held_back:") and held_at is None:
            held_at = time.monotonic()
    proc.wait(timeout=120)
    text = "".join(lines)
    assert proc.returncode != 0 and held_at is not None, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: rank 0: rank 1 did not arrive at the training loop within 4 s (the collective timeout"), text[-3000:]
    assert f"moeify tune {out} --resume" in errors[0]
    assert time.monotonic() - held_at < 4 + 2 + 10
    assert (out / "model.safetensors").read_bytes() == before


def _until_held(args: list[str], env: dict) -> tuple[subprocess.Popen, list[str]]:
    """A 2-process run started, its output read up to the first rank held back (tests/held_back.py)."""
    proc = subprocess.Popen(held_back_cmd(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while not (lines and lines[-1].startswith("held_back:")):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    return proc, lines


def test_sigterm_while_a_rank_waits_in_a_collective_ends_every_rank_and_resumes(outputs, tmp_path):
    """Rank 1 is stuck inside step 3, rank 0 waits for it in a collective: SIGTERM to rank 0 alone ends it within
    the stop grace (2 s) with one line, torchrun then stops rank 1; the state saved after step 2 is kept, and
    --resume finishes with the uninterrupted two-process run's weights."""
    out = copy_output(outputs / "full", tmp_path / "out")
    pids = tmp_path / "pids"
    proc, lines = _until_held(["tune", str(out), "--tune-text", str(outputs / "train.txt"), *FLAGS, "--timeout",
                               "300"], _env("1|step 3|forever", MOEIFY_STOP_GRACE="2", MOEIFY_TEST_PIDS=str(pids)))
    time.sleep(1.0)  # rank 0 is in the collective by now
    sent = time.monotonic()
    os.kill(int((pids / "0").read_text()), signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode != 0 and time.monotonic() - sent < 2 + 2 + 8, text[-3000:]
    assert any(ln.startswith("interrupted: rank 0 stopped by SIGTERM in step 3 of the training loop (still running "
                             "2 s after the signal)") for ln in text.splitlines()), text[-3000:]
    for rank in ("0", "1"):
        with pytest.raises(ProcessLookupError):
            os.kill(int((pids / rank).read_text()), 0)
    assert read_json(Path(str(out) + ".moeify-tune") / "state.json")["meta"]["step"] == 2
    res = _two(["tune", str(out), "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert_identical(outputs / "full-two", out)


def test_sigint_to_the_launcher_saves_on_every_rank_and_resumes(outputs, tmp_path):
    """Ctrl-C of torchrun mid-run (rank 1 slowed in step 3 so the signal lands in the loop): torchrun passes it
    to both ranks, which stop at the end of a step with the state saved; --resume ends with the uninterrupted
    two-process run's weights."""
    out = copy_output(outputs / "full", tmp_path / "out")
    proc, lines = _until_held(["tune", str(out), "--tune-text", str(outputs / "train.txt"), *FLAGS],
                              _env("1|step 3|3"))
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode != 0, text[-3000:]
    saved = read_json(Path(str(out) + ".moeify-tune") / "state.json")["meta"]["step"]
    assert 2 <= saved < 5, text[-3000:]
    res = _two(["tune", str(out), "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert_identical(outputs / "full-two", out)


def test_accelerate_launch_runs_as_torchrun_does(outputs, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (torchrun underneath; on a machine without GPUs the ranks
    use gloo on the CPU) ends with the weights of the torchrun run. (`--cpu --num_processes 2` would start one
    process: accelerate launches several CPU processes only through mpirun.)"""
    out = copy_output(outputs / "full", tmp_path / "out")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(port), str(HELD_BACK)]
    res = subprocess.run(launch + ["tune", str(out), "--tune-text", str(outputs / "train.txt"), *FLAGS],
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_json(out / "report.json")["training"]["runs"][-1]["processes"] == 2
    assert_identical(outputs / "full-two", out)
