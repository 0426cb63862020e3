"""scripts/bench_memory.py and scripts/bench_sampling.py: what a tuning run holds and what its sampling costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import build_dense
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from test_calibrate import CALIB

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_memory  # noqa: E402


def test_read_status_takes_the_resident_fields_in_bytes():
    text = "Name:\tpython\nVmPeak:\t  999 kB\nVmRSS:\t  3000 kB\nRssAnon:\t  2000 kB\nRssFile:\t   900 kB\n"
    assert bench_memory.read_status(text) == {"VmRSS": 3_072_000, "RssAnon": 2_048_000, "RssFile": 921_600}
    assert bench_memory.read_status("Name:\tx\n") == {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}


def test_bench_memory_measures_a_dry_run_and_splits_its_peak(tmp_path, tokenizer_dir):
    dense = build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=2, initializer_range=0.3)
    run_conversion(plan_conversion(dense, build_config(experts=4, top_k=2, **CALIB)), tmp_path / "carve")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "carve").iterdir()}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_memory.py"), str(dense),
                          str(tmp_path / "carve"), "--tokens", "2048", "--json", str(tmp_path / "m.json")],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    (r,) = json.loads((tmp_path / "m.json").read_text())
    at = r["at_peak"]
    # the sampled peak is the process's: within the kernel's own peak, made of anonymous and file pages
    assert 0 < at["VmRSS"] <= r["measured_peak_bytes"] * 1.01
    assert abs(at["RssAnon"] + at["RssFile"] - at["VmRSS"]) <= 0.02 * at["VmRSS"]  # + shmem (tiny)
    assert r["predicted"]["peak"] > 0 and r["step_seconds"] > 0
    assert r["predicted_over_measured"] == r["predicted"]["peak"] / r["measured_peak_bytes"]
    assert "anonymous at the peak" in res.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "carve").iterdir()} == before  # read only


def test_bench_sampling_prints_the_steps_and_the_dry_runs_fit(tmp_path, tokenizer_dir):
    dense = build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=2)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_sampling.py"), str(dense), "--batch", "4",
                          "--prompt", "4", "--new", "12", "--window", "64"],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines()]
    lengths = [int(r[0]) for r in rows if len(r) == 2 and r[0].isdigit()]
    assert lengths and lengths[0] == 6 and lengths == sorted(lengths) and lengths[-1] <= 17  # steps after the first (+1: keep_hidden)
    assert "fitted at the mean length of a 64-token window from 4-token prompts" in res.stdout
    assert "static cache, float32" in res.stdout
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_sampling.py"), str(dense), "--batch", "4",
                          "--prompt", "4", "--new", "12", "--bf16"],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and "static cache, bf16 autocast" in res.stdout, res.stderr[-3000:]
