"""Decode speed on a GPU: the presets' carves against their dense source in transformers bf16, batch 1 and 16, under
each experts backend transformers has, inside a time budget (one call of the device tool).

    python3 scripts/bench_gpu_decode.py --json decode.json                       # on the device machine, ~6 min
    python3 scripts/bench_gpu_decode.py --shapes llama3.2-1b,llama3-8b --budget-s 540 --json decode.json

Per shape (synthetic weights made on the machine by scripts/make_synthetic_checkpoint.py, bf16 as the models are
published: speed does not depend on the weights; SmolLM2's tokenizer is not needed, token ids are random), the two
presets are carved weight-only (`moeify convert --weight-only --preset active-50 | active-25`, the layouts they
resolve to at that shape), and each model decodes greedily --new tokens after --prompt, with the KV cache:

- `eager`: transformers' per-expert loop (experts_implementation="eager"), dynamic cache;
- `grouped_mm`: transformers' default; on a GPU `generate()` switches decoding to `batched_mm` by itself;
- `batched_mm`: asked for explicitly, dynamic cache;
- `batched_mm static+compile`: a static cache, which makes `generate()` compile the forward (torch.compile,
  mode reduce-overhead: CUDA graphs);
- `gather static+compile`: this program's experts backend (gather_experts_forward, registered with transformers'
  ExpertsInterface as "gather"), compiled alike: each token's chosen experts read from the stacked weights inside
  the products, which torch.compile fuses into one reduction kernel a projection (a GEMV over the chosen experts'
  rows), where batched_mm first copies the chosen experts' weights (reading them twice and writing them once) and
  then multiplies; for decoding a few sequences at a time (each token reads its own experts).

The dense model runs with a dynamic cache and with a static cache + compile. Tokens/s = new tokens / (time of
generate(prompt + new + 1) - time of generate(prompt + 1)), median of --rounds, after one warm-up (which is also
when compile happens). Rows are written to --json after each model, so a call cut short returns what it measured;
a configuration that fails records its error and the next one runs. On a CPU (`--device cpu --quick`,
tests/test_bench_gpu.py) the same steps run at a tiny size, compile left out (transformers compiles only on
accelerators).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("eager", "grouped_mm", "batched_mm", "batched_mm static+compile", "gather static+compile")


GATHER_MAX_TOKENS = 64  # more tokens at once (a prompt's prefill): transformers' grouped_mm instead


def gather_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden (T, H), chosen experts (T, k), their weights (T, k)) -> (T, H), with
    each chosen expert's weights indexed inside an elementwise product and a sum (accumulated in float32), so that
    torch.compile makes the gather part of the reduction's loads: no copy of the chosen weights, as batched_mm
    makes. Eager, it computes the same (slowly: the gathered weights are materialised, T x k experts' worth, which is
    why more than GATHER_MAX_TOKENS tokens, a prompt's prefill, go to transformers' grouped_mm)."""
    t, k = top_k_index.shape
    if t > GATHER_MAX_TOKENS:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    x = hidden_states.float()
    up = self.gate_up_proj if self.has_gate else self.up_proj
    w = up[top_k_index].float()  # (T, k, 2I, H), or (T, k, H, 2I) transposed
    h = (w * x[:, None, :, None]).sum(-2) if self.is_transposed else (w * x[:, None, None, :]).sum(-1)
    if self.has_bias:
        h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[top_k_index].float()
    h = h.reshape(t * k, -1).to(hidden_states.dtype)
    h = (self._apply_gate(h) if self.has_gate else self.act_fn(h)).reshape(t, k, -1).float()
    d = self.down_proj[top_k_index].float()  # (T, k, H, I), or (T, k, I, H) transposed
    out = (d * h[:, :, None, :]).sum(-1) if not self.is_transposed else (d * h[:, :, :, None]).sum(-2)
    if self.has_bias:
        out = out + self.down_proj_bias[top_k_index].float()
    return (out * top_k_weights.float()[:, :, None]).sum(1).to(hidden_states.dtype)


def register_gather() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("gather", gather_experts_forward)
DENSE = ("dynamic", "static+compile")


def make(path: Path, shape: str, quick: bool, layers: int = 0) -> Path:
    if not (path / "config.json").is_file():
        extra = ["--layers", "2", "--hidden", "64", "--intermediate", "512", "--heads", "4", "--kv-heads", "2",
                 "--vocab", "512", "--dtype", "float32"] if quick else ["--dtype", "bfloat16"]
        if layers:
            extra += ["--layers", str(layers)]
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py"), str(path),
                        "--shape", shape, *extra], check=True, stdout=subprocess.DEVNULL)
    return path


def carve(src: Path, preset: str, out: Path) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "moeify", "convert", str(src), str(out), "--preset", preset,
                        "--weight-only", "--overwrite"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def speed(path: Path, config: str, device: str, dtype: torch.dtype, batch: int, prompt: int, new: int,
          rounds: int) -> float:
    """Median greedy decode tokens/s of one model under one configuration (per sequence: batch × this is the
    throughput)."""
    from transformers import AutoModelForCausalLM

    impl = config.split()[0]
    if impl == "gather":
        register_gather()
    kw = {"experts_implementation": impl} if impl in ("eager", "grouped_mm", "batched_mm", "gather") else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    static = "static" in config
    gen = {"cache_implementation": "static"} if static else {}
    if static and device == "cpu":
        gen["disable_compile"] = True  # transformers compiles on accelerators only; the CPU run checks the rest

    def run(n: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **gen)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(new + 1)  # warm-up, and the compile where there is one
    speeds = [new / (run(new + 1) - run(1)) for _ in range(rounds)]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(speeds)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b,llama3-8b", help="scripts/make_synthetic_checkpoint.py shapes")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="the carves' experts backends, comma-separated "
                    f"(of: {', '.join(BACKENDS)}); the dense model runs with the caches they use")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of every shape (0: the shape's own)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny models and counts (the CPU test)")
    ap.add_argument("--budget-s", type=float, default=540, help="start no model past this many seconds")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "gpu_decode")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.quick:
        args.prompt, args.new, args.rounds = 8, 4, 1
    batches = [int(b) for b in args.batches.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in backends if b not in BACKENDS]:
        ap.error(f"--backends: unknown {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    dense_caches = [c for c in DENSE if any(("static" in b) == ("static" in c) for b in backends)]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else None
    import transformers

    out = {"device": gpu or args.device, "dtype": str(dtype), "torch": torch.__version__,
           "transformers": transformers.__version__, "prompt": args.prompt, "new": args.new, "rounds": args.rounds,
           "rows": {}, "errors": {}, "skipped": []}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))

    args.work.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        if time.monotonic() - t0 > args.budget_s:
            out["skipped"].append(shape)
            save()
            continue
        try:
            label = shape + (f"-{args.layers}l" if args.layers else "")
            dense = make(args.work / label, shape, args.quick, args.layers)
            models = {"dense": dense, **{p: carve(dense, p, args.work / f"{label}-{p}")
                                         for p in ("active-50", "active-25")}}
        except subprocess.CalledProcessError as e:
            out["errors"][shape] = str(e)
            save()
            continue
        for name, path in models.items():
            for config in (dense_caches if name == "dense" else backends):
                for batch in batches:
                    key = f"{label} | {name} | {config} | batch {batch}"
                    if time.monotonic() - t0 > args.budget_s:
                        out["skipped"].append(key)
                        continue
                    try:
                        tok_s = speed(path, config, args.device, dtype, batch, args.prompt, args.new, args.rounds)
                        out["rows"][key] = tok_s
                        cache = "static+compile" if "static" in config else "dynamic"
                        base = out["rows"].get(f"{label} | dense | {cache} | batch {batch}")
                        print(f"{key}: {tok_s:.1f} tok/s" + (f" ({tok_s / base:.2f}x dense)" if base else ""),
                              flush=True)
                    except Exception as e:  # noqa: BLE001 - a backend this transformers or device lacks
                        out["errors"][key] = f"{type(e).__name__}: {e}"[-1000:]
                    save()
    save()


if __name__ == "__main__":
    main()
