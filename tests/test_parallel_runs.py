"""`moeify tune` across processes (torchrun, 2 CPU processes, gloo) when the ranks are not in step: a rank held back at
any phase, a rank that never arrives, a stop signal while a rank waits in a collective, a rank killed with SIGKILL.
The ranks are held back by tests/held_back.py (moeify's CLI with Parallel.arrive and the training step wrapped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import build_dense, built_once
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError
from moeify.training.parallel import DEFAULT_TIMEOUT, Parallel, collective_timeout
from test_calibrate import CALIB
from tuning_fixtures import assert_identical, copy_output, held_back_cmd

# 4 steps of 1,024 tokens on the real text only (no sampled text: rank 0 writes the tuning text at once, the race
# of the issue this file tests), a snapshot after every step
FLAGS = ["--tokens", "4096", "--tune-generated", "0", "--lr", "0.02", "--save-every", "0"]
PHASES = ["the tuning text", "the teacher pass", "the tuning loop", "saving a snapshot", "writing the output"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    """A tiny dense model, its carve, and the carve tuned by an undelayed 2-process run (the reference); read-only."""
    def build(root: Path) -> None:
        dense = build_dense(root / "dense", tokenizer_dir, num_hidden_layers=3, initializer_range=0.3)
        run_conversion(plan_conversion(dense, build_config(experts=4, top_k=2, **CALIB)), root / "carve")
        ref = copy_output(root / "carve", root / "reference")
        res = _torchrun(["tune", str(dense), str(ref), *FLAGS])
        assert res.returncode == 0, res.stderr[-3000:]

    root = built_once(tmp_path_factory, "parallel-runs", build)  # read by both of this file's groups of tests
    return root / "dense", root / "carve", root / "reference"


def _env(hold: str = "", **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEIFY_")}
    return {**env, "OMP_NUM_THREADS": "1", "MOEIFY_TEST_HOLD": hold, **extra}


def _torchrun(args: list[str], hold: str = "", launcher: tuple[str, ...] = (), **env) -> subprocess.CompletedProcess:
    return subprocess.run(held_back_cmd(args, launcher), env=_env(hold, **env), capture_output=True, text=True,
                          timeout=600)


def _lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_held_back_at_every_phase_finishes_as_the_undelayed_run(runs, tmp_path, rank):
    """Rank `rank` is held back 1.5 s just after it arrives at each phase (the other rank goes ahead into it: it
    writes the tuning text, the targets, the snapshots first). The run ends, with the undelayed run's weights, bit for
    bit. (Before the fix, rank 1 held back here found the tuning text rank 0 had written, skipped the barrier rank 0
    waited at, and both waited for ever.)"""
    dense, carve, ref = runs
    out = copy_output(carve, tmp_path / "out")
    hold = ";".join(f"{rank}|{phase}|1.5" for phase in PHASES)
    res = _torchrun(["tune", str(dense), str(out), *FLAGS], hold)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(_lines(res.stderr, "held_back:")) == len(PHASES)  # every hold happened
    assert_identical(ref, out)
    assert not Path(str(out) + ".moeify-tune").exists()


@pytest.mark.parametrize("where, said", [
    ("1|the teacher pass|forever|before",
     "error: rank 0: rank 1 did not arrive at the teacher pass within 4 s (the collective timeout; rank 1 is still "
     "at the end of the tuning text)"),
    ("1|step 2|forever",
     "error: rank 0: a collective of step 2 of the tuning loop did not complete within 4 s (the collective timeout): "
     "another rank stopped answering"),
])
def test_a_rank_that_never_arrives_ends_the_run_within_the_timeout_naming_it(runs, tmp_path, where, said):
    """Rank 1 never arrives, at a phase (the ranks meet on the launcher's store) or inside a training step (rank 0
    waits in gloo's all-reduce): rank 0 gives up after --timeout with one line naming the phase (and, at a phase,
    the rank that did not come and where it is), and says how to resume; every rank ends."""
    dense, carve, _ = runs
    out = copy_output(carve, tmp_path / "out")
    proc = subprocess.Popen(held_back_cmd(["tune", str(dense), str(out), *FLAGS, "--timeout", "4"]),
                            env=_env(where, MOEIFY_STOP_GRACE="2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    held_at, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("held_back:") and held_at is None:
            held_at = time.monotonic()
    proc.wait(timeout=120)
    ended = time.monotonic() - held_at
    text = "".join(lines)
    assert proc.returncode != 0
    errors = _lines(text, "error:")
    assert len(errors) == 1 and errors[0].startswith(said), text[-3000:]
    assert f"continue from the last saved step with: moeify tune {dense} {out} --resume" in errors[0]
    assert ended < 4 + 2 + 10  # the timeout, the stopped rank's grace, the launcher's reaction
    assert (out / "model.safetensors").read_bytes() == (carve / "model.safetensors").read_bytes()  # OUT untouched


def test_sigterm_while_a_rank_waits_in_a_collective_ends_every_rank_and_resumes(runs, tmp_path):
    """Rank 1 is stuck inside step 3 (holding), rank 0 waits for it in gloo's all-reduce (the timeout is far away):
    the main thread of rank 0 cannot run Python's signal handler. SIGTERM to rank 0 alone ends it within the stop
    grace (2 s here) with one line, torchrun then stops rank 1 the same way; the state saved after step 2 is kept,
    and --resume finishes with the weights of the uninterrupted run."""
    dense, carve, ref = runs
    out = copy_output(carve, tmp_path / "out")
    pids = tmp_path / "pids"
    proc = subprocess.Popen(held_back_cmd(["tune", str(dense), str(out), *FLAGS, "--timeout", "300"]),
                            env=_env("1|step 3|forever", MOEIFY_STOP_GRACE="2", MOEIFY_TEST_PIDS=str(pids)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("held_back:"):
            break
    time.sleep(1.0)  # rank 0 is in the collective by now
    rank0 = int((pids / "0").read_text())
    sent = time.monotonic()
    os.kill(rank0, signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    ended = time.monotonic() - sent
    text = "".join(lines) + rest
    assert proc.returncode != 0
    assert ended < 2 + 2 + 8, text[-3000:]  # each rank's grace, the launcher's reaction
    stops = _lines(text, "interrupted: rank")
    assert any(s.startswith("interrupted: rank 0 stopped by SIGTERM in step 3 of the tuning loop (still running 2 s "
                            "after the signal)") for s in stops), text[-3000:]
    for pid in (int((pids / r).read_text()) for r in ("0", "1")):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    res = _torchrun(["tune", str(dense), str(out), "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert_identical(ref, out)


def test_kill_9_of_one_rank_then_resume_equals_the_uninterrupted_run(runs, tmp_path):
    """SIGKILL of rank 1 in step 3: rank 0 learns it from its collective at once (the connection closed) and ends
    with one line; `--resume` under torchrun continues from the snapshot of step 2 and ends with the uninterrupted
    run's weights, bit for bit."""
    dense, carve, ref = runs
    out = copy_output(carve, tmp_path / "out")
    # torchrun checks its ranks every 0.1 s and SIGTERMs the others once one has died: on a busy machine that can
    # come before rank 0 reaches the collective (it then stops as interrupted, saved at step 2 as well); checking
    # every 3 s leaves rank 0 the time to meet the closed connection, which is what this test is about
    res = _torchrun(["tune", str(dense), str(out), *FLAGS], "1|step 3|kill", launcher=("--monitor-interval", "3"))
    assert res.returncode != 0
    errors = _lines(res.stdout + res.stderr, "error:")
    assert errors and errors[0].startswith("error: rank 0: another rank stopped during step 3 of the tuning loop "
                                           "(its connection closed)"), (res.stdout + res.stderr)[-3000:]
    assert '"step": 2' in (Path(str(out) + ".moeify-tune") / "state.json").read_text()
    res = _torchrun(["tune", str(dense), str(out), "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert_identical(ref, out)


def test_one_ranks_refusal_is_every_ranks_and_rank_0_says_it(runs, tmp_path):
    """Rank 1 alone refuses its inputs (say its copy of a file is unreadable): no rank waits for it; every rank
    stops at once with exit 2 and rank 0 prints rank 1's one line; nothing is written."""
    dense, carve, _ = runs
    out = copy_output(carve, tmp_path / "out")
    started = time.monotonic()
    res = _torchrun(["tune", str(dense), str(out), *FLAGS, "--timeout", "300"],
                    MOEIFY_TEST_REFUSE="1|rank 1 cannot read its tuning text")
    assert res.returncode != 0 and time.monotonic() - started < 120
    errors = _lines(res.stdout + res.stderr, "error:")
    assert errors == ["error: rank 1 cannot read its tuning text — the test's refusal"], (res.stdout + res.stderr)[-3000:]
    assert not Path(str(out) + ".moeify-tune").exists()


def test_the_collective_timeout_comes_from_the_flag_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("MOEIFY_TIMEOUT", raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT == 600
    monkeypatch.setenv("MOEIFY_TIMEOUT", "1800")
    assert collective_timeout() == 1800 and collective_timeout(30) == 30
    for bad, where in (("soon", "MOEIFY_TIMEOUT"), ("0", "MOEIFY_TIMEOUT"), ("-5", "MOEIFY_TIMEOUT")):
        monkeypatch.setenv("MOEIFY_TIMEOUT", bad)
        with pytest.raises(MoeifyError, match=f"^{where} must be a positive number of seconds, got '{bad}'"):
            collective_timeout()
    with pytest.raises(MoeifyError, match="^--timeout must be a positive number of seconds"):
        collective_timeout(float("inf"))


def test_one_process_meets_no_one_and_decides_alone():
    """In one process (no torchrun) the meeting points are free and a shared decision is the process's own."""
    par = Parallel()
    par.arrive("the teacher pass")
    assert par.share(lambda: {"step": 1024}) == {"step": 1024} and par.share(7) == 7
    assert par.agree(lambda: 3, "checking") == 3
    with pytest.raises(MoeifyError, match="refused"):
        par.agree(lambda: (_ for _ in ()).throw(MoeifyError("refused")), "checking")
    assert par.failure(RuntimeError("Timed out waiting 5000ms for recv operation")) is None


def test_convert_under_torchrun_is_refused_before_any_rank_writes(runs, tmp_path):
    """Every rank of a torchrun would write OUT at once: convert refuses, saying how to tune across processes."""
    dense, _, _ = runs
    res = subprocess.run([sys.executable, "-m", "moeify", "convert", str(dense), str(tmp_path / "out")],
                         env={**_env(), "WORLD_SIZE": "2", "COLUMNS": "400"}, capture_output=True, text=True)
    assert res.returncode == 2
    assert "error: convert runs in one process, not under torchrun / accelerate launch — carve in one process" \
        in res.stderr + res.stdout
    assert not (tmp_path / "out").exists()
