"""Does upcycling pay when trained? The bundled tiny Llama trained on the same fresh tokens as dense (continued), as
upcycled E8 top-2 MoEs (identical copies, and Drop-Upcycling r = 0.5) and as a fine-grained upcycle at the dense
model's compute (E8 G2 top-2, drop r = 0.5): held-out perplexity against tokens, side by side, one plot.

    python scripts/bench_upcycle_training.py --json results/upcycling/training-tiny-llama-shakespeare.json \\
        --plot results/upcycling/training-tiny-llama-shakespeare.png

Every model starts from examples/tiny-llama (trained on WikiText-2, scripts/train_tiny_llama.py) and sees the same
windows of tiny-shakespeare train.txt (text it never saw), in the same order: AdamW (0.9, 0.95, weight decay 0.1),
the learning rate reset to the tiny model's pretraining peak (3e-3), 5% warm-up, cosine to 10%; batch 4 × 256. The
MoEs are written by `moeify upcycle` and trained in transformers with output_router_logits=True, so their loss adds
Mixtral's load-balancing loss at the written coefficient (1e-2). Scored every --every steps on the first
--eval-tokens of tiny-shakespeare valid.txt (the new domain) and of WikiText-2 valid.txt (the old one), float32.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
TINY = ROOT / "examples" / "tiny-llama"
RUNS = {  # name: moeify upcycle flags (None: the dense model itself)
    "dense": None,
    "E8 top-2, identical copies": ["--copies", "8", "--top-k", "2", "--symmetry", "none"],
    "E8 top-2, drop r=0.5": ["--copies", "8", "--top-k", "2", "--symmetry", "drop", "--drop-share", "0.5"],
    "E8 G2 top-2 (dense compute), drop r=0.5": ["--copies", "8", "--granularity", "2", "--top-k", "2",
                                                "--symmetry", "drop", "--drop-share", "0.5"],
}


def tokens(tok, path: Path, n: int | None = None) -> torch.Tensor:
    ids = tok(path.read_text())["input_ids"]
    return torch.tensor(ids[:n] if n else ids)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int = 256) -> float:
    model.eval()
    windows = ids[: len(ids) // seq * seq].view(-1, seq)
    nll = sum(F.cross_entropy(model(w[None]).logits[0, :-1].float(), w[1:], reduction="sum").item() for w in windows)
    model.train()
    return math.exp(nll / (windows.numel() - len(windows)))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(path: Path, train_ids: torch.Tensor, evals: dict, args) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    moe = hasattr(model.config, "num_experts_per_tok")
    if moe:
        model.config.output_router_logits = True
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)  # the same windows, in the same order, for every model
    warmup = max(1, args.steps // 20)
    curve = [{"tokens": 0, **{k: perplexity(model, v) for k, v in evals.items()}}]
    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train_ids[s:s + args.seq] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            point = {"tokens": (step + 1) * args.batch * args.seq, **{k: perplexity(model, v) for k, v in evals.items()}}
            curve.append(point)
            print(f"  {point}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "train_seconds": time.time() - t0, "curve": curve, "moe": moe}


def plot(result: dict, path: Path) -> None:
    """Held-out perplexity against tokens, each text a panel (the starting point left out: it dwarfs the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, text in zip(axes, ("shakespeare", "wikitext2")):
        for name, run in result["runs"].items():
            pts = [p for p in run["curve"] if p["tokens"] > 0]
            ax.plot([p["tokens"] for p in pts], [p[text] for p in pts], marker="o", ms=3,
                    label=f"{name} ({run['params'] / 1e6:.1f}M params)")
        ax.set_title(f"held-out {text} valid.txt" + (" (the new text)" if text == "shakespeare" else " (the old text)"))
        ax.set_xlabel("training tokens (tiny-shakespeare train)")
        ax.set_ylabel("perplexity")
    axes[0].legend(fontsize=7)
    fig.suptitle("tiny Llama (6 layers, d_ff 720) trained on new text: dense and upcycled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3, help="the tiny model's pretraining peak")
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench_upcycle_training")
    ap.add_argument("--runs", default=";".join(RUNS), help="run names, separated by ;")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--plot-only", action="store_true", help="draw --plot from an existing --json")
    args = ap.parse_args()
    if args.plot_only:
        return plot(json.loads(args.json.read_text()), args.plot)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    train_ids = tokens(tok, CORPORA / "tinyshakespeare" / "train.txt")
    evals = {"shakespeare": tokens(tok, CORPORA / "tinyshakespeare" / "valid.txt", args.eval_tokens),
             "wikitext2": tokens(tok, CORPORA / "wikitext2" / "valid.txt", args.eval_tokens)}
    result = {"model": "examples/tiny-llama", "train_text": "tinyshakespeare/train.txt",
              "train_tokens": args.steps * args.batch * args.seq, "steps": args.steps, "batch": args.batch,
              "seq": args.seq, "lr": args.lr, "eval_tokens": args.eval_tokens, "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "runs": {}}
    args.work.mkdir(parents=True, exist_ok=True)
    for name in args.runs.split(";"):
        flags = RUNS[name]
        path = TINY
        if flags is not None:
            path = args.work / "".join(c if c.isalnum() else "-" for c in name)
            subprocess.run([sys.executable, "-m", "moeify", "upcycle", str(TINY), str(path), "--overwrite",
                            "--dtype", "float32", *flags], check=True, capture_output=True)
        print(name, flush=True)
        result["runs"][name] = {"flags": flags, **train(path, train_ids, evals, args)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)

if __name__ == "__main__":
    main()
