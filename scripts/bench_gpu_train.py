"""Next-token training of an upcycle at the Llama-3-8B E8 top-2 shape on a GPU, in one command inside a time budget:
a few steps of `moeify tune OUT --tune-text` plain and with `--offload` (FSDP2 CPU offload), each run's peak memory
per process against moeify.maths.memory.train_memory's prediction and its tokens/s per process, in one JSON.

    python3 scripts/bench_gpu_train.py --offline --tokenizer .gpu/tok --layers 2 --budget-s 500 \
        --json results/train_processes/h200-8b-e8.json

The dense model is Llama-3-8B's published shape (config.json of meta-llama/Meta-Llama-3-8B: hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256, untied; scripts/make_synthetic_checkpoint.py's
"llama3-8b") at --layers decoder layers, with synthetic bf16 weights (speed and memory do not depend on them; any
tokenizer whose ids fit the vocabulary), upcycled by `moeify upcycle -e 8 -k 2` (E8 top-2: 1.45B parameters a
layer). Steps, in order (scripts/gpu_steps.py: each recorded into the JSON as it ends; one that fails is recorded
and the next runs; one that would start past --budget-s is skipped):

1. the dense shape and its upcycle;
2. `moeify tune MOE --tune-text TEXT --tokens T` plain: the whole model on the GPU in one process (FSDP2 across
   --processes processes when more than one, under torchrun);
3. the same with --offload: FSDP2 keeps the float32 weights, gradients and AdamW state in host memory.

Each row: the run's peak (torch.cuda.max_memory_allocated on a GPU, peak RSS on a CPU; the largest of any
process, and rank 0's), the prediction for that run (report.json's predicted_peak_bytes), their ratio, tokens/s of
the run (its held-out scoring before and after included) and per process. CI runs it on the CPU at a tiny shape (`--device cpu --quick --shape tiny`,
tests/test_bench_gpu.py) so that it does not rot while no GPU is at hand: the numbers of that run mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_steps import ROOT, Bench, arguments, script


def tune(b: Bench, moe: Path, mode: str, args) -> str:
    """One training run on a copy of the upcycle; its row in results["train"]."""
    run_dir = args.work / f"run-{mode}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    subprocess.run(["cp", "-r", str(moe), str(run_dir)], check=True)
    launch = [sys.executable, "-m", "moeify"] if args.processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.processes),
        "-m", "moeify"]
    cmd = launch + ["tune", str(run_dir), "--tune-text", str(args.text), "--tokens", str(args.tokens),
                    "--step-tokens", str(args.step_tokens), "--save-every", "1e9", *b.dev,
                    *(["--offload"] if mode == "offload" else [])]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=max(10.0, b.budget.left()),
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    run = json.loads((run_dir / "report.json").read_text())["training"]["runs"][-1]
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    row = {k: run[k] for k in ("tokens", "steps", "step_tokens", "seconds", "tokens_per_second", "peak_bytes",
                               "largest_peak_bytes", "peak_what", "predicted_peak_bytes", "processes", "offload", "device")}
    row["tokens_per_second_per_process"] = round(run["tokens_per_second"] / run["processes"], 1)
    row["peak_over_predicted"] = round(run["largest_peak_bytes"] / run["predicted_peak_bytes"], 3)
    row["wall_s"] = round(time.time() - t0, 1)
    b.results["train"][mode] = row
    return (f"{row['tokens_per_second_per_process']:,.1f} tok/s a process, peak {run['largest_peak_bytes'] / 1e9:.2f} GB, "
            f"predicted {run['predicted_peak_bytes'] / 1e9:.2f} GB (x{row['peak_over_predicted']})")


def build(b: Bench, args) -> Path:
    """The dense shape (synthetic weights) and its E8 top-2 upcycle, once."""
    dense, moe = args.work / f"{args.shape}-{args.layers}l", args.work / f"{args.shape}-{args.layers}l-e8k2"
    if not (dense / "config.json").is_file():
        extra = [f"--{k}={v}" for k, v in (("hidden", args.hidden), ("intermediate", args.intermediate),
                                            ("vocab", args.vocab)) if v]
        script(b.budget, "make_synthetic_checkpoint.py", str(dense), "--shape", args.shape, "--layers",
               str(args.layers), "--tokenizer", str(args.tokenizer or args.model), "--overwrite", *extra)
    if not (moe / "report.json").is_file():
        subprocess.run(["rm", "-rf", str(moe)], check=True)
        res = subprocess.run([sys.executable, "-m", "moeify", "upcycle", str(dense), str(moe), "-e", "8", "-k", "2",
                              "--symmetry", "noise"], capture_output=True, text=True, cwd=ROOT,
                             timeout=max(10.0, b.budget.left()))
        if res.returncode:
            raise RuntimeError(f"moeify upcycle failed ({res.returncode}):\n{res.stderr[-3000:]}")
    report = json.loads((moe / "report.json").read_text())
    b.results["shape"] = {**json.loads((moe / "config.json").read_text()), "total_params": report["total_params"]}
    return moe


def main() -> None:
    ap = arguments(__doc__, "bench_gpu_train")
    ap.add_argument("--shape", default="llama3-8b", help="make_synthetic_checkpoint.py's shape [llama3-8b]")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the shape [2]")
    for flag in ("hidden", "intermediate", "vocab"):
        ap.add_argument(f"--{flag}", type=int, default=None, help="override the shape's value (tests)")
    ap.add_argument("--text", type=Path, default=ROOT / "moeify" / "data" / "calib_sample.txt")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of each run [8192: 2 steps]")
    ap.add_argument("--step-tokens", type=int, default=4096)
    ap.add_argument("--processes", type=int, default=1, help="processes a run (torchrun), one GPU each [1]")
    ap.add_argument("--modes", default="plain,offload")
    args = ap.parse_args()
    b = Bench(args, train={})
    b.results.update({"layers": args.layers, "processes": args.processes, "tokens": args.tokens})
    moe = b.step("make the dense shape and its E8 top-2 upcycle", build, b, args, need=60)
    if moe is not None:
        for mode in args.modes.split(","):
            b.step(f"tune {mode}", tune, b, moe, mode, args, need=60)
    b.finish()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
