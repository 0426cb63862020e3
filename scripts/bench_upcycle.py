"""Upcycling on real models: exact at initialisation in transformers, and what each symmetry breaking costs.

    python scripts/bench_upcycle.py --model models/smollm2-135m --json results/upcycling/exactness-smollm2.json
    python scripts/bench_upcycle.py --model models/qwen2.5-coder-0.5b --dtype bfloat16 \\
        --json results/upcycling/exactness-qwen05.json

Each layout is written by the real command (`moeify upcycle SRC OUT --symmetry none ...`, timed), loaded with
AutoModelForCausalLM (its own top-k routing, float32 compute) and scored beside the dense model on the same held-out
tokens: perplexity of both, max |logit difference| over every position, and the run's own end-of-run check. The
symmetry rows upcycle E8 top-2 with drop (r = 0.5), noise and, fine-grained, permute: their KL to the dense model on
the same tokens. Outputs are removed after they are scored (an E8 copy of a 0.5B model is 5 GB in bf16).
Held-out text: WikiText-2 valid.txt (nothing here is calibrated or tuned).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
LAYOUTS = ("e8g1k2", "e8g8k8", "s25e4g2k4")  # [sP]eEgGkK: P% of d_ff shared (Qwen2-MoE), E copies, G slices, top-k
SYMMETRY = ("drop", "noise", "permute")


def parse_layout(name: str, d_ff: int) -> list[str]:
    m = re.fullmatch(r"(?:s(\d+))?e(\d+)g(\d+)k(\d+)", name)
    if not m:
        raise SystemExit(f"layout {name!r}: write [sP]eEgGkK, e.g. e8g1k2 or s25e4g2k4")
    shared = int(m.group(1) or 0) * d_ff // 100
    g = int(m.group(3))
    shared -= (d_ff - shared) % g  # the routed neurons must split into G equal slices
    args = ["--copies", m.group(2), "--granularity", m.group(3), "--top-k", m.group(4)]
    return args + (["--shared-width", str(shared)] if shared else [])


@torch.no_grad()
def score(path: Path, ids: torch.Tensor, seq: int, ref: list[torch.Tensor] | None = None) -> dict:
    """Perplexity of the model at `path` on ids in windows of seq; without `ref`, also the logits of every window
    (a list, float32); with `ref` (those of the dense model), the max |logit difference| and the mean KL to it, a
    window at a time (an E8 upcycle of a 0.5B model is 11 GB in float32: no second copy of all the logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = ids[: len(ids) // seq * seq].view(-1, seq)
    logits, nll, diff, kl_sum = [], 0.0, 0.0, 0.0
    for i, w in enumerate(windows):
        lg = model(w[None]).logits[0]
        nll += F.cross_entropy(lg[:-1], w[1:], reduction="sum").item()
        if ref is None:
            logits.append(lg)
        else:
            diff = max(diff, float((lg - ref[i]).abs().max()))
            kl_sum += kl(ref[i], lg)
    del model
    out = {"ppl": float(torch.exp(torch.tensor(nll / (windows.numel() - len(windows)))))}
    return out | ({"logits": logits} if ref is None else {"max_logit_diff": diff, "kl": kl_sum / len(windows)})


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    lp, lq = F.log_softmax(ref, -1), F.log_softmax(other, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--symmetry", default=",".join(SYMMETRY), help="breakings to score at E8 top-2 ('' for none)")
    ap.add_argument("--dtype", default="auto", help="the outputs' dtype (bfloat16 halves a float32 source's copies)")
    ap.add_argument("--eval", type=Path, default=CORPORA / "wikitext2" / "valid.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench_upcycle")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    cfg = json.loads((args.model / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tok(args.eval.read_text()[: args.tokens * 8])["input_ids"][: args.tokens])
    dense = score(args.model, ids, args.seq)
    if args.dtype == "bfloat16":  # the reference the outputs can reach: the dense weights rounded to bf16
        tmp = args.work / "dense-bf16"
        if not tmp.exists():
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).save_pretrained(tmp)
            for f in args.model.glob("tok*"):
                shutil.copy(f, tmp / f.name)
        dense = score(tmp, ids, args.seq)
    dense_logits, dense_ppl = dense["logits"], dense["ppl"]
    result = {"model": args.model.name, "d_ff": cfg["intermediate_size"], "dtype": args.dtype,
              "eval": {"text": args.eval.name, "tokens": int(ids.numel()), "seq": args.seq},
              "dense_ppl": dense_ppl, "layouts": {}, "symmetry": {},
              "machine": "2-core CPU VM", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    rows = [(name, parse_layout(name, cfg["intermediate_size"]) + ["--symmetry", "none"], "layouts")
            for name in filter(None, args.layouts.split(","))]
    rows += [(s, ["--copies", "8", "--top-k", "2", "--symmetry", s] if s != "permute" else
              ["--copies", "8", "--granularity", "2", "--top-k", "4", "--symmetry", "permute"], "symmetry")
             for s in filter(None, args.symmetry.split(","))]
    for name, flags, table in rows:
        out = args.work / name
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.time()
        res = subprocess.run([sys.executable, "-m", "moeify", "upcycle", str(args.model), str(out), "--dtype",
                              args.dtype, *flags, "--json", str(args.work / f"{name}.json")],
                             capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{name}: {res.stderr[-2000:]}")
        seconds = time.time() - t0
        report = json.loads((args.work / f"{name}.json").read_text())
        scored = score(out, ids, args.seq, dense_logits)
        ppl = scored["ppl"]
        row = {"flags": " ".join(flags), "seconds": round(seconds, 1), "experts": report["experts"],
               "top_k": report["top_k"], "expert_width": report["expert_width"], "format": report["format"],
               "total_params": report["total_params"], "active_params": report["active_params"],
               "ffn_params_ratio": report["ffn_params_ratio"], "ffn_flops_ratio": report["ffn_flops_ratio"],
               "ppl": ppl, "ppl_ratio": ppl / dense_ppl,
               "max_logit_diff": scored["max_logit_diff"],
               "max_dense_logit": max(float(lg.abs().max()) for lg in dense_logits), "kl": scored["kl"],
               "check": report["check"]}
        result[table][name] = row
        print(f"{name}: ppl {ppl:.4f} (dense {dense_ppl:.4f}), max |logit diff| {row['max_logit_diff']:.3g}, "
              f"KL {row['kl']:.3g}, {seconds:.0f} s", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
