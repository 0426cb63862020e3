"""The tuning memory model (moeify.maths.memory) against the measured peak of a real `moeify tune --dry-run`, with the
peak resident memory split into anonymous memory (tensors, the allocator's heap) and file-backed pages (the
memory-mapped safetensors the teacher's weights are read from, shared libraries). A benchmark, not CI.

    .venv/bin/python scripts/bench_memory.py models/smollm2-135m OUT --threads 1 [--tokens 4096] [--json r.json [--append]]
    MALLOC_MMAP_THRESHOLD_=262144 .venv/bin/python scripts/bench_memory.py ...   # glibc: freed blocks go back

OUT is a moeify output (tuned or not; read only: a dry run writes nothing). On a GPU the measured peak is
torch.cuda.max_memory_allocated (the split below is then the host's). A sampler thread reads /proc/self/status
every 50 ms: RssAnon and RssFile at the moment VmRSS peaks, and the dry run's step time, so the cost of an
allocator setting shows beside what it saves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def read_status(text: str) -> dict[str, int]:
    """Bytes of the resident-memory fields of a /proc/PID/status text (absent fields are 0)."""
    out = {}
    for k in FIELDS:
        m = re.search(rf"^{k}:\s+(\d+)\s*kB", text, re.M)
        out[k] = int(m.group(1)) * 1024 if m else 0
    return out


class PeakSampler:
    """Samples /proc/self/status in a thread; keeps the fields at the moment VmRSS was highest."""

    def __init__(self, every: float = 0.05):
        self.every, self.at_peak, self._stop = every, dict.fromkeys(FIELDS, 0), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            now = read_status(Path("/proc/self/status").read_text())
            if now["VmRSS"] > self.at_peak["VmRSS"]:
                self.at_peak = now
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the dense source checkpoint")
    ap.add_argument("out", help="a moeify output (read only)")
    ap.add_argument("--tokens", type=int, default=4096, help="the run the dry run stands for (default 4,096)")
    ap.add_argument("--generated", type=float, default=0.25, help="share of sampled tuning text (default 0.25)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the result here (a list of runs: --append adds to it)")
    ap.add_argument("--append", action="store_true", help="add this run to the --json file's list")
    a = ap.parse_args(argv)
    if not Path("/proc/self/status").is_file():
        ap.error("needs Linux's /proc/self/status to split the resident memory")
    import torch

    torch.set_num_threads(a.threads)
    from moeify.tuning import TuneOptions, estimate_run

    t0 = time.time()
    with PeakSampler() as s:
        r = estimate_run(a.src, a.out, TuneOptions(tokens=a.tokens, generated=a.generated), device=a.device)
    pred = r["predicted"]["peak"]
    res = {"src": a.src, "out": a.out, "tokens": a.tokens, "threads": a.threads, "device": r["device"],
           "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "seconds": round(time.time() - t0, 1),
           "step_seconds": r["step_seconds"], "measured_peak_bytes": r["peak_bytes"], "measured_what": r["peak_what"],
           "at_peak": s.at_peak, "predicted": r["predicted"], "predicted_over_measured": pred / r["peak_bytes"]}
    g = 1e9
    print(f"{'':28} {'GB':>8}")
    print(f"{'measured peak':28} {r['peak_bytes'] / g:8.2f}   ({r['peak_what']})")
    print(f"{'  anonymous at the peak':28} {s.at_peak['RssAnon'] / g:8.2f}")
    print(f"{'  file-backed at the peak':28} {s.at_peak['RssFile'] / g:8.2f}")
    print(f"{'predicted (moeify.maths.memory)':28} {pred / g:8.2f}   ({pred / r['peak_bytes']:.2f} of measured)")
    print(f"{'  of it the teacher':28} {r['predicted']['teacher'] / g:8.2f}")
    print(f"step {r['step_seconds']:.2f} s ({a.threads} thread(s)); MALLOC_MMAP_THRESHOLD_="
          f"{res['malloc_mmap_threshold'] or 'unset (glibc dynamic)'}")
    if a.json:
        p = Path(a.json)
        runs = json.loads(p.read_text()) if a.append and p.is_file() else []
        p.write_text(json.dumps(runs + [res], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
