"""Do a merge's routers send each domain's text to its own expert? SmolLM2-135M fine-tuned on three genres, merged
into one top-1 MoE from the same mergekit-moe YAML (the same prompts) by mergekit-moe and by `moeify merge`, each
router construction scored on each genre's held-out text: the share of its tokens routed to its own genre's expert
(each layer's top-1, averaged over layers) and the perplexity.

    python scripts/bench_merge_routing.py --json results/upcycling/merge-routing-smollm2-3genres.json

1. Three fine-tunes of models/smollm2-135m (scripts/bench_merge.py's fine_tune: every weight but the embeddings),
   each on --ft-tokens of one genre: tiny-shakespeare train.txt, WikiText-2 train.txt, War and Peace
   calib_train_200k.txt.
2. A mergekit-moe YAML: the base's attention, the three fine-tunes as experts, experts_per_token 1, float32, each
   expert's positive_prompts PROMPTS_PER_GENRE passages of its genre's training text (after the fine-tune's tokens).
3. The same YAML through mergekit-moe (its own venv: scripts/bench_mergekit.py makes it) with gate_mode hidden and
   cheap_embed, and through `moeify merge --config` with gate modes hidden, cheap_embed and router_input; and
   `moeify merge --router-text` (each genre's text past the fine-tune's tokens, the region its prompts come from:
   2,048 tokens read, instead of the prompts).
A row whose command, base, token counts and prompts match the --json file's is kept from it, not run again.
Scored: the first --eval-tokens tokens of each genre's valid.txt, windows of 256, float32; the base and each
fine-tune alone beside them (a fine-tune on its own genre is what a perfect router would reach, FFN-wise).
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
sys.path.insert(0, str(ROOT / "scripts"))
from bench_merge import fine_tune, ids_of  # noqa: E402 (the fine-tunes as the merge benchmark makes them)

CORPORA = ROOT.parent / "shared" / "corpora"
GENRES = {"shakespeare": CORPORA / "tinyshakespeare" / "train.txt",
          "wikitext2": CORPORA / "wikitext2" / "train.txt",
          "war_and_peace": CORPORA / "war_and_peace" / "calib_train_200k.txt"}
VALID = {g: CORPORA / d / "valid.txt" for g, d in (("shakespeare", "tinyshakespeare"), ("wikitext2", "wikitext2"),
                                                   ("war_and_peace", "war_and_peace"))}
PROMPTS_PER_GENRE = 4
PROMPT_CHARS = 300
ROUTER_TEXT_CHARS = 12_000  # --router-text: about 2,600 tokens of each genre, past the fine-tune's (2,048 read)


def prompts_of(path: Path, skip_chars: int) -> list[str]:
    """PROMPTS_PER_GENRE passages of about PROMPT_CHARS characters, each from a line start, spread over the text
    after its first skip_chars characters (past what the fine-tune read)."""
    text = path.read_text()
    rest = len(text) - skip_chars
    out = []
    for i in range(PROMPTS_PER_GENRE):
        start = text.find("\n", skip_chars + rest * i // PROMPTS_PER_GENRE) + 1
        chunk = text[start:start + PROMPT_CHARS]
        out.append(chunk[:chunk.rfind(" ")].strip())
    return out


def write_yaml(path: Path, base: Path, experts: dict[str, Path], prompts: dict[str, list[str]], mode: str) -> Path:
    lines = [f"base_model: {base}", f"gate_mode: {mode}", "dtype: float32", "experts_per_token: 1", "experts:"]
    for genre, src in experts.items():
        lines += [f"  - source_model: {src}", "    positive_prompts:"]
        lines += [f"      - {json.dumps(p)}" for p in prompts[genre]]
    path.write_text("\n".join(lines) + "\n")
    return path


# Where GNU time is missing: a fresh Python child runs cmd and prints its children's peak RSS (KB on Linux) last.
RUSAGE_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def timed(cmd: list[str]) -> dict:
    """Run cmd; its wall seconds and peak resident memory (GNU time's maximum RSS of the child; without GNU time,
    getrusage(RUSAGE_CHILDREN) in a fresh Python child that runs only cmd)."""
    wrap = ["/usr/bin/time", "-f", "%M"] if Path("/usr/bin/time").is_file() else [sys.executable, "-c", RUSAGE_WRAPPER]
    t0 = time.time()
    res = subprocess.run([*wrap, *cmd], capture_output=True, text=True)
    seconds = time.time() - t0
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {res.stderr.strip().splitlines()[-3:]}")
    peak_kb = int(res.stderr.strip().splitlines()[-1])
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(peak_kb / 1e6, 3)}


@torch.no_grad()
def score(path: Path, valid: dict[str, torch.Tensor], own: dict[str, int] | None, seq: int = 256) -> dict:
    """Per genre: perplexity and (an MoE) the share of tokens each layer's top-1 sends to the genre's own expert."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for genre, ids in valid.items():
        windows = ids[: len(ids) // seq * seq].view(-1, seq)
        nll, hits, count = 0.0, 0.0, 0
        for w in windows:
            res = model(w[None], output_router_logits=own is not None)
            nll += F.cross_entropy(res.logits[0, :-1].float(), w[1:], reduction="sum").item()
            if own is not None:
                tops = torch.stack([lg.argmax(-1) for lg in res.router_logits])  # (layers, tokens)
                hits += float((tops == own[genre]).float().sum())
                count += tops.numel()
        row = {"perplexity": round(math.exp(nll / (windows.numel() - len(windows))), 3)}
        if own is not None:
            row["own_expert_share"] = round(hits / count, 4)
        out[genre] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--ft-tokens", type=int, default=32768)
    ap.add_argument("--ft-lr", type=float, default=2e-4)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--mergekit-moe", type=Path, default=ROOT / "out" / "mergekit-venv" / "bin" / "mergekit-moe",
                    help="mergekit-moe of its own venv (scripts/bench_mergekit.py makes it); absent: its rows skipped")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench_merge_routing")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.base)
    experts, fine_tunes = {}, {}
    for genre, text in GENRES.items():
        experts[genre] = args.work / f"ft-{genre}"
        fine_tunes[genre] = fine_tune(args.base, experts[genre], ids_of(tok, text), args)
        print(f"fine-tune {genre}: {fine_tunes[genre]}", flush=True)
    skip = {g: len(tok.decode(ids_of(tok, t, args.ft_tokens))) for g, t in GENRES.items()}
    prompts = {g: prompts_of(GENRES[g], skip[g]) for g in GENRES}
    valid = {g: ids_of(tok, p, args.eval_tokens) for g, p in VALID.items()}
    own = {g: i for i, g in enumerate(GENRES)}
    result = {"base": str(args.base.relative_to(ROOT)), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "ft_tokens": args.ft_tokens, "eval_tokens": args.eval_tokens, "fine_tunes": fine_tunes,
              "prompts": prompts, "rows": []}

    def save():
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")

    earlier = json.loads(args.json.read_text()) if args.json.is_file() else {}
    same = all(earlier.get(k) == result[k] for k in ("base", "ft_tokens", "eval_tokens", "prompts"))
    done = {r["command"]: r for r in earlier.get("rows", []) if same and r.get("command")}
    for name, path in [("base", args.base)] + [(f"fine-tune {g}", p) for g, p in experts.items()]:
        old = next((r for r in earlier.get("rows", []) if same and r["model"] == name), None)
        result["rows"].append(old or {"model": name, "scores": score(path, valid, None)})
        save()
    moeify = str(ROOT / ".venv" / "bin" / "moeify")
    runs = []
    for mode in ("hidden", "cheap_embed"):
        cfg = write_yaml(args.work / f"{mode}.yml", args.base, experts, prompts, mode)
        if args.mergekit_moe.is_file():
            runs.append((f"mergekit-moe, gate_mode {mode}", [str(args.mergekit_moe), str(cfg), "{out}",
                                                             "--i-understand-this-is-not-useful-without-training"]))
        runs.append((f"moeify merge --config, gate_mode {mode}", [moeify, "merge", "{out}", "--config", str(cfg)]))
    cfg = args.work / "hidden.yml"
    runs.append(("moeify merge --config --gate-mode router_input",
                 [moeify, "merge", "{out}", "--config", str(cfg), "--gate-mode", "router_input"]))
    router_text = {}  # each genre's text past the fine-tune's tokens (the same region its prompts come from)
    for g in GENRES:
        router_text[g] = args.work / f"router-text-{g}.txt"
        router_text[g].write_text(GENRES[g].read_text()[skip[g]:skip[g] + ROUTER_TEXT_CHARS])
    runs.append(("moeify merge --router-text (2,048 tokens a genre)",
                 [moeify, "merge", "{out}", *map(str, experts.values()), "--base", str(args.base), "--top-k", "1",
                  "--dtype", "float32", *sum((["--router-text", str(router_text[g])] for g in GENRES), [])]))
    for i, (name, cmd) in enumerate(runs):
        command = " ".join(cmd).replace(str(ROOT) + "/", "")
        if command in done:  # measured by an earlier run of this script with the same command
            result["rows"].append(done[command])
            save()
            continue
        out = args.work / f"merge-{i}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        run = timed([c.replace("{out}", str(out)) for c in cmd])
        row = {"model": name, "command": command, **run,
               "scores": score(out, valid, own)}
        result["rows"].append(row)
        save()
        print(name, json.dumps(row["scores"]), flush=True)
    print(table(result))


def table(result: dict) -> str:
    genres = list(VALID)
    head = f"{'router':<44}" + "".join(f"{g[:11]:>12}" for g in genres)
    lines = ["own-expert share of each genre's held-out tokens / perplexity", head]
    for row in result["rows"]:
        s = row["scores"]
        cells = "".join(f"{(s[g].get('own_expert_share', float('nan')) * 100):5.1f}%/{s[g]['perplexity']:5.1f}"
                        .rjust(12) for g in genres)
        lines.append(f"{row['model'][:44]:<44}{cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
