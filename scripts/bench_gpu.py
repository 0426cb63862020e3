"""The GPU rows of BENCHMARKS.md at the users' shapes in one command, inside a time budget (one call of the device
tool: 10 minutes):

    python3 scripts/bench_gpu.py --offline --model .gpu/none --tokenizer .gpu/tok --calib .gpu/calib.txt \
        --budget-s 470 --json results/gpu/h200-synthetic-shapes.json

Steps, most wanted first (scripts/gpu_steps.py: each a real command line, recorded into one JSON after each step;
one that fails is recorded and the next runs; one that would start past --budget-s is skipped):

1. calibrated conversion on the GPU (`moeify convert --no-tune`, seconds) of both presets, per shape: the Llama-3.2-1B
   shape, SmolLM2-135M, and Llama-3-8B's widths (its hidden size, d_ff, heads, at --layers-8b layers: the memory
   model at the users' widths, in the time one call has);
2. tuning (`moeify tune --dry-run`): tokens/s, the peak GPU memory (torch.cuda.max_memory_allocated) beside the
   memory model's prediction, per shape;
3. decode tokens/s of both presets' layouts against dense in transformers bf16 (greedy, KV cache), with
   transformers' default experts kernel (grouped_mm) and its eager loop (every backend, both caches, batch 1 and
   16: scripts/bench_gpu_decode.py);
4. real tuning runs on the 8B-width shape plain and with `--offload` (FSDP2 CPU offload): s per 1,024 tokens, the
   run's peak GPU memory and the memory model's prediction for that run.

The tuning step against a dense training step is scripts/bench_gpu_speed.py; the tokens -> quality curve on the
real SmolLM2, scripts/bench_gpu_curve.py.

Where the real SmolLM2 is absent and cannot be fetched (--offline; a device machine reaches no package index, and
its 270 MB do not fit what a call carries), SmolLM2's shape is built with synthetic weights (speed and memory do
not depend on the weights). The Llama shapes are synthetic in any case (scripts/make_synthetic_checkpoint.py, bf16
as those models are published, SmolLM2's tokenizer and vocabulary).

CI runs it on the CPU with a tiny model and tiny budgets (`--device cpu --quick`, tests/test_bench_gpu.py) so that
it does not rot while no GPU is at hand: the numbers of that run mean nothing, only that every step still works.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from gpu_steps import SMOL, Bench, arguments, moeify


def decode_speed(path: Path, device: str, dtype: torch.dtype, prompt: int, new: int, rounds: int,
                 experts: str | None = None) -> float:
    """Greedy decode tokens/s at batch 1 (scripts/bench_gpu_decode.py's timing), median of rounds."""
    from bench_gpu_decode import speed

    return speed(path, experts or "default", device, dtype, 1, prompt, new, rounds)


def main() -> None:
    ap = arguments(__doc__, "bench_gpu")
    ap.add_argument("--layers-8b", type=int, default=4, help="decoder layers of the Llama-3-8B-width shape (0: leave "
                    "it out)")
    ap.add_argument("--big-shape", default="llama3-8b", help="the shape whose widths the large runs take "
                    "(make_synthetic_checkpoint.py's names) [llama3-8b]")
    ap.add_argument("--dry-tokens", type=int, default=262144, help="the run the dry runs size")
    ap.add_argument("--offload-tokens", type=int, default=16384, help="tokens of the plain and offloaded tuning runs")
    ap.add_argument("--skip-1b", action="store_true", help="leave out the Llama-3.2-1B shape")
    args = ap.parse_args()
    b = Bench(args, tuning={}, decode={}, offload={})
    res = b.results

    # 2. tuning speed and memory (dry run) per shape, the 50% preset
    def dry(name: str) -> str:
        est = moeify(b.budget, "tune", str(b.shapes[name]), str(b.carves[(name, "active-50")]), "--tokens",
                     str(args.dry_tokens), "--dry-run", *b.dev, json_out=True)
        row = {k: est.get(k) for k in ("tokens_per_second", "step_seconds", "step_tokens", "offload", "peak_bytes",
                                       "peak_what", "host_peak_bytes", "sampling_seconds_per_1k",
                                       "teacher_pass_seconds", "estimated_seconds")}
        row["predicted_peak_bytes"] = est["predicted"]["peak"]
        row["predicted"] = est["predicted"]
        res["tuning"][name] = row
        return (f"{est['tokens_per_second']:,.0f} tok/s, peak {est['peak_bytes'] / 1e9:.2f} GB measured, "
                f"{est['predicted']['peak'] / 1e9:.2f} GB predicted")

    # 3. decode speed in transformers (bf16 on a GPU)
    dtype = torch.bfloat16 if b.cuda else torch.float32
    prompt, new, rounds = (16, 8, 1) if args.quick else (128, 128, 3)

    def decode(name: str) -> str:
        row = res["decode"].setdefault(name, {})
        row["dense"] = decode_speed(b.shapes[name], args.device, dtype, prompt, new, rounds)
        for preset in ("active-50", "active-25"):
            if (name, preset) in b.carves:
                for impl in ("grouped_mm", "eager"):
                    try:
                        row[f"{preset} {impl}"] = decode_speed(b.carves[(name, preset)], args.device, dtype, prompt,
                                                               new, rounds, experts=impl)
                    except Exception as e:  # noqa: BLE001 - an experts kernel this transformers lacks
                        row[f"{preset} {impl}"] = None
                        res.setdefault("decode_errors", {})[f"{name} {preset} {impl}"] = str(e)[-1000:]
        b.save()
        return ", ".join(f"{k} {v:.1f} tok/s ({v / row['dense']:.2f}x)" for k, v in row.items() if v)

    # 4. plain and offloaded tuning runs on the largest shape
    def tune_run(name: str, mode: str) -> str:
        run_dir = args.work / f"offload-{mode.strip('-')}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(["cp", "-r", str(b.carves[(name, "active-50")]), str(run_dir)], check=True)
        r = moeify(b.budget, "tune", str(b.shapes[name]), str(run_dir), "--tokens", str(args.offload_tokens), mode,
                   *b.dev, json_out=True)
        run = r["tuning"]["runs"][-1]
        res["offload"]["model"] = name
        res["offload"][mode.strip("-")] = {**{k: run.get(k) for k in (
            "seconds_per_1k_tokens", "peak_bytes", "peak_what", "predicted_peak_bytes", "host_peak_bytes",
            "predicted_host_bytes", "teacher_bytes",
            "holdout_kl_before", "holdout_kl_after", "offload")}, "wall_s": r["wall_s"]}
        return (f"{run['seconds_per_1k_tokens']:.2f} s per 1,024 tokens, peak {run['peak_bytes'] / 1e9:.2f} GB, "
                f"predicted {run['predicted_peak_bytes'] / 1e9:.2f} GB, wall {r['wall_s']:.0f} s")

    def offload_pair(name: str) -> None:
        if (name, "active-50") in b.carves:
            for mode in ("--no-offload", "--offload"):
                b.step(f"tune {name} {mode}", tune_run, name, mode, need=60)

    # the order: most wanted first (a spent budget skips the rest): the users' shapes (the 1B shape; the 8B widths)
    # carved, tuned (dry run), decoded, and the 8B widths tuned plain and offloaded; then SmolLM2
    b.fetch_smollm2()
    big = f"{args.big_shape}-widths-{args.layers_8b}l"
    if not (args.quick or args.skip_1b):
        b.synthetic("llama3.2-1b", "llama3.2-1b")
    if not args.quick and args.layers_8b:
        b.synthetic(big, args.big_shape, "--layers", str(args.layers_8b))
    b.carved("llama3.2-1b", "active-50")
    b.carved(big, "active-50")
    for name in ("llama3.2-1b", big):
        if (name, "active-50") in b.carves:
            b.step(f"tune --dry-run {name}", dry, name, need=40)
    b.carved("llama3.2-1b", "active-25")
    if "llama3.2-1b" in b.shapes:
        b.step("decode llama3.2-1b", decode, "llama3.2-1b", need=40)
    offload_pair(big)
    b.smollm2()
    b.carved(SMOL, "active-50", "active-25")
    if (SMOL, "active-50") in b.carves:
        b.step(f"tune --dry-run {SMOL}", dry, SMOL, need=40)
    if SMOL in b.shapes:
        b.step(f"decode {SMOL}", decode, SMOL, need=40)
    if not (any(k.startswith("tune ") and "offload" in k for k in res["errors"]) or res["offload"]):
        offload_pair(next((n for n in (big, "llama3.2-1b", SMOL) if (n, "active-50") in b.carves), ""))
    b.finish()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
