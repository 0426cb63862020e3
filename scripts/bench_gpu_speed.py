"""The tuning step on a GPU beside a dense training step of the same model, in one command inside a time budget
(one call of the device tool, a few minutes):

    python3 scripts/bench_gpu_speed.py --offline --model .gpu/none --tokenizer .gpu/tok --calib .gpu/calib.txt \
        --budget-s 360 --json speed.json

For SmolLM2's shape and the 8B widths, the tuning step of a --speed-tokens run (`tune --dry-run`: its steps as the
run sizes them, and the whole run's time as it prices it) with the grouped MoE kernel under torch.compile (a GPU
run's default: the teacher's and student's forwards compiled, inductor), its sampling rate and MFU by its FLOPs
(teacher forward 2N + student forward and backward 6N of the active weights), beside a dense bf16 training step of
the same model at the same tokens a step (compiled, fused AdamW, SDPA; its MFU by 6N) and the ratio of their times a
token. Each row is its own budgeted step (scripts/gpu_steps.py), most wanted first: SmolLM2's 50% preset and the
dense step, the sampling rate, one step of that row under torch's profiler (scripts/profile_tune_step.py: its
kernels' time by kind, and how long the GPU sat idle), the 25% preset, the 8B widths with their dense step; then the
50% preset eager and with the masked kernel (MOEIFY_MOE_KERNEL, MOEIFY_COMPILE_MODEL) and the teacher pass's
sampling. Each dry run costs about 70 s on an H200 (start, loading, a batch of sampling, compiling).

Without the real SmolLM2 (--offline: a device machine reaches no package index) its shape is built with synthetic
weights; the speed does not depend on them. CI runs it on the CPU at a tiny size (`--device cpu --quick`,
tests/test_bench_gpu.py): the numbers of that run mean nothing, only that every step still works.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from gpu_steps import SMOL, Bench, arguments, moeify, script

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}  # dense, no sparsity

# the tuning step's variants timed side by side: the MoE block's kernel, and the forwards through torch.compile;
# the first is what a run on a GPU takes (moeify.training.distill: grouped, compiled)
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


def tuning_flops_per_token(dense_config: dict, moe_config: dict) -> float:
    """A tuning step's useful arithmetic a token: the teacher's forward (2N of the dense model) and the student's
    forward and backward (6N of its active weights: the share of FFN neurons a token uses)."""
    f = dense_config["intermediate_size"]
    shared = moe_config.get("shared_expert_intermediate_size") or 0
    width = moe_config.get("moe_intermediate_size") or moe_config.get("intermediate_size")
    active = (shared + moe_config["num_experts_per_tok"] * width) / f
    return 2 * matmul_params(dense_config) + 6 * matmul_params(dense_config, active)
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
    """Generated tokens/s of the dense model's own text as a tuning run samples it (moeify.training.sampling.sample_text:
    windows of `seq` from 16-token prompts, a static KV cache, bf16 autocast on a GPU), one batch after a warm-up
    batch (on a GPU generate() compiles the forward with CUDA graphs where no hidden states are kept). keep_hidden:
    the teacher-pass path (the final hidden states kept, compilation off), else the teacher-in-the-loop one."""
    from transformers import AutoModelForCausalLM

    from moeify.training.sampling import sample_text

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


def main() -> None:
    ap = arguments(__doc__, "bench_gpu_speed")
    ap.add_argument("--speed-tokens", type=int, default=16 * 2**20, help="the run the speed rows time (its steps: "
                    "moeify.tuning.sizing.step_size) [16M tokens: 65,536-token steps]")
    ap.add_argument("--layers-8b", type=int, default=4, help="decoder layers of the Llama-3-8B-width shape (0: leave "
                    "it out)")
    ap.add_argument("--big-shape", default="llama3-8b", help="the shape whose widths the large rows take "
                    "(make_synthetic_checkpoint.py's names) [llama3-8b]")
    args = ap.parse_args()
    b = Bench(args, speed={})
    res, cuda = b.results, b.cuda

    def speed_row(name: str, preset: str, kernel: str, compiled: bool) -> str:
        row = res["speed"].setdefault(name, {"tuning": {}})
        dense_cfg = json.loads((b.shapes[name] / "config.json").read_text())
        moe_cfg = json.loads((b.carves[(name, preset)] / "config.json").read_text())
        est = moeify(b.budget, "tune", str(b.shapes[name]), str(b.carves[(name, preset)]), "--tokens",
                     str(args.speed_tokens), "--dry-run", *b.dev, json_out=True,
                     env={"MOEIFY_MOE_KERNEL": kernel, "MOEIFY_COMPILE_MODEL": "1" if compiled else "0"})
        flops = tuning_flops_per_token(dense_cfg, moe_cfg)
        peak = peak_flops(res["device"]) if cuda else None
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
        report = json.loads((b.carves[(name, "active-50")] / "report.json").read_text())
        return int(report.get("calibration", {}).get("seq_len") or 512)

    def speed_dense(name: str) -> str:  # sized like the first tuning row (its step's tokens and windows a forward)
        row = res["speed"][name]
        first = next(iter(row["tuning"].values()))
        row["dense"] = dense_step_speed(b.shapes[name], args.device, first["step_tokens"], window_len(name),
                                        first["micro_windows"] or 1, 1 if args.quick else 4)
        for v in row["tuning"].values():  # time a token takes, tuning over dense
            v["time_ratio_to_dense"] = row["dense"]["tokens_per_second"] / v["tokens_per_second"]
        return f"{row['dense']['tokens_per_second']:,.0f} tok/s; " + ", ".join(
            f"{k} {v['time_ratio_to_dense']:.2f}x dense" for k, v in row["tuning"].items())

    def speed_sampling(name: str, keep: bool) -> str:  # the dense model's own text: inline (a GPU run's), kept hidden
        row = res["speed"][name]
        first = next(iter(row["tuning"].values()))
        batch, sseq = (2, 32) if args.quick else (first["sample_batch"], window_len(name))
        r = row.setdefault("sampling", {})["kept hidden" if keep else "inline"] = sampling_speed(
            b.shapes[name], args.device, batch, sseq, keep)
        return f"{r['tokens_per_second']:,.0f} tok/s"

    def speed_profile(name: str) -> str:  # where the default row's step spends its time (kernels by kind)
        first = next(iter(res["speed"][name]["tuning"].values()))
        path = args.work / f"profile-{name}.json"
        script(b.budget, "profile_tune_step.py", str(b.shapes[name]), str(b.carves[(name, "active-50")]), "--tokens",
               str(args.speed_tokens), *b.dev, "--kernel", first["moe_kernel"], "--compiled",
               "1" if first["compiled"] else "0", "--json", str(path))
        res["speed"][name]["profile"] = json.loads(path.read_text())
        step = res["speed"][name]["profile"]["step"]
        top = sorted(step["kinds"].items(), key=lambda kv: -kv[1]["share"])[:4]
        return f"{step['wall_ms']:,.0f} ms a step, GPU idle share {step['idle_share']}; " + ", ".join(
            f"{k} {v['share']:.0%}" for k, v in top)

    def speeds(name: str, preset: str, *variants: tuple[str, bool]) -> None:
        for kernel, compiled in variants:
            if (name, preset) in b.carves:
                b.step(f"speed {name} {preset} {kernel}{' compiled' if compiled else ''}", speed_row, name, preset,
                       kernel, compiled, need=60)

    # most wanted first (a spent budget skips the rest): the step a GPU run takes (grouped kernel, compiled) beside
    # the dense step, the sampling rate, its profile, the 25% preset, the 8B widths; then the other kernels
    b.fetch_smollm2()
    b.smollm2()
    b.carved(SMOL, "active-50")
    speeds(SMOL, "active-50", KERNEL_VARIANTS[0])
    if res["speed"].get(SMOL, {}).get("tuning"):
        b.step(f"dense step {SMOL}", speed_dense, SMOL, need=40)
        b.step(f"sampling {SMOL} inline", speed_sampling, SMOL, False, need=30)
        b.step(f"profile {SMOL} active-50 step", speed_profile, SMOL, need=60)
    if not args.quick:
        b.carved(SMOL, "active-25")
        speeds(SMOL, "active-25", KERNEL_VARIANTS[0])
    big = f"{args.big_shape}-widths-{args.layers_8b}l"
    if not args.quick and args.layers_8b:
        b.synthetic(big, args.big_shape, "--layers", str(args.layers_8b))
        b.carved(big, "active-50")
        speeds(big, "active-50", KERNEL_VARIANTS[0])
        if res["speed"].get(big, {}).get("tuning"):
            b.step(f"dense step {big}", speed_dense, big, need=40)
    speeds(SMOL, "active-50", *KERNEL_VARIANTS[1:])
    if res["speed"].get(SMOL, {}).get("tuning"):
        b.step(f"sampling {SMOL} kept hidden", speed_sampling, SMOL, True, need=30)
    b.finish()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
