"""Where a tuning step's time goes: one step of `moeify tune --dry-run`'s (the run's own teacher, student, kernel,
compilation and step size) under torch's profiler, its time by kind of work.

    python scripts/profile_tune_step.py SRC OUT [--tokens 16777216] [--device cuda] [--json F]

On a GPU: the kernels the step launches (forward and backward of the student, the teacher's forward when it runs in
the loop, the KL, the optimizer), their time by kind (matrix products, attention, the routing's gathers and
scatters, reductions and softmaxes, elementwise work, the optimizer, copies, collectives), and how much of the
step's wall time no kernel ran at all: a step that keeps the GPU busy is bound by its arithmetic and its memory
traffic, one that leaves it idle by the CPU's launches and synchronisations (what CUDA graphs or larger kernels
remove). On a CPU: the operators' own CPU time by the same kinds.

The step profiled is the dry run's third (the first compiles, the second settles the allocator); `MOEIFY_MOE_KERNEL`
and `MOEIFY_COMPILE_MODEL` choose the variant as they do for the run (`--kernel`, `--compiled` set them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

KINDS = ("matmul", "attention", "routing", "reduction", "elementwise", "optimizer", "copy", "communication", "other")
# kernel (GPU) or operator (CPU) names, lower-cased, by the first kind whose words one contains
WORDS = (
    ("communication", ("nccl", "gloo", "c10d::")),
    ("attention", ("flash", "fmha", "sdpa", "scaled_dot_product", "attention")),
    ("optimizer", ("multi_tensor_apply", "adam", "_foreach_", "fused_sgd")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "s16816", "splitk", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "_grouped_mm", "aten::_scaled_mm")),
    ("routing", ("index", "gather", "scatter", "topk", "sort", "radix", "nonzero", "bincount", "histc", "cumsum",
                 "masked", "aten::where", "embedding", "take_along")),
    ("reduction", ("softmax", "logsumexp", "reduce", "triton_red", "triton_per", "aten::sum", "aten::mean",
                   "aten::norm", "aten::rms_norm", "_fused_rms_norm", "aten::amax", "aten::max", "aten::kl_div",
                   "layer_norm", "cross_entropy", "nll_loss")),
    ("copy", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::cat",
              "aten::stack", "aten::fill_", "aten::zero_", "aten::zeros", "catarraybatched")),
    ("elementwise", ("elementwise", "triton_poi", "aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu",
                     "aten::sigmoid", "aten::exp", "aten::neg", "aten::pow", "aten::rsqrt", "aten::tanh", "silu",
                     "aten::gelu", "aten::cos", "aten::sin", "aten::clamp")),
)


def kind_of(name: str) -> str:
    n = name.lower()
    for kind, words in WORDS:
        if any(w in n for w in words):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The time some interval covers (the union's length): how long at least one kernel ran."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def breakdown(events, cuda: bool, wall_us: float) -> dict:
    """Time by kind: on a GPU each kernel's duration (and the time no kernel ran), on a CPU each operator's self
    time (an operator inside another counts only its own part)."""
    times, counts, names = Counter(), Counter(), Counter()
    if cuda:
        spans = []
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kind_of(e.name)
                times[k] += e.time_range.elapsed_us()
                counts[k] += 1
                names[e.name[:90]] += e.time_range.elapsed_us()
                spans.append((e.time_range.start, e.time_range.end))
        busy = busy_us(spans)
    else:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
                k = kind_of(e.name)
                times[k] += e.self_cpu_time_total
                counts[k] += 1
                names[e.name] += e.self_cpu_time_total
        busy = sum(times.values())
    total = sum(times.values()) or 1.0
    return {"unit": "kernels" if cuda else "operators", "wall_ms": round(wall_us / 1e3, 2),
            "busy_ms": round(busy / 1e3, 2), "idle_share": round(max(0.0, 1 - busy / wall_us), 4) if cuda else None,
            "count": sum(counts.values()),
            "kinds": {k: {"ms": round(times[k] / 1e3, 2), "share": round(times[k] / total, 4), "count": counts[k]}
                      for k in KINDS if counts[k]},
            "top": [[n, round(t / 1e3, 3)] for n, t in names.most_common(12)]}


def profile_step(src: Path, out: Path, tokens: int, device: str, warm: int = 2) -> tuple[dict, dict]:
    """(the dry run's estimate, the breakdown of its step `warm` + 1) for `moeify tune SRC OUT --tokens N`."""
    from torch.profiler import ProfilerActivity, profile

    from moeify.training.distill import set_step_hook
    from moeify.tuning import TuneOptions, estimate_run

    cuda = device.startswith("cuda")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    wall = {}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def hook(student, step, seen):  # after each optimizer step (its time is not the run's)
        if step == warm:
            sync()
            prof.start()
            wall["t0"] = time.perf_counter()
        elif step == warm + 1:
            sync()
            wall["t1"] = time.perf_counter()
            prof.stop()

    set_step_hook(hook)
    try:
        est = estimate_run(src, out, TuneOptions(tokens=tokens), device=device, steps=warm + 2)
    finally:
        set_step_hook(None)
    if "t1" not in wall:
        raise SystemExit("the dry run took fewer steps than the profile needs")
    return est, breakdown(prof.events(), cuda, (wall["t1"] - wall["t0"]) * 1e6)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the dense model")
    ap.add_argument("out", type=Path, help="its carve (a moeify output)")
    ap.add_argument("--tokens", type=int, default=16 * 2**20, help="the run whose step is profiled (its step size: "
                    "moeify.tuning.sizing.step_size) [16M]")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernel", choices=("masked", "grouped"), default=None, help="MOEIFY_MOE_KERNEL [the run's]")
    ap.add_argument("--compiled", choices=("0", "1"), default=None, help="MOEIFY_COMPILE_MODEL [the run's]")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.kernel:
        os.environ["MOEIFY_MOE_KERNEL"] = args.kernel
    if args.compiled:
        os.environ["MOEIFY_COMPILE_MODEL"] = args.compiled
    est, got = profile_step(args.src, args.out, args.tokens, args.device)
    tok_s = est["step_tokens"] / (got["wall_ms"] / 1e3)
    print(f"one tuning step of {est['step_tokens']:,} tokens ({est['moe_kernel']} experts, "
          f"{'compiled' if est['compiled'] else 'eager'}, teacher {est['teacher']}; {args.device}): "
          f"{got['wall_ms']:,.1f} ms profiled ({tok_s:,.0f} tokens/s), {got['count']:,} {got['unit']}"
          + (f", GPU idle {got['idle_share']:.0%} of it" if got["idle_share"] is not None else ""))
    print(f"{'kind':<12}{'ms':>10}{'share':>8}{'count':>8}")
    for k, v in got["kinds"].items():
        print(f"{k:<12}{v['ms']:>10,.1f}{v['share']:>8.1%}{v['count']:>8,}")
    print("longest:")
    for name, ms in got["top"][:8]:
        print(f"  {ms:>9,.2f} ms  {name[:64]}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "src": str(args.src), "out": str(args.out), "tokens": args.tokens,
            "step_tokens": est["step_tokens"], "micro_windows": est["micro_windows"], "moe_kernel": est["moe_kernel"],
            "compiled": est["compiled"], "teacher": est["teacher"],
            "dry_run_tokens_per_second": est["tokens_per_second"], "profiled_tokens_per_second": tok_s,
            "step": got}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
