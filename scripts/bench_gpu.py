"""The GPU rows of BENCHMARKS.md in one command, inside a time budget (one call of the device tool: 10 minutes):

    .venv/bin/python scripts/bench_gpu.py --json results/gpu/bench-gpu.json

Steps, most wanted first; a step that fails is recorded (its error in the JSON) and the next one runs; a step that
would start past --budget-s is skipped, so a budgeted run always returns what it measured:

1. calibrated conversion on the GPU (`moeify convert --no-tune`, seconds) of both presets, per shape: the Llama-3.2-1B
   shape, SmolLM2-135M, and Llama-3-8B's widths (its hidden size, d_ff, heads, at --layers-8b layers: the memory
   model at the users' widths, in the time one call has);
2. tuning (`moeify tune --dry-run`): tokens/s, the peak GPU memory (torch.cuda.max_memory_allocated) beside the
   memory model's prediction, per shape;
3. decode tokens/s of both presets' layouts against dense in transformers bf16 (greedy, KV cache), with
   transformers' default experts kernel (grouped_mm) and its eager loop;
4. real tuning runs on the 8B-width shape plain and with `--offload` (FSDP2 CPU offload): s per 1,024 tokens, the
   run's peak GPU memory and the memory model's prediction for that run;
5. the 50% preset's tokens -> quality curve on SmolLM2 (continued `moeify tune` runs, doubling the total up to
   --curve-tokens, or with --curve-points single runs of the given totals and the floor they approach fitted,
   ratio = r_inf + c * tokens^-b; --mix-check: one more run with sampled text in place of repeated real text; each
   scored by scripts/bench_curve.py on the held-out texts) -- only with the real weights (--curve-only: this step
   alone, e.g. once scripts/device_carry.py has brought the model to a device machine).

--speed-only (the speed rows of the GPU-speed issue, one call of a few minutes): for SmolLM2's shape and the 8B
widths, the tuning step of a --speed-tokens run (`tune --dry-run`: its steps as the run sizes them, and the whole
run's time as it prices it) with the grouped MoE kernel under torch.compile (a GPU run's default: the teacher's and
student's forwards compiled, inductor), its sampling rate and MFU by its FLOPs (teacher forward 2N + student forward
and backward 6N of the active weights), beside a dense bf16 training step of the same model at the same tokens a
step (compiled, fused AdamW, SDPA; its MFU by 6N) and the ratio of their times a token. Each row is its own
budgeted step, most wanted first: SmolLM2's 50% preset and the dense step, the sampling rate, the 25% preset, the
8B widths with their dense step; then the 50% preset eager and with the masked kernel (MOEIFY_MOE_KERNEL,
MOEIFY_COMPILE_MODEL); after the sampling rate, one step of the first row under torch's profiler
(scripts/profile_tune_step.py: its kernels' time by kind, and how long the GPU sat idle). Each dry run costs about
70 s on an H200 (start, loading, a batch of sampling, compiling).

The device run of that issue, prepared: `--speed-only --offline` (no model to carry: SmolLM2's shape with synthetic
weights, the speed does not depend on them), then, with the real model carried (scripts/device_carry.py),
`--curve-only --curve-points 1048576,4194304,16777216 --mix-check 4194304 --budget-s 540`.

Where the real SmolLM2 is absent and cannot be fetched (--offline; a device machine reaches no package index, and
its 270 MB do not fit what a call carries), SmolLM2's shape is built with synthetic weights (speed and memory do
not depend on the weights; the curve does, so it is skipped). The Llama shapes are synthetic in any case
(scripts/make_synthetic_checkpoint.py, bf16 as those models are published, SmolLM2's tokenizer and vocabulary).

Every step is the real command line (`python -m moeify ...`) and the rows land in one JSON, written after each step.
CI runs it on the CPU with a tiny model and tiny budgets (`--device cpu --quick`, tests/test_bench_gpu.py) so that
it does not rot while no GPU is at hand: the numbers of that run mean nothing, only that every step still works.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
T0 = time.time()


class Budget:
    def __init__(self, seconds: float):
        self.end = T0 + seconds

    def left(self) -> float:
        return self.end - time.time()


def moeify(budget: Budget, *args: str, json_out: bool = False, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "moeify", *args]
    t0 = time.time()
    try:
        res = subprocess.run(cmd + (["--json", "-"] if json_out else []), capture_output=True, text=True, cwd=ROOT,
                             timeout=max(10.0, budget.left()), env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)}: stopped at the time budget") from e
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout[res.stdout.index("{"):]) if json_out else {}
    out["wall_s"] = time.time() - t0
    return out


def script(budget: Budget, name: str, *args: str) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=max(10.0, budget.left()))
    if res.returncode:
        raise RuntimeError(f"{name} failed ({res.returncode}):\n{res.stderr[-3000:]}")


def decode_speed(path: Path, device: str, dtype: torch.dtype, prompt: int, new: int, rounds: int,
                 experts: str | None = None) -> float:
    """Greedy decode tokens/s at batch 1 (scripts/bench_gpu_decode.py's timing), median of rounds."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gpu_decode import speed

    return speed(path, experts or "default", device, dtype, 1, prompt, new, rounds)


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}  # dense, no sparsity


# the tuning step's variants timed side by side: the MoE block's kernel, and the forwards through torch.compile;
# the first is what a run on a GPU takes (moeify.distill: grouped, compiled)
KERNEL_VARIANTS = (("grouped", True), ("grouped", False), ("masked", False))


def peak_flops(name: str) -> float | None:
    """The GPU's dense bf16 peak (vendor figures, SXM parts) by its name, None when not in PEAK_BF16."""
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def matmul_params(config: dict, active_ffn: float = 1.0) -> float:
    """Weights a token multiplies through (attention, FFN x active_ffn, the head; not the embedding lookup)."""
    h, L, f = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    attn = h * hd * (2 * heads + 2 * kv)
    return L * (attn + 3 * h * f * active_ffn) + config["vocab_size"] * h


def dense_step_speed(path: Path, device: str, step_tokens: int, seq: int, micro: int, steps: int) -> dict:
    """A good dense training step of the same model at the same tokens a step, as the reference a tuning step is
    measured against: float32 master weights under bf16 autocast (as tuning runs), SDPA attention, the model
    compiled (torch.compile, on a GPU), fused AdamW, cross-entropy on next tokens, micro-batches of `micro` windows
    accumulated. Tokens/s over `steps` steps after two warm-up steps (compilation), and MFU by the 6N rule."""
    from transformers import AutoModelForCausalLM

    cuda = device.startswith("cuda")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    fwd = torch.compile(model) if cuda else model
    windows = max(1, step_tokens // seq)
    ids = torch.randint(0, model.config.vocab_size, (windows, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def step() -> None:
        for mb in ids.split(max(1, micro)):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                loss = fwd(input_ids=mb, labels=mb).loss * (mb.shape[0] / windows)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    rate = windows * seq * steps / seconds
    flops = 6 * matmul_params(model.config.to_dict())
    peak = peak_flops(torch.cuda.get_device_name()) if cuda else None
    del model, fwd, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_per_second": rate, "step_tokens": windows * seq, "micro_windows": micro, "steps": steps,
            "seconds": seconds, "cpu_seconds": time.process_time() - c0, "flops_per_token": flops,
            "mfu": flops * rate / peak if peak else None}


def sampling_speed(path: Path, device: str, batch: int, seq: int, keep_hidden: bool) -> dict:
    """Generated tokens/s of the dense model's own text as a tuning run samples it (moeify.sampling.sample_text:
    windows of `seq` from 16-token prompts, a static KV cache, bf16 autocast on a GPU), one batch after a warm-up
    batch (on a GPU generate() compiles the forward with CUDA graphs where no hidden states are kept). keep_hidden:
    the teacher-pass path (the final hidden states kept, compilation off), else the teacher-in-the-loop one."""
    from transformers import AutoModelForCausalLM

    from moeify.sampling import sample_text

    cuda = device.startswith("cuda")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    prompt = min(16, seq // 4)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    sample_text(model, prompts, seq - prompt, 0, batch=batch, keep_hidden=keep_hidden, bf16=cuda)  # warm-up
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    sample_text(model, prompts, seq - prompt, 1, batch=batch, keep_hidden=keep_hidden, bf16=cuda)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_per_second": batch * (seq - prompt) / seconds, "batch": batch, "seq": seq, "seconds": seconds,
            "keep_hidden": keep_hidden}


def tuning_flops_per_token(dense_config: dict, moe_config: dict) -> float:
    """A tuning step's useful arithmetic a token: the teacher's forward (2N of the dense model) and the student's
    forward and backward (6N of its active weights: the share of FFN neurons a token uses)."""
    f = dense_config["intermediate_size"]
    shared = moe_config.get("shared_expert_intermediate_size") or 0
    width = moe_config.get("moe_intermediate_size") or moe_config.get("intermediate_size")
    active = (shared + moe_config["num_experts_per_tok"] * width) / f
    return 2 * matmul_params(dense_config) + 6 * matmul_params(dense_config, active)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m", help="the real SmolLM2-135M")
    ap.add_argument("--offline", action="store_true", help="no fetching: without --model's weights, SmolLM2's shape "
                    "with synthetic weights (and no quality curve)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer files for the synthetic shapes "
                    "[default: --model's]")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench_gpu")
    ap.add_argument("--calib", type=Path, default=CORPORA / "wikitext2" / "calib_train_200k.txt")
    ap.add_argument("--budget-s", type=float, default=3600.0, help="start no step after this many seconds")
    ap.add_argument("--layers-8b", type=int, default=4, help="decoder layers of the Llama-3-8B-width shape (0: leave "
                    "it out)")
    ap.add_argument("--big-shape", default="llama3-8b", help="the shape whose widths the large runs take "
                    "(make_synthetic_checkpoint.py's names) [llama3-8b]")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens of the synthetic shapes")
    ap.add_argument("--curve-tokens", type=int, default=8 * 2**20, help="the curve's last total of tuning tokens")
    ap.add_argument("--first-tokens", type=int, default=262144, help="the curve's first run")
    ap.add_argument("--offload-tokens", type=int, default=16384, help="tokens of the plain and offloaded tuning runs")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--eval", type=Path, nargs="+", default=None, help="held-out texts [default: bench_curve.py's "
                    "three]")
    ap.add_argument("--skip-1b", action="store_true", help="leave out the Llama-3.2-1B shape")
    ap.add_argument("--curve-only", action="store_true", help="only the 50%% carve of the real SmolLM2 and its curve "
                    "(a call after scripts/device_carry.py brought the model)")
    ap.add_argument("--speed-tokens", type=int, default=16 * 2**20, help="the run the speed rows time (its steps: "
                    "moeify.tuning.sizing.step_size) [16M tokens: 65,536-token steps]")
    ap.add_argument("--speed-only", action="store_true", help="only the speed rows: tuning step (masked and grouped "
                    "kernels) beside a dense bf16 training step of the same model and tokens, sampling, MFU")
    ap.add_argument("--curve-points", default=None, help="comma-separated token totals, each one run from the carve "
                    "(e.g. 1048576,4194304,16777216; instead of --first-tokens/--curve-tokens doublings), then "
                    "fitted: ratio = r_inf + c * tokens^-b")
    ap.add_argument("--mix-check", type=int, default=0, help="also one run of this many tokens with "
                    "--tune-generated 0.9 (sampled text in place of repeated real text), beside the curve's point "
                    "of the same tokens")
    ap.add_argument("--quick", action="store_true", help="CI: tiny budgets, only --model")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run it where `moeify tune --device cuda` works (or --device cpu --quick)")
    budget = Budget(args.budget_s)
    cuda = args.device.startswith("cuda")
    args.work.mkdir(parents=True, exist_ok=True)
    dev = ["--device", args.device]
    calib = ["--calib", str(args.calib)]
    import transformers

    results = {"device": torch.cuda.get_device_name() if cuda else "cpu",
               "device_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
               "torch": torch.__version__, "transformers": transformers.__version__, "synthetic_smollm2": False,
               "shapes": {}, "carve": {}, "tuning": {}, "decode": {}, "offload": {}, "speed": {}, "curve": [],
               "curve_fit": {}, "errors": {}, "skipped": []}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    def step(name: str, fn, *a, need: float = 20.0):
        """Run one step unless the budget is spent; record its error and go on."""
        if budget.left() < need:
            results["skipped"].append(name)
            print(f"[{time.time() - T0:5.0f} s] skipped {name}: the time budget is spent", flush=True)
            save()
            return None
        try:
            out = fn(*a)
            print(f"[{time.time() - T0:5.0f} s] {name}: {out}", flush=True)
            return out
        except Exception as e:  # noqa: BLE001 - recorded, and the next step runs
            results["errors"][name] = "".join(traceback.format_exception_only(e))[-3000:]
            print(f"[{time.time() - T0:5.0f} s] {name} FAILED: {results['errors'][name]}", flush=True)
            if not isinstance(e, (RuntimeError, subprocess.TimeoutExpired)):
                traceback.print_exc()
            return None
        finally:
            save()

    # the shapes: (name, dense checkpoint)
    real = (args.model / "config.json").is_file()
    if not real and not args.offline:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "get_smollm2.py")], check=True, cwd=ROOT)
        real = True
    tok = str(args.tokenizer or args.model)

    def synthetic(name: str, shape: str, *extra: str) -> Path:
        out = args.work / name
        if not (out / "config.json").is_file():
            script(budget, "make_synthetic_checkpoint.py", str(out), "--shape", shape, "--tokenizer", tok,
                   "--vocab", "49152", "--overwrite", *extra)
        results["shapes"][name] = json.loads((out / "config.json").read_text())
        return out

    shapes: dict[str, Path] = {}
    big = f"{args.big_shape}-widths-{args.layers_8b}l"

    def make(name: str, shape: str, *extra: str) -> None:
        p = step(f"make {name}", synthetic, name, shape, *extra)
        if p:
            shapes[name] = p

    # 1. calibrated conversion of both presets (the 8B-width shape: the 50% preset only)
    carves: dict[tuple[str, str], Path] = {}

    def carve(name: str, src: Path, preset: str) -> str:
        out = args.work / f"{name}-{preset}"
        extra = ["--calib-tokens", "2048", "--calib-seq-len", "64"] if args.quick else \
            (["--calib-tokens", str(args.calib_tokens)] if name != "smollm2-135m" or not real else [])
        r = moeify(budget, "convert", str(src), str(out), "--preset", str(ROOT / "configs" / f"{preset}.toml"),
                   *calib, *dev, "--no-tune", "--overwrite", *extra)
        report = json.loads((out / "report.json").read_text())
        cal = report.get("calibration", {})
        results["carve"].setdefault(name, {})[preset] = {
            "seconds": r["wall_s"], "convert_seconds": report.get("seconds"), "calib_tokens": cal.get("tokens"),
            "calib_device": cal.get("device"), "format": report.get("format"),
            "expert_width": report.get("expert_width"), "shared_width": report.get("shared_width"),
            "active_share": report["active_params"] / report["total_params"] if report.get("total_params") else None}
        carves[(name, preset)] = out
        return f"{r['wall_s']:.1f} s"

    # 2. tuning speed and memory (dry run) per shape, the 50% preset
    def dry(name: str) -> str:
        est = moeify(budget, "tune", str(shapes[name]), str(carves[(name, "active-50")]), "--tokens",
                     str(args.first_tokens), "--dry-run", *dev, json_out=True)
        row = {k: est.get(k) for k in ("tokens_per_second", "step_seconds", "step_tokens", "offload", "peak_bytes",
                                       "peak_what", "host_peak_bytes", "sampling_seconds_per_1k",
                                       "teacher_pass_seconds",
                                       "estimated_seconds")}
        row["predicted_peak_bytes"] = est["predicted"]["peak"]
        row["predicted"] = est["predicted"]
        results["tuning"][name] = row
        return (f"{est['tokens_per_second']:,.0f} tok/s, peak {est['peak_bytes'] / 1e9:.2f} GB measured, "
                f"{est['predicted']['peak'] / 1e9:.2f} GB predicted")

    # 3. decode speed in transformers (bf16 on a GPU)
    dtype = torch.bfloat16 if cuda else torch.float32
    prompt, new, rounds = (16, 8, 1) if args.quick else (128, 128, 3)

    def decode(name: str) -> str:
        row = results["decode"].setdefault(name, {})
        row["dense"] = decode_speed(shapes[name], args.device, dtype, prompt, new, rounds)
        for preset in ("active-50", "active-25"):
            if (name, preset) in carves:
                for impl in ("grouped_mm", "eager"):
                    try:
                        row[f"{preset} {impl}"] = decode_speed(carves[(name, preset)], args.device, dtype, prompt,
                                                               new, rounds, experts=impl)
                    except Exception as e:  # noqa: BLE001 - an experts kernel this transformers lacks
                        row[f"{preset} {impl}"] = None
                        results.setdefault("decode_errors", {})[f"{name} {preset} {impl}"] = str(e)[-1000:]
        save()
        return ", ".join(f"{k} {v:.1f} tok/s ({v / row['dense']:.2f}x)" for k, v in row.items() if v)

    # 4. plain and offloaded tuning runs on the largest shape
    def tune_run(name: str, mode: str) -> str:
        run_dir = args.work / f"offload-{mode.strip('-')}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(["cp", "-r", str(carves[(name, "active-50")]), str(run_dir)], check=True)
        r = moeify(budget, "tune", str(shapes[name]), str(run_dir), "--tokens", str(args.offload_tokens), mode, *dev,
                   json_out=True)
        run = r["tuning"]["runs"][-1]
        results["offload"]["model"] = name
        results["offload"][mode.strip("-")] = {**{k: run.get(k) for k in (
            "seconds_per_1k_tokens", "peak_bytes", "peak_what", "predicted_peak_bytes", "host_peak_bytes",
            "predicted_host_bytes", "teacher_bytes",
            "holdout_kl_before", "holdout_kl_after", "offload")}, "wall_s": r["wall_s"]}
        return (f"{run['seconds_per_1k_tokens']:.2f} s per 1,024 tokens, peak {run['peak_bytes'] / 1e9:.2f} GB, "
                f"predicted {run['predicted_peak_bytes'] / 1e9:.2f} GB, wall {r['wall_s']:.0f} s")

    # 0. speed: the tuning step (per MoE kernel, compiled or not) beside a dense bf16 training step of the same tokens
    def speed_row(name: str, preset: str, kernel: str, compiled: bool) -> str:
        row = results["speed"].setdefault(name, {"tuning": {}})
        dense_cfg = json.loads((shapes[name] / "config.json").read_text())
        moe_cfg = json.loads((carves[(name, preset)] / "config.json").read_text())
        est = moeify(budget, "tune", str(shapes[name]), str(carves[(name, preset)]), "--tokens",
                     str(args.speed_tokens), "--dry-run", *dev, json_out=True,
                     env={"MOEIFY_MOE_KERNEL": kernel, "MOEIFY_COMPILE_MODEL": "1" if compiled else "0"})
        flops = tuning_flops_per_token(dense_cfg, moe_cfg)
        peak = peak_flops(results["device"]) if cuda else None
        r = row["tuning"][f"{preset} {kernel}{' compiled' if compiled else ''}"] = {
            "moe_kernel": est.get("moe_kernel"), "compiled": est.get("compiled"),
            "tokens_per_second": est["tokens_per_second"], "step_tokens": est["step_tokens"],
            "micro_windows": est.get("micro_windows"), "teacher": est.get("teacher"),
            "peak_bytes": est["peak_bytes"], "sampling_tokens_per_second": 1024 / est["sampling_seconds_per_1k"],
            "sample_batch": est["sample_batch"], "flops_per_token": flops,
            "mfu": flops * est["tokens_per_second"] / peak if peak else None,
            # the whole --speed-tokens run as the dry run prices it (steps, sampling, teacher pass), and 1M / 10M
            "run_tokens": est["tokens"], "run_estimated_seconds": est["estimated_seconds"],
            "run_sampling_seconds": est["sampling_seconds"], "seconds_for_tokens": est.get("seconds_for_tokens"),
            "wall_s": est["wall_s"]}
        if "dense" in row:
            r["time_ratio_to_dense"] = row["dense"]["tokens_per_second"] / r["tokens_per_second"]
        return (f"{r['tokens_per_second']:,.0f} tok/s"
                + (f" ({r['time_ratio_to_dense']:.2f}x dense)" if "dense" in row else "")
                + f", a {est['tokens']:,}-token run ~{est['estimated_seconds']:.0f} s")

    def window_len(name: str) -> int:  # the tuning windows' length: the 50% carve's calibration windows
        report = json.loads((carves[(name, "active-50")] / "report.json").read_text())
        return int(report.get("calibration", {}).get("seq_len") or 512)

    def speed_dense(name: str) -> str:  # sized like the first tuning row (its step's tokens and windows a forward)
        row = results["speed"][name]
        first = next(iter(row["tuning"].values()))
        row["dense"] = dense_step_speed(shapes[name], args.device, first["step_tokens"], window_len(name),
                                        first["micro_windows"] or 1, 1 if args.quick else 4)
        for v in row["tuning"].values():  # time a token takes, tuning over dense
            v["time_ratio_to_dense"] = row["dense"]["tokens_per_second"] / v["tokens_per_second"]
        return f"{row['dense']['tokens_per_second']:,.0f} tok/s; " + ", ".join(
            f"{k} {v['time_ratio_to_dense']:.2f}x dense" for k, v in row["tuning"].items())

    def speed_sampling(name: str, keep: bool) -> str:  # the dense model's own text: inline (a GPU run's), kept hidden
        row = results["speed"][name]
        first = next(iter(row["tuning"].values()))
        batch, sseq = (2, 32) if args.quick else (first["sample_batch"], window_len(name))
        r = row.setdefault("sampling", {})["kept hidden" if keep else "inline"] = sampling_speed(
            shapes[name], args.device, batch, sseq, keep)
        return f"{r['tokens_per_second']:,.0f} tok/s"

    def speed_profile(name: str) -> str:  # where the default row's step spends its time (kernels by kind)
        first = next(iter(results["speed"][name]["tuning"].values()))
        path = args.work / f"profile-{name}.json"
        script(budget, "profile_tune_step.py", str(shapes[name]), str(carves[(name, "active-50")]), "--tokens",
               str(args.speed_tokens), *dev, "--kernel", first["moe_kernel"], "--compiled",
               "1" if first["compiled"] else "0", "--json", str(path))
        results["speed"][name]["profile"] = json.loads(path.read_text())
        step = results["speed"][name]["profile"]["step"]
        top = sorted(step["kinds"].items(), key=lambda kv: -kv[1]["share"])[:4]
        return f"{step['wall_ms']:,.0f} ms a step, GPU idle share {step['idle_share']}; " + ", ".join(
            f"{k} {v['share']:.0%}" for k, v in top)

    def carved(name: str, *presets: str) -> None:
        for preset in presets:
            if name in shapes:
                step(f"carve {name} {preset}", carve, name, shapes[name], preset, need=30)

    def offload_pair(name: str) -> None:
        if (name, "active-50") in carves:
            for mode in ("--no-offload", "--offload"):
                step(f"tune {name} {mode}", tune_run, name, mode, need=60)

    # the order: most wanted first (a spent budget skips the rest): the users' shapes (the 1B shape; the 8B widths)
    # carved, tuned (dry run), decoded, and the 8B widths tuned plain and offloaded; then SmolLM2; then the curve
    if args.curve_only and not real:
        raise SystemExit(f"--curve-only needs the real SmolLM2 at {args.model} (scripts/device_carry.py)")

    def smollm2_shape() -> None:  # the real SmolLM2, or its shape with synthetic weights
        if real:
            shapes["smollm2-135m"] = args.model
        else:
            results["synthetic_smollm2"] = True
            make("smollm2-135m", "smollm2-135m")

    def finish() -> None:
        results["seconds"] = time.time() - T0
        save()
        print(f"done in {results['seconds']:.0f} s; {len(results['errors'])} step(s) failed", flush=True)
        sys.exit(1 if results["errors"] and args.quick else 0)

    if args.speed_only:  # SmolLM2 (real or its shape) and the 8B widths: tuning step, dense step, sampling, MFU
        # most wanted first (a spent budget skips the rest): the step a GPU run takes (grouped kernel, compiled)
        # beside the dense step, the sampling rate, the 25% preset, the 8B widths; then the other kernels
        smol = "smollm2-135m"
        smollm2_shape()
        carved(smol, "active-50")

        def speeds(name: str, preset: str, *variants: tuple[str, bool]) -> None:
            for kernel, compiled in variants:
                if (name, preset) in carves:
                    step(f"speed {name} {preset} {kernel}{' compiled' if compiled else ''}", speed_row, name, preset,
                         kernel, compiled, need=60)

        speeds(smol, "active-50", KERNEL_VARIANTS[0])
        if results["speed"].get(smol, {}).get("tuning"):
            step(f"dense step {smol}", speed_dense, smol, need=40)
            step(f"sampling {smol} inline", speed_sampling, smol, False, need=30)
            step(f"profile {smol} active-50 step", speed_profile, smol, need=60)
        if not args.quick:
            carved(smol, "active-25")
            speeds(smol, "active-25", KERNEL_VARIANTS[0])
        if not args.quick and args.layers_8b:
            make(big, args.big_shape, "--layers", str(args.layers_8b))
            carved(big, "active-50")
            speeds(big, "active-50", KERNEL_VARIANTS[0])
            if results["speed"].get(big, {}).get("tuning"):
                step(f"dense step {big}", speed_dense, big, need=40)
        speeds(smol, "active-50", *KERNEL_VARIANTS[1:])
        if results["speed"].get(smol, {}).get("tuning"):
            step(f"sampling {smol} kept hidden", speed_sampling, smol, True, need=30)
        finish()
    if not (args.quick or args.skip_1b or args.curve_only):
        make("llama3.2-1b", "llama3.2-1b")
    if not (args.quick or args.curve_only) and args.layers_8b:
        make(big, args.big_shape, "--layers", str(args.layers_8b))
    carved("llama3.2-1b", "active-50")
    carved(big, "active-50")
    for name in ("llama3.2-1b", big):
        if (name, "active-50") in carves:
            step(f"tune --dry-run {name}", dry, name, need=40)
    carved("llama3.2-1b", "active-25")
    if "llama3.2-1b" in shapes:
        step("decode llama3.2-1b", decode, "llama3.2-1b", need=40)
    offload_pair(big)
    smollm2_shape()
    carved("smollm2-135m", "active-50", *(() if args.curve_only else ("active-25",)))
    if ("smollm2-135m", "active-50") in carves and not args.curve_only:
        step("tune --dry-run smollm2-135m", dry, "smollm2-135m", need=40)
    if "smollm2-135m" in shapes and not args.curve_only:
        step("decode smollm2-135m", decode, "smollm2-135m", need=40)
    if not (any(k.startswith("tune ") and "offload" in k for k in results["errors"]) or results["offload"]
            or args.curve_only):
        offload_pair(next((n for n in (big, "llama3.2-1b", "smollm2-135m") if (n, "active-50") in carves), ""))

    # 5. the tokens -> quality curve (real weights only)
    def curve() -> str:
        curve_dir = args.work / "curve-active-50"

        def fresh() -> None:  # the carve again (and no stopped run's state)
            subprocess.run(["rm", "-rf", str(curve_dir), f"{curve_dir}.moeify-tune"], check=True)
            subprocess.run(["cp", "-r", str(carves[("smollm2-135m", "active-50")]), str(curve_dir)], check=True)

        def point(tokens: int, start_fresh: bool, *extra: str) -> dict:
            """One run of `tokens` (from the carve, or continuing the last), scored on the held-out texts."""
            t0 = time.time()
            if start_fresh:
                fresh()
            r = moeify(budget, "tune", str(args.model), str(curve_dir), "--tokens", str(tokens), *extra, *dev,
                       json_out=True)
            script(budget, "bench_curve.py", str(args.model), str(curve_dir), "--eval-tokens", str(args.eval_tokens),
                   "--device", args.device, *(["--eval", *map(str, args.eval)] if args.eval else []),
                   "--json", str(args.work / "curve.json"), "--append")
            ratio = json.loads((args.work / "curve.json").read_text())["points"][-1]["ratio"]
            run = r.get("tuning", {}).get("runs", [{}])[-1]
            print(f"curve: {tokens:,} tokens {' '.join(extra)}, ratio " + " ".join(f"{v:.3f}" for v in ratio.values())
                  + f" ({r['wall_s']:.0f} s tuning)", flush=True)
            return {"tokens": tokens, "tune_wall_s": r["wall_s"], "leg_with_scoring_s": time.time() - t0,
                    "ratio": ratio, **{k: run.get(k) for k in (
                        "seconds_per_1k_tokens", "peak_bytes", "predicted_peak_bytes", "holdout_kl_before",
                        "holdout_kl_after", "train_kl_end", "batch_tokens", "micro_windows", "moe_kernel", "lr_scale",
                        "teacher", "text")}}

        def fits(tokens: int) -> bool:  # the next run's time from the last one's per token, with its scoring
            last = results["curve"][-1] if results["curve"] else None
            need = last["leg_with_scoring_s"] * tokens / last["tokens"] if last else 0.0
            if need > budget.left():
                results["skipped"].append(f"curve run of {tokens:,} tokens (~{need:.0f} s predicted, "
                                          f"{budget.left():.0f} s left)")
                return False
            return True

        if args.curve_points:  # single runs of the given totals, then the floor they approach
            for tokens in sorted(int(t) for t in args.curve_points.split(",")):
                if not fits(tokens):
                    break
                results["curve"].append(point(tokens, True))
                save()
            if args.mix_check and fits(args.mix_check):  # sampled text in place of repeated real text
                results["mix"] = {"tokens": args.mix_check, "generated": 0.9,
                                  **point(args.mix_check, True, "--tune-generated", "0.9")}
                save()
            sys.path.insert(0, str(ROOT / "scripts"))
            from fit_tuning_curve import fit_asymptote

            for text in (results["curve"][0]["ratio"] if results["curve"] else {}):
                pts = [(p["tokens"], p["ratio"][text]) for p in results["curve"]]
                if len({t for t, _ in pts}) >= 3:
                    results["curve_fit"][text] = fit_asymptote(pts)
            return f"{len(results['curve'])} points, fits: " + ", ".join(
                f"{k} r_inf {v['r_inf']:.3f} b {v['b']:.2f}" for k, v in results["curve_fit"].items())
        total, run_tokens = 0, args.first_tokens  # continued legs, each doubling the total
        while total + run_tokens <= max(args.curve_tokens, args.first_tokens) and budget.left() > 30:
            # a leg twice the last one's tokens that the budget would stop measures nothing: end here
            if results["curve"] and not fits(2 * results["curve"][-1]["tokens"]):
                break
            row = point(run_tokens, not results["curve"])
            total += run_tokens
            results["curve"].append({**row, "tokens": total})
            save()
            run_tokens = total
        return f"{len(results['curve'])} points"

    if not real:
        results["skipped"].append("curve (synthetic weights)")
    elif ("smollm2-135m", "active-50") in carves:
        (args.work / "curve.json").unlink(missing_ok=True)
        step("curve", curve, need=60)
    finish()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
