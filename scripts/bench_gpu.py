"""The GPU rows of BENCHMARKS.md in one command (about 10 minutes on one H100-class GPU):

    .venv/bin/python scripts/bench_gpu.py --json scripts/bench_gpu_results.json

1. the 50% and 25% presets carved from SmolLM2-135M on the GPU (`moeify convert --no-tune`; seconds);
2. tuning on the GPU, per model: `moeify tune --dry-run` (tokens/s, measured peak GPU memory with
   torch.cuda.max_memory_allocated, the memory model's prediction), for SmolLM2 and the Llama-3.2-1B shape
   (synthetic weights: speed and memory only);
3. the 50% preset's tokens -> quality curve on SmolLM2: continued `moeify tune` runs (262,144 tokens, then doubling
   the total up to --curve-tokens, 8M by default), each written output scored against dense on the three held-out
   texts (scripts/bench_curve.py);
4. decode tokens/s of both presets' layouts against dense in transformers bf16 on the GPU (greedy, KV cache);
5. offloaded tuning (`--offload`, FSDP2 CPU offload) against plain tuning on the largest shape: s per 1,024 tokens
   and the run's peak GPU memory.

Every step is the real command line (`python -m moeify ...`) and the rows land in one JSON. CI runs it on the CPU
with a tiny model and tiny budgets (`--device cpu --quick`, tests/test_bench_gpu.py) so that it does not rot while no
GPU is at hand: the numbers of that run mean nothing, only that every step still works.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"


def moeify(*args: str, json_out: bool = False) -> dict | None:
    cmd = [sys.executable, "-m", "moeify", *args]
    t0 = time.time()
    res = subprocess.run(cmd + (["--json", "-"] if json_out else []), capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout[res.stdout.index("{"):]) if json_out else {}
    out["wall_s"] = time.time() - t0
    return out


def decode_speed(path: Path, device: str, dtype: torch.dtype, prompt: int, new: int, rounds: int) -> float:
    """Greedy decode tokens/s (generate(new + 1) minus generate(1), per new token), median of rounds."""
    import statistics

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)

    def run(n: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    speeds = [new / (run(new + 1) - run(1)) for _ in range(rounds)]
    del model
    return statistics.median(speeds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench_gpu")
    ap.add_argument("--calib", type=Path, default=CORPORA / "wikitext2" / "calib_train_200k.txt")
    ap.add_argument("--curve-tokens", type=int, default=8 * 2**20, help="the curve's last total of tuning tokens")
    ap.add_argument("--first-tokens", type=int, default=262144, help="the curve's first run")
    ap.add_argument("--offload-tokens", type=int, default=32768, help="tokens of the plain and offloaded tuning runs")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--eval", type=Path, nargs="+", default=None, help="held-out texts [default: bench_curve.py's "
                    "three]")
    ap.add_argument("--skip-1b", action="store_true", help="leave out the Llama-3.2-1B shape")
    ap.add_argument("--quick", action="store_true", help="CI: tiny budgets, the 1B shape left out")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run it where `moeify tune --device cuda` works (or --device cpu --quick)")
    if not (args.model / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "get_smollm2.py")], check=True, cwd=ROOT)
    args.work.mkdir(parents=True, exist_ok=True)
    dev = ["--device", args.device]
    calib = ["--calib", str(args.calib)]
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "model": str(args.model), "carve": {}, "tuning": {}, "curve": [], "decode": {}}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    carves = {}
    for preset in ("active-50", "active-25"):
        out = args.work / f"{args.model.name}-{preset}"
        extra = ["--calib-tokens", "2048", "--calib-seq-len", "64"] if args.quick else []
        r = moeify("convert", str(args.model), str(out), "--preset", str(ROOT / "configs" / f"{preset}.toml"),
                   *calib, *dev, "--no-tune", "--overwrite", *extra)
        carves[preset] = out
        results["carve"][preset] = {"seconds": r["wall_s"]}
        print(f"carved {preset} in {r['wall_s']:.1f} s", flush=True)
        save()
    shapes = [("smollm2-135m", args.model, carves["active-50"])]
    if not (args.quick or args.skip_1b):
        l1b = args.work / "llama3.2-1b"
        if not (l1b / "config.json").is_file():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py"), str(l1b),
                            "--shape", "llama3.2-1b", "--dtype", "float32", "--tokenizer", str(args.model),
                            "--vocab", "49152"], check=True, cwd=ROOT)
        c1b = args.work / "llama3.2-1b-active-50"
        moeify("convert", str(l1b), str(c1b), "--preset", str(ROOT / "configs" / "active-50.toml"), *calib, *dev,
               "--no-tune", "--overwrite", "--calib-tokens", "16384")
        shapes.append(("llama3.2-1b (synthetic)", l1b, c1b))
    for name, src, carve in shapes:
        est = moeify("tune", str(src), str(carve), "--tokens", str(args.first_tokens), "--dry-run", *dev,
                     json_out=True)
        results["tuning"][name] = {k: est[k] for k in ("tokens_per_second", "step_seconds", "peak_bytes",
                                                       "peak_what", "sampling_seconds_per_1k", "predicted")}
        print(f"tuning {name}: {est['tokens_per_second']:,.0f} tok/s, peak {est['peak_bytes'] / 1e9:.2f} GB measured, "
              f"{est['predicted']['peak'] / 1e9:.2f} GB predicted", flush=True)
        save()
    # offloaded tuning (FSDP2 CPU offload of the student's state) against plain tuning, on the largest shape here:
    # tokens/s and the peak the run reports (torch.cuda.max_memory_allocated on a GPU)
    name, src, carve = shapes[-1]
    results["offload"] = {"model": name}
    for mode in ("--no-offload", "--offload"):
        run_dir = args.work / f"offload-{mode.strip('-')}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(["cp", "-r", str(carve), str(run_dir)], check=True)
        r = moeify("tune", str(src), str(run_dir), "--tokens", str(args.offload_tokens), mode, *dev, json_out=True)
        run = r["tuning"]["runs"][-1]
        results["offload"][mode.strip("-")] = {k: run[k] for k in ("seconds_per_1k_tokens", "peak_bytes", "peak_what",
                                                                   "holdout_kl_after", "offload")}
        print(f"tuning {name} {mode}: {run['seconds_per_1k_tokens']:.2f} s per 1,024 tokens, peak "
              f"{run['peak_bytes'] / 1e9:.2f} GB", flush=True)
        save()
    curve_dir = args.work / "curve-active-50"
    subprocess.run(["rm", "-rf", str(curve_dir)], check=True)
    subprocess.run(["cp", "-r", str(carves["active-50"]), str(curve_dir)], check=True)
    total, run_tokens = 0, args.first_tokens
    while total + run_tokens <= max(args.curve_tokens, args.first_tokens):
        r = moeify("tune", str(args.model), str(curve_dir), "--tokens", str(run_tokens), *dev)
        total += run_tokens
        score = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_curve.py"), str(args.model),
                                str(curve_dir), "--eval-tokens", str(args.eval_tokens), "--device", args.device,
                                *(["--eval", *map(str, args.eval)] if args.eval else []),
                                "--json", str(args.work / "curve.json"), "--append"], capture_output=True, text=True,
                               cwd=ROOT)
        if score.returncode:
            raise SystemExit(score.stderr[-4000:])
        point = json.loads((args.work / "curve.json").read_text())["points"][-1]
        results["curve"].append({"tokens": total, "tune_wall_s": r["wall_s"], "ratio": point["ratio"]})
        print(f"curve: {total:,} tokens, ratio " + " ".join(f"{v:.3f}" for v in point["ratio"].values()), flush=True)
        save()
        run_tokens = total  # double the total
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    prompt, new, rounds = (16, 8, 1) if args.quick else (128, 128, 3)
    for name, path in (("dense", args.model), *carves.items()):
        results["decode"][name] = decode_speed(path, args.device, dtype, prompt, new, rounds)
    d = results["decode"]["dense"]
    for name, v in results["decode"].items():
        print(f"decode {name}: {v:.1f} tok/s ({v / d:.2f}x dense)", flush=True)
    save()


if __name__ == "__main__":
    main()
