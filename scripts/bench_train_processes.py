"""Next-token training of an upcycle in one process and across processes (torchrun, gloo on the CPU): the peak
memory of a process (the largest peak RSS of any rank) against moeify.maths.memory.train_memory's prediction, and tokens
a second per process against one process. A benchmark, not CI.

    .venv/bin/python scripts/bench_train_processes.py /tmp/btp --json results/train_processes/cpu.json

Builds a random dense Llama of the given shape (scripts/make_synthetic_checkpoint.py, the bundled tiny Llama's
tokenizer), upcycles it to E4 top-2 in float32, and trains it with `moeify tune OUT --tune-text` (float32:
MOEIFY_AUTOCAST=off) for --tokens tokens with each process count in --processes, one thread a process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(work: Path, args) -> Path:
    """The dense model, its E4 top-2 upcycle (float32) and the training text, once."""
    moe = work / "moe"
    if moe.is_dir():
        return moe
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py"), str(work / "dense"),
                    "--shape", "tiny", "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
                    "--layers", str(args.layers), "--heads", "8", "--kv-heads", "2", "--vocab", "4096",
                    "--dtype", "float32", "--tokenizer", str(ROOT / "examples" / "tiny-llama"), "--overwrite"],
                   check=True)
    from moeify.upcycling.upcycle import UpcycleSettings, plan_upcycle, run_upcycle

    run_upcycle(plan_upcycle(work / "dense", UpcycleSettings(copies=4, top_k=2, symmetry="noise",
                                                             dtype="float32")), moe)
    return moe


def train(moe: Path, work: Path, processes: int, args) -> dict:
    """One run of `moeify tune OUT --tune-text` on a copy of the upcycle: its report's run record."""
    out = work / f"run-{processes}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(moe, out)
    text = ROOT / "moeify" / "data" / "calib_sample.txt"
    flags = ["tune", str(out), "--tune-text", str(text), "--tokens", str(args.tokens), "--step-tokens",
             str(args.step_tokens), "--save-every", "1e9", "--no-memory-check"]
    launch = ([sys.executable, "-m", "moeify"] if processes == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "moeify"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOEIFY_AUTOCAST": "off"}
    t0 = time.time()
    res = subprocess.run(launch + flags, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    run = json.loads((out / "report.json").read_text())["training"]["runs"][-1]
    shutil.rmtree(out, ignore_errors=True)
    return {"processes": processes, "wall_seconds": round(time.time() - t0, 1), "seconds": run["seconds"],
            "tokens": run["tokens"], "tokens_per_second": run["tokens_per_second"],
            "tokens_per_second_per_process": round(run["tokens_per_second"] / processes, 1),
            "peak_bytes": run["peak_bytes"], "peak_what": run["peak_what"],
            "largest_peak_bytes": run["largest_peak_bytes"], "predicted_peak_bytes": run["predicted_peak_bytes"],
            "peak_over_predicted": round(run["largest_peak_bytes"] / run["predicted_peak_bytes"], 3),
            "held_out_after": run["held_out_after"]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path, help="a scratch folder (the models are built there once)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--step-tokens", type=int, default=2048)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    moe = build(args.work, args)
    report = json.loads((moe / "report.json").read_text())
    rows = []
    for n in args.processes:
        rows.append(train(moe, args.work, n, args))
        print(json.dumps(rows[-1]), flush=True)
    one = next((r for r in rows if r["processes"] == 1), None)
    for r in rows:
        if one:
            r["per_process_speed_vs_one"] = round(r["tokens_per_second_per_process"] / one["tokens_per_second"], 3)
    result = {"shape": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                        "vocab": 4096, "upcycle": "E4 top-2", "total_params": report["total_params"]},
              "tokens": args.tokens, "step_tokens": args.step_tokens, "dtype": "float32", "threads_per_process": 1,
              "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
