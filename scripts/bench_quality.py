"""Quality benchmark: held-out perplexity ratio (MoE / dense) for partition x router x compensation x config.

    python scripts/bench_quality.py                       # bundled tiny model, all configs, writes results JSON
    python scripts/bench_quality.py --configs e8k2 --rows contiguous/mean-gate,coactivation/fitted+refit

Every row converts the same model with `moeify` (the real pipeline, the real output format), loads the
output with AutoModelForCausalLM and scores the same held-out tokens as the dense model. An `oracle` row
replaces the router of a partition by the true top-k experts by output norm (the upper bound without refit).
Calibration text: wikitext2/calib_train_200k.txt (training split); evaluation: wikitext2/valid.txt (held out).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.config import build_config  # noqa: E402
from moeify.convert import plan_conversion, run_conversion  # noqa: E402

CORPORA = ROOT.parent / "shared" / "corpora" / "wikitext2"
CONFIGS = {  # name: (experts, top_k, shared) -> share of FFN neurons active = (top_k + shared) / (experts + shared)
    "e8k2": (8, 2, 0),  # 25%
    "e8k4": (8, 4, 0),  # 50%
    "s1e7k1": (7, 1, 1),  # 25%
    "s2e16k2": (16, 2, 2),  # 22%
}
ROWS = [  # method/router[+refit]; "oracle" router = top-k by true expert output norm
    "contiguous/mean-gate", "gate-cluster/representative", "gate-cluster/mean-gate", "activation/representative",
    "activation/fitted", "coactivation/fitted", "gate-cluster/fitted",
    "gate-cluster/fitted+refit", "activation/fitted+refit", "coactivation/fitted+refit",
    "contiguous/oracle", "gate-cluster/oracle", "activation/oracle", "coactivation/oracle",
]


def tokens_of(model_dir: Path, text_file: Path, max_tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(text_file.read_text(), add_special_tokens=False)["input_ids"][:max_tokens]
    return torch.tensor(ids)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, batch: int = 8) -> float:
    """Mean NLL over non-overlapping windows (every window's first token has no context and is not scored)."""
    n = ids.numel() // seq_len
    windows = ids[: n * seq_len].view(n, seq_len)
    nll, count = 0.0, 0
    for s in range(0, n, batch):
        w = windows[s:s + batch]
        logits = model(w).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    return float(torch.exp(torch.tensor(nll / count)))


def install_oracle_router(model) -> None:
    """Replace every MoE router by the oracle: top-k experts by the L2 norm of their true output, gates 1/k."""
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, "gate") or not hasattr(block, "experts"):
            continue  # a dense layer
        experts, router = block.experts, block.gate

        def forward(hidden, experts=experts, router=router):
            x = hidden.reshape(-1, router.hidden_dim)
            gate_up = torch.einsum("th,eih->tei", x, experts.gate_up_proj)
            g, u = gate_up.chunk(2, dim=-1)
            out = torch.einsum("tei,ehi->teh", experts.act_fn(g) * u, experts.down_proj)
            norms = out.norm(dim=-1)  # (tokens, experts)
            idx = norms.topk(router.top_k, dim=-1).indices
            scores = torch.full(idx.shape, 1.0 / router.top_k, dtype=x.dtype, device=x.device)
            return norms, scores, idx

        router.forward = forward


def run_row(model_dir: Path, row: str, config: str, calib: Path, calib_tokens: int, ids, seq_len, work: Path,
            feed: str) -> dict:
    from transformers import AutoModelForCausalLM

    method, rest = row.split("/")
    router, refit = rest.removesuffix("+refit"), rest.endswith("+refit")
    experts, top_k, shared = CONFIGS[config]
    needs_calib = method in ("activation", "coactivation") or router == "fitted" or refit
    cfg = build_config(experts=experts, top_k=top_k, shared=shared, method=method,
                       router="mean-gate" if router == "oracle" else router, compensate=refit,
                       calib=[str(calib)] if needs_calib else None, calib_tokens=calib_tokens, calib_feed=feed)
    out = work / f"{config}-{method}-{rest}"
    t0 = time.time()
    report = run_conversion(plan_conversion(model_dir, cfg), out, overwrite=True)
    seconds = time.time() - t0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if router == "oracle":
        install_oracle_router(model)
    ppl = perplexity(model, ids, seq_len)
    layers = [lay for lay in report["layers"] if not lay.get("dense")]
    agreement = [lay.get(f"agreement_{router}") for lay in layers if lay.get(f"agreement_{router}") is not None]
    shutil.rmtree(out)
    return {"config": config, "row": row, "ppl": ppl, "seconds": round(seconds, 2),
            "agreement": sum(agreement) / len(agreement) if agreement else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "tiny-llama")
    ap.add_argument("--calib", type=Path, default=CORPORA / "calib_train_200k.txt")
    ap.add_argument("--eval", type=Path, default=CORPORA / "valid.txt")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--calib-tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--feed", default="dense", choices=("dense", "moe"))
    ap.add_argument("--json", type=Path, default=ROOT / "scripts" / "bench_quality_results.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from transformers import AutoModelForCausalLM

    ids = tokens_of(args.model, args.eval, args.eval_tokens)
    dense = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    dense_ppl = perplexity(dense, ids, args.seq_len)
    print(f"dense ppl {dense_ppl:.3f} on {ids.numel()} held-out tokens", flush=True)
    results = {"model": str(args.model), "eval_tokens": int(ids.numel()), "seq_len": args.seq_len,
               "calib_tokens": args.calib_tokens, "feed": args.feed, "dense_ppl": dense_ppl, "rows": []}
    with tempfile.TemporaryDirectory() as work:
        for config in args.configs.split(","):
            for row in args.rows.split(","):
                r = run_row(args.model, row, config, args.calib, args.calib_tokens, ids, args.seq_len, Path(work),
                            args.feed)
                r["ratio"] = r["ppl"] / dense_ppl
                results["rows"].append(r)
                agree = f"  oracle-agreement {r['agreement']:.3f}" if r["agreement"] is not None else ""
                print(f"{config:8s} {row:30s} ppl {r['ppl']:9.3f}  ratio {r['ratio']:.3f}{agree}  ({r['seconds']}s)",
                      flush=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
