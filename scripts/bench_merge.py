"""Does a merge of fine-tunes pay? SmolLM2-135M fine-tuned on two genres, merged into one MoE by `moeify merge`, trained
by `moeify tune OUT`, and scored on each genre's held-out text and on a third genre, against the base, each
fine-tune and the two fine-tunes' weight average (a "model soup", the merge without experts).

    python scripts/bench_merge.py --json results/upcycling/merge-smollm2-shakespeare-wikitext.json

1. Two fine-tunes of models/smollm2-135m (every weight but the embeddings), each on --ft-tokens of one genre's
   training text: tiny-shakespeare train.txt, WikiText-2 train.txt (AdamW 0.9 / 0.95, --ft-lr with 5% warm-up and a
   cosine to a tenth, windows of 256, 4 a step).
2. `moeify merge` of the two (Branch-Train-MiX: each fine-tune's FFN an expert, attention and norms averaged, router
   rows from each genre's text), top-1 (each token one fine-tune's FFN: the dense model's compute) and top-2.
3. `moeify tune OUT` of the top-1 merge on --train-tokens of both genres' training text: the routers alone, and the
   routers and experts.
Scored: the first --eval-tokens tokens of tiny-shakespeare valid.txt, WikiText-2 valid.txt and War and Peace
valid.txt (no model trained on it), windows of 256, float32.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
GENRES = {"shakespeare": CORPORA / "tinyshakespeare", "wikitext2": CORPORA / "wikitext2"}
EVAL = {"shakespeare": CORPORA / "tinyshakespeare" / "valid.txt", "wikitext2": CORPORA / "wikitext2" / "valid.txt",
        "war_and_peace": CORPORA / "war_and_peace" / "valid.txt"}


def ids_of(tok, path: Path, n: int | None = None) -> torch.Tensor:
    ids = tok(path.read_text(), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:n] if n else ids)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int = 256) -> float:
    windows = ids[: len(ids) // seq * seq].view(-1, seq)
    nll = sum(F.cross_entropy(model(w[None]).logits[0, :-1].float(), w[1:], reduction="sum").item() for w in windows)
    return math.exp(nll / (windows.numel() - len(windows)))


def fine_tune(base: Path, out: Path, train_ids: torch.Tensor, args) -> dict:
    """Every weight but the embeddings (tied with the head) trained on train_ids' first windows, in order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return json.loads((out / "fine_tune.json").read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()  # no dropout in SmolLM2; eval mode keeps it deterministic
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]
    for n, p in model.named_parameters():
        p.requires_grad_("embed_tokens" not in n and "lm_head" not in n)
    opt = torch.optim.AdamW(params, lr=args.ft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    seq, batch = 256, 4
    steps = args.ft_tokens // (seq * batch)
    windows = train_ids[: steps * batch * seq].view(steps, batch, seq)
    warm = max(1, steps // 20)
    t0 = time.time()
    for step in range(steps):
        scale = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) /
                                                                                   max(1, steps - warm)))
        for g in opt.param_groups:
            g["lr"] = args.ft_lr * scale
        loss = model(windows[step], labels=windows[step]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    info = {"tokens": steps * batch * seq, "steps": steps, "lr": args.ft_lr, "seconds": round(time.time() - t0, 1)}
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    (tmp / "fine_tune.json").write_text(json.dumps(info))
    tmp.rename(out)
    return info


def soup(a: Path, b: Path, out: Path) -> None:
    """The two fine-tunes' weights averaged (every tensor)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return
    ma = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    sb = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    with torch.no_grad():
        for n, p in ma.state_dict().items():
            p.copy_((p + sb[n]) / 2)
    ma.save_pretrained(out)
    AutoTokenizer.from_pretrained(a).save_pretrained(out)


def moeify(*args) -> None:
    subprocess.run([str(ROOT / ".venv" / "bin" / "moeify"), *map(str, args)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--ft-tokens", type=int, default=131072)
    ap.add_argument("--ft-lr", type=float, default=2e-4)
    ap.add_argument("--train-tokens", type=int, default=65536)
    ap.add_argument("--train-lr", default="0.01", help="moeify tune --lr of the trained merges (comma-separated: one "
                    "row each)")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench_merge")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.base)
    args.work.mkdir(parents=True, exist_ok=True)
    evals = {k: ids_of(tok, p, args.eval_tokens) for k, p in EVAL.items()}
    result = {"base": str(args.base.relative_to(ROOT)), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "ft_tokens": args.ft_tokens, "ft_lr": args.ft_lr, "train_tokens": args.train_tokens,
              "eval_tokens": {k: len(v) for k, v in evals.items()}, "eval": {k: str(p) for k, p in EVAL.items()},
              "models": {}}

    def score(name: str, path: Path, **extra) -> None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ppl = {k: perplexity(model, v) for k, v in evals.items()}
        result["models"][name] = {"perplexity": ppl, **extra}
        print(name, {k: round(v, 3) for k, v in ppl.items()}, flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")

    score("base", args.base)
    fts, texts = {}, {}
    for genre, folder in GENRES.items():
        texts[genre] = folder / "calib_train_200k.txt"
        fts[genre] = args.work / f"ft-{genre}"
        info = fine_tune(args.base, fts[genre], ids_of(tok, folder / "train.txt"), args)
        score(f"fine-tune: {genre}", fts[genre], fine_tune=info)
    soup(fts["shakespeare"], fts["wikitext2"], args.work / "soup")
    score("weight average of the two fine-tunes", args.work / "soup")
    mix = [GENRES[g] / "train.txt" for g in GENRES]
    for k in (1, 2):
        out = args.work / f"merge-top{k}"
        if not (out / "config.json").is_file():
            moeify("merge", out, fts["shakespeare"], fts["wikitext2"], "--base", args.base, "--attention", "average",
                   "--router-text", texts["shakespeare"], "--router-text", texts["wikitext2"], "--top-k", k,
                   "--dtype", "float32", "--overwrite")
        score(f"merge top-{k}, as written", out, report=json.loads((out / "report.json").read_text())["check"])
    for lr in args.train_lr.split(","):
        for what, flags in (("routers", ["--router-only"]), ("routers and experts", [])):
            out = args.work / f"merge-top1-{'router' if flags else 'ffn'}-{lr}"
            if not (out / "report.json").is_file() or "training" not in json.loads((out / "report.json").read_text()):
                shutil.rmtree(out, ignore_errors=True)
                shutil.copytree(args.work / "merge-top1", out)
                moeify("tune", out, "--tune-text", mix[0], "--tune-text", mix[1], "--tokens", args.train_tokens,
                       "--lr", lr, *flags)
            run = json.loads((out / "report.json").read_text())["training"]["runs"][-1]
            score(f"merge top-1, {what} trained (lr {lr})", out, training={k: run[k] for k in (
                "tokens", "seconds", "lr", "aux_loss_coef", "held_out_before", "held_out_after")})


if __name__ == "__main__":
    main()
