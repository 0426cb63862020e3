"""Quality in the dtypes people serve: perplexity of the dense model and of tuned MoE outputs in transformers at
float32, bfloat16 and float16 on the same held-out tokens, and how often the lower precision changes a routing
choice.

    python scripts/bench_dtypes.py models/smollm2-135m OUT1 OUT2 --json results/conversion/dtypes-smollm2.json

Each model is loaded with AutoModelForCausalLM (the real output format), cast to the dtype and scored on the first
--eval-tokens tokens of each text in non-overlapping windows of --seq-len (scripts/bench_quality.py's perplexity,
the log-softmax in float32). The MoE's ratio is to the dense model in the same dtype, so the column "vs float32"
is what serving in that dtype costs the carve beyond what it costs the dense model. Routing flips: the share of
(token, MoE layer) pairs whose top-k expert set differs from float32's on the same windows in at least one expert
("sets"), and the share of the chosen experts that differ ("experts": with top-16 a set differs whenever the 16th
and 17th experts swap). The hidden states entering each router already differ: that is what a server sees.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_curve import TEXTS  # noqa: E402
from bench_quality import load_moe, perplexity, tokens_of  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def routing_choices(model, ids: torch.Tensor, seq_len: int, batch: int = 8) -> list[torch.Tensor]:
    """Per MoE layer, the (tokens, k) expert indices the router chose on the windows perplexity scores."""
    from moeify.evaluation.perplexity import find_moe_layers

    layers = find_moe_layers(model)
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [m.router.register_forward_hook(lambda mod, inp, out, i=i: seen[i].append(out[2].detach().cpu()))
             for i, m in enumerate(layers)]
    n = ids.numel() // seq_len
    windows = ids[: n * seq_len].view(n, seq_len)
    try:
        for s in range(0, n, batch):
            model(windows[s:s + batch].to(model.device))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(x) for x in seen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dense", type=Path)
    ap.add_argument("checkpoints", type=Path, nargs="+")
    ap.add_argument("--eval", type=Path, nargs="+", default=TEXTS)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from moeify.evaluation.perplexity import same_topk_sets

    dtypes = args.dtypes.split(",")
    names = [p.parent.name if p.name.endswith(".txt") else p.name for p in args.eval]
    evals = {n: tokens_of(args.dense, p, args.eval_tokens) for n, p in zip(names, args.eval)}
    t0 = time.time()
    ppl: dict[str, dict[str, dict[str, float]]] = {}
    dense = AutoModelForCausalLM.from_pretrained(args.dense, dtype=torch.float32).eval()
    ppl["dense"] = {d: {n: perplexity(dense.to(DTYPES[d]), ids, args.seq_len) for n, ids in evals.items()}
                    for d in dtypes}
    del dense
    flips: dict[str, dict[str, dict[str, float]]] = {}
    for ckpt in args.checkpoints:
        name = ckpt.name
        model = load_moe(ckpt)
        ppl[name], flips[name] = {}, {}
        ref_choices = {n: routing_choices(model, ids, args.seq_len) for n, ids in evals.items()}
        for d in dtypes:
            model = model.to(DTYPES[d])
            ppl[name][d] = {n: perplexity(model, ids, args.seq_len) for n, ids in evals.items()}
            if d != "float32":
                flips[name][d] = {}
                for n, ids in evals.items():
                    got = routing_choices(model, ids, args.seq_len)
                    same = torch.cat([same_topk_sets(a, b) for a, b in zip(ref_choices[n], got)])
                    shared = torch.cat([(a[:, :, None] == b[:, None, :]).any(-1).float().mean(-1)
                                        for a, b in zip(ref_choices[n], got)])
                    flips[name][d][n] = {"sets": 1.0 - same.float().mean().item(),
                                         "experts": 1.0 - shared.mean().item()}
            print(f"{name} {d}: " + ", ".join(f"{n} {p:.3f}" for n, p in ppl[name][d].items()), flush=True)
        del model
    rows = []
    for ckpt in args.checkpoints:
        name = ckpt.name
        for d in dtypes:
            for n in names:
                ratio = ppl[name][d][n] / ppl["dense"][d][n]
                ratio32 = ppl[name]["float32"][n] / ppl["dense"]["float32"][n]
                rows.append({"checkpoint": name, "dtype": d, "text": n, "ppl": ppl[name][d][n],
                             "dense_ppl": ppl["dense"][d][n], "ratio": ratio, "vs_float32": ratio / ratio32 - 1,
                             "routing_flips": flips[name].get(d, {}).get(n, {"sets": 0.0, "experts": 0.0})})
    print(f"\n{'checkpoint':<16} {'dtype':<9} {'text':<14} {'× dense':>8} {'vs f32':>8} {'sets':>7} {'experts':>7}")
    for r in rows:
        f = r["routing_flips"]
        print(f"{r['checkpoint'][:16]:<16} {r['dtype']:<9} {r['text'][:14]:<14} {r['ratio']:>8.4f} "
              f"{r['vs_float32']:>+8.2%} {f['sets']:>7.2%} {f['experts']:>7.2%}")
    result = {"dense": str(args.dense), "checkpoints": [str(c) for c in args.checkpoints],
              "eval": {n: str(p) for n, p in zip(names, args.eval)},
              "eval_tokens": {n: int(ids.numel()) for n, ids in evals.items()}, "seq_len": args.seq_len,
              "threads": torch.get_num_threads(), "seconds": round(time.time() - t0, 1), "ppl": ppl, "rows": rows,
              "command": "python " + " ".join(sys.argv)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
