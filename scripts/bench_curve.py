"""The tokens -> quality curve of tuned checkpoints: each written output scored against the dense model.

    python scripts/bench_curve.py models/smollm2-135m out/p50-262k out/p50-524k --json curve.json --append

Every checkpoint is loaded with AutoModelForCausalLM (the real output format) and scored on the same first
--eval-tokens tokens of each held-out text (non-overlapping windows of --seq-len) as the dense model, as
scripts/bench_quality.py scores its rows; the tuning tokens come from the checkpoint's own report.json (the
cumulative `tuning.tokens` of every `moeify convert` / `moeify tune` run it went through). This is how the curve
of continued schedules (`moeify tune OUT --tokens N` again and again) is measured: one point per written output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_quality import load_moe, perplexity, tokens_of  # noqa: E402

# ../shared/corpora beside the repository (or beside a parent directory, for a worktree elsewhere)
CORPORA = next((p / "shared" / "corpora" for p in ROOT.parents if (p / "shared" / "corpora").is_dir()),
               ROOT.parent / "shared" / "corpora")
TEXTS = [CORPORA / "wikitext2" / "valid.txt", CORPORA / "tinyshakespeare" / "valid.txt",
         Path("/usr/share/common-licenses/GPL-3")]


def count_ties(model) -> dict:
    """Hooks every MoE router of a loaded output: the share of token-layers whose top-k experts by float32 softmax
    probability (transformers) differ from their top-k by logit (vLLM's CPU router, moeify's tuning), i.e. ties
    in the probabilities (moeify.maths.router.routing_ties). Returns the running counts; call stats["remove"]() after."""
    from moeify.maths.router import routing_ties

    k, stats = model.config.num_experts_per_tok, {"tied": 0.0, "n": 0}

    def hook(mod, inp):
        lg = inp[0].reshape(-1, inp[0].shape[-1]).float() @ mod.weight.float().T
        stats["tied"] += routing_ties(lg, k) * lg.shape[0]
        stats["n"] += lg.shape[0]

    hooks = [layer.mlp.gate.register_forward_pre_hook(hook) for layer in model.model.layers
             if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    stats["remove"] = lambda: [h.remove() for h in hooks]
    return stats


def release(device: str) -> None:
    """Give a GPU's cached memory back once a model is freed (a caller may start another process on the GPU)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class Scorer:
    """The dense model scored once on the first `eval_tokens` tokens of each text; then point(ckpt) scores a written
    output on the same tokens and returns its point (perplexity, ratio to dense, routing ties, its tuning runs).
    `results` holds every point scored, as --json writes it."""

    def __init__(self, dense_dir: Path, texts: list[Path], eval_tokens: int, seq_len: int, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.seq_len, self.device = seq_len, device
        names = [p.parent.name if p.name.endswith(".txt") else p.name for p in texts]
        self.evals = {n: tokens_of(dense_dir, p, eval_tokens) for n, p in zip(names, texts)}
        dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).to(device).eval()
        self.dense_ppl = {n: perplexity(dense, ids, seq_len) for n, ids in self.evals.items()}
        del dense
        release(device)
        self.results = {"dense": str(dense_dir), "eval": {n: str(p) for n, p in zip(names, texts)},
                        "eval_tokens": {n: int(ids.numel()) for n, ids in self.evals.items()}, "seq_len": seq_len,
                        "dense_ppl": self.dense_ppl, "points": []}

    def point(self, ckpt: Path, label: str = "") -> dict:
        report = json.loads((ckpt / "report.json").read_text())
        tuning = report.get("tuning", {})
        model = load_moe(ckpt).to(self.device)
        ppl, ties = {}, {}
        for n, ids in self.evals.items():
            counts = count_ties(model)
            ppl[n] = perplexity(model, ids, self.seq_len)
            counts["remove"]()
            ties[n] = counts["tied"] / max(1, counts["n"])
        del model
        release(self.device)
        point = {"label": label, "checkpoint": str(ckpt), "tokens": tuning.get("tokens", 0),
                 "runs": [{k: r.get(k) for k in ("tokens", "steps", "seconds", "cpu_seconds", "seconds_per_1k_tokens",
                                                 "holdout_kl_before", "holdout_kl_after", "step_kept", "seed",
                                                 "resumed")} for r in tuning.get("runs", [])],
                 "ppl": ppl, "ratio": {n: ppl[n] / self.dense_ppl[n] for n in ppl},
                 "routing_ties": ties}  # share of token-layers whose top-k by probability and by logit differ
        self.results["points"].append(point)
        return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dense", type=Path)
    ap.add_argument("checkpoints", type=Path, nargs="+")
    ap.add_argument("--eval", type=Path, nargs="+", default=TEXTS)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the models are scored (float32)")
    ap.add_argument("--label", default="", help="a name for these points (e.g. 'active-50, continued schedules')")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--append", action="store_true", help="add to the points already in --json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    scorer = Scorer(args.dense, args.eval, args.eval_tokens, args.seq_len, args.device)
    results = scorer.results
    if args.append and args.json and args.json.is_file():
        results["points"] = json.loads(args.json.read_text())["points"]
    print("dense ppl " + ", ".join(f"{n} {p:.3f}" for n, p in scorer.dense_ppl.items()), flush=True)
    for ckpt in args.checkpoints:
        point = scorer.point(ckpt, args.label)
        print(f"{ckpt.name}: {point['tokens']:,} tuning tokens, ratio "
              + "  ".join(f"{n} {v:.3f}" for n, v in point["ratio"].items())
              + f"; routing ties {max(point['routing_ties'].values()):.2%} of token-layers at most", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
