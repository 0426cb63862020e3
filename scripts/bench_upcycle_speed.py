"""Upcycling speed and memory against the disk: upcycle a checkpoint, then copy the output's bytes, in one run.

    python scripts/make_synthetic_checkpoint.py /tmp/bench/l8b-8 --layers 8   # the Llama-3-8B widths, 8 layers
    python scripts/bench_upcycle_speed.py /tmp/bench/l8b-8 --work /tmp/bench/work \\
        --json results/upcycling/speed-llama3-8b-8layers.json

Rows, each from a cold page cache for the source (posix_fadvise) and up to a final `sync`:
  upcycle   `moeify upcycle SRC OUT --copies 8 --top-k 2 --symmetry S` as a subprocess, for each S given: wall
            time split into writing (the output's last shard written) and the end-of-run check, and the peak RSS
            of the whole process (os.wait4) and of the writing alone (sampled /proc/PID/status until the check
            starts)
  copy      the upcycled output copied with `dd bs=16M` per file: the output's bytes read and written, the floor
            any writer of those bytes has (an upcycle reads only the source, 1/E of them, so this is generous)
The writer is the floor: the target is upcycle writing ≤ 1.2 × the copy. The per-layer cost does not depend on the
layer count, so a shape with fewer layers (the disk of a 2-core VM holds 8 of the 8B's 32 layers upcycled to E8)
measures the full model's rate; the table says how many layers.
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
sys.path.insert(0, str(ROOT / "scripts"))

from bench_convert import checkpoint_files, copy_dd, drop_cache, gb, remove, timed  # noqa: E402


def rss_kb(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(m.group(1)) if m else 0


def upcycle(src: Path, out: Path, log: Path, symmetry: str, copies: int, top_k: int, layers: int) -> dict:
    """Run the upcycle; sample RSS every 0.2 s, the writing's peak until the log's last `writing: L/L` line."""
    import subprocess

    cmd = [sys.executable, "-m", "moeify", "upcycle", str(src), str(out), "--copies", str(copies), "--top-k",
           str(top_k), "--symmetry", symmetry]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        peak_write, peak_all, wrote_at = 0, 0, None
        done = threading.Event()

        def sample() -> None:
            nonlocal peak_write, peak_all, wrote_at
            while not done.is_set():
                r = rss_kb(proc.pid) * 1024
                peak_all = max(peak_all, r)
                if wrote_at is None:
                    peak_write = max(peak_write, r)
                    if f"writing: {layers}/{layers}" in log.read_text(errors="replace"):
                        wrote_at = time.time() - t0
                time.sleep(0.2)
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        _, status, usage = os.wait4(proc.pid, 0)
        done.set()
        thread.join()
    os.sync()
    wall = time.time() - t0
    if status:
        raise SystemExit(f"upcycle failed:\n{log.read_text()[-3000:]}")
    return {"seconds": wall, "writing_seconds": wrote_at or wall, "check_seconds": wall - (wrote_at or wall),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "peak_rss_writing_bytes": peak_write}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench/work"))
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--symmetry", default="none,drop")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    src, work = a.src.resolve(), a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    files = checkpoint_files(src)
    result = {"source": src.name, "source_bytes": sum(f.stat().st_size for f in files),
              "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"], "d_ff": cfg["intermediate_size"],
              "copies": a.copies, "top_k": a.top_k, "rows": {}, "date": time.strftime("%Y-%m-%d"),
              "cpus": os.cpu_count()}
    out = work / "moe"
    for symmetry in a.symmetry.split(","):
        remove(out)
        drop_cache(files)
        row = upcycle(src, out, work / f"upcycle-{symmetry}.log", symmetry, a.copies, a.top_k, result["layers"])
        out_files = checkpoint_files(out)
        row["output_bytes"] = sum(f.stat().st_size for f in out_files)
        copy = work / "copy"
        remove(copy)
        drop_cache(out_files)
        row["copy_seconds"] = timed(lambda: copy_dd(out, copy))
        remove(copy)
        row["writing_x_copy"] = row["writing_seconds"] / row["copy_seconds"]
        row["total_x_copy"] = row["seconds"] / row["copy_seconds"]
        result["rows"][symmetry] = row
        print(f"{symmetry}: upcycle {row['seconds']:.1f} s (writing {row['writing_seconds']:.1f} s, check "
              f"{row['check_seconds']:.1f} s), copy of the output {row['copy_seconds']:.1f} s: writing "
              f"x{row['writing_x_copy']:.2f}; peak RSS {gb(row['peak_rss_writing_bytes'])} GB writing, "
              f"{gb(row['peak_rss_bytes'])} GB in all; output {gb(row['output_bytes'])} GB", flush=True)
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    remove(out)


if __name__ == "__main__":
    main()
