"""Where one decode step's time goes: a dense model beside its carves, one token after a prompt, with the KV cache,
in transformers, under torch's profiler.

    python scripts/profile_decode_step.py DENSE CARVE [CARVE...] [--experts batched_mm] [--device cuda] [--json F]

For each model: the kernels one decode step launches on a GPU (on a CPU, the outermost aten operators, each about
one kernel on a GPU: view-like operators left out) and their time, grouped by the module they ran in (attention,
the dense MLP, the MoE block's router and routing, shared expert and routed experts; the rest: norms, embedding,
head), each model's rows beside the dense one's. At batch 1 a 1B model's weights take well under a millisecond to read on an H200, so a decode step's
time there is the count of kernels times their launch and tail costs: the table says how many more the MoE block
launches, and in which part, which is what a fused experts kernel would remove.

The step is timed after --warmup steps; `--experts` picks transformers' experts implementation (eager, grouped_mm,
batched_mm). CUDA graphs (a static cache and torch.compile) take away the launches' CPU cost but not their count.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::t", "aten::permute",
         "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::as_strided",
         "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::lift_fresh", "aten::empty", "aten::empty_like",
         "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::split",
         "aten::chunk", "aten::narrow", "aten::contiguous", "aten::flatten", "aten::unflatten", "aten::view_as",
         "aten::split_with_sizes", "aten::unbind", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
         "aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::_has_compatible_shallow_copy_type"}
PARTS = ("attention", "router", "shared expert", "routed experts", "dense mlp", "other")


def part_of(name: str, moe: bool) -> str | None:
    """The part of a decoder a module's work belongs to, by its qualified name (Llama / Qwen2-MoE / Mixtral names);
    None for modules not marked. An MoE block's own glue (softmax, top-k, the weighted sum) counts as routing."""
    tail = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
    if tail == "self_attn":
        return "attention"
    if tail in ("mlp", "block_sparse_moe"):
        return "router" if moe else "dense mlp"
    if tail in ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate"):
        return "router"
    if tail == "mlp.shared_expert":
        return "shared expert"
    if tail in ("mlp.experts", "block_sparse_moe.experts"):
        return "routed experts"
    return None


def profile(path: Path, experts: str, device: str, dtype: torch.dtype, prompt: int, warmup: int) -> dict:
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile
    from transformers import AutoModelForCausalLM, DynamicCache

    config = json.loads((path / "config.json").read_text())
    moe = bool(config.get("num_experts") or config.get("num_local_experts"))
    kw = {"experts_implementation": experts} if moe else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device).eval()
    hooks = [(mod, part) for name, mod in model.named_modules() if (part := part_of(name, moe))]
    ranges = {}

    def enter(part):
        def pre(mod, args, kwargs=None):
            ranges[id(mod)] = record_function(f"part::{part}")
            ranges[id(mod)].__enter__()
        return pre

    def leave(mod, args, out):
        r = ranges.pop(id(mod), None)
        if r is not None:
            r.__exit__(None, None, None)
    handles = []
    for mod, part in hooks:
        handles += [mod.register_forward_pre_hook(enter(part)), mod.register_forward_hook(leave)]
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    cuda = device.startswith("cuda")

    def step(prof=None):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            if cuda:
                torch.cuda.synchronize()
            if prof is not None:
                prof.start()
            model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            if cuda:
                torch.cuda.synchronize()
            if prof is not None:
                prof.stop()

    for _ in range(warmup):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = torch_profile(activities=acts)
    step(prof)
    for h in handles:
        h.remove()
    events = prof.events()
    counts, times = Counter(), Counter()
    # each operator's part: the innermost part:: range enclosing it on its thread
    part_ranges = sorted(((e.time_range.start, e.time_range.end, e.name[6:]) for e in events
                          if e.name.startswith("part::")), key=lambda r: (r[0], -r[1]))

    def enclosing(t0: float) -> str:
        best = "other"
        for s, e, p in part_ranges:
            if s <= t0 <= e:
                best = p  # later starts are inner ranges
            elif s > t0:
                break
        return best

    if cuda:  # kernels, each attributed to the operator that launched it
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::") and e.kernels:
                p = enclosing(e.time_range.start)
                counts[p] += len(e.kernels)
                times[p] += sum(k.duration for k in e.kernels)
    else:  # the outermost aten operators (one inside another is its implementation), view-like ones left out
        for e in events:
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            if e.name.startswith("aten::") and parent is None and e.name not in VIEWS:
                p = enclosing(e.time_range.start)
                counts[p] += 1
                times[p] += e.cpu_time_total
    return {"kernels" if cuda else "operators": dict(counts), "us": {k: round(v, 1) for k, v in times.items()},
            "total": sum(counts.values()), "total_us": round(sum(times.values()), 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+", help="the dense model first, then its carves")
    ap.add_argument("--experts", default="batched_mm", help="transformers' experts implementation (or gather: "
                    "scripts/bench_gpu_decode.py's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.experts == "gather":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_gpu_decode import register_gather

        register_gather()
    dtype = getattr(torch, args.dtype)
    rows = {}
    for path in args.models:
        rows[path.name] = profile(path, args.experts, args.device, dtype, args.prompt, args.warmup)
    unit = "kernels" if args.device.startswith("cuda") else "operators"
    layers = json.loads((args.models[0] / "config.json").read_text())["num_hidden_layers"]
    print(f"one decode step, {unit} by part ({layers} layers; {args.experts}; {args.device} {args.dtype}):")
    print(f"{'part':<16}" + "".join(f"{p.name[-18:]:>20}" for p in args.models))
    for part in PARTS:
        print(f"{part:<16}" + "".join(f"{rows[p.name][unit].get(part, 0):>10} {rows[p.name]['us'].get(part, 0):>7.0f}us"
                                      for p in args.models))
    print(f"{'total':<16}" + "".join(f"{rows[p.name]['total']:>10} {rows[p.name]['total_us']:>7.0f}us"
                                    for p in args.models))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
                                         else "cpu", "experts": args.experts, "dtype": args.dtype,
                                         "prompt": args.prompt, "layers": layers, "unit": unit, "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
