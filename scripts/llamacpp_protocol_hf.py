"""Perplexity in transformers by llama-perplexity's own protocol, so the two engines are compared on the same
scored tokens: the text cut llama.cpp read, tokenized by the model's tokenizer, N chunks of C tokens, each chunk's
second half scored (llama-perplexity's default: the tokens after position C/2 are predicted, the first C/2 + 1
are context only), float32.

    .venv/bin/python scripts/llamacpp_protocol_hf.py DENSE MOE... --text CUT.txt [--ctx 256 --chunks 32] [--json F]

Prints each model's perplexity and its ratio to the first (dense) model: the number to set beside
scripts/bench_llamacpp_quants.py's llama.cpp ratios (BENCHMARKS.md "Serving correctness: transformers, vLLM,
llama.cpp").
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--text", type=Path, nargs="+", required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.models[0])
    texts = {t.name: tok(t.read_text(errors="replace"), add_special_tokens=False)["input_ids"] for t in args.text}
    out = {}
    for m in args.models:
        model = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
        row = {}
        for name, ids in texts.items():
            n = min(args.chunks, len(ids) // args.ctx)
            chunks = torch.tensor(ids[: n * args.ctx]).view(n, args.ctx)
            nll, count = 0.0, 0
            with torch.no_grad():
                for c in chunks.split(4):
                    logp = model(input_ids=c).logits.float().log_softmax(-1)
                    first = args.ctx // 2  # as llama-perplexity: logits at first .. ctx-2 predict first+1 .. ctx-1
                    pred = logp[:, first:-1].gather(2, c[:, first + 1:, None]).squeeze(2)
                    nll, count = nll - pred.sum().item(), count + pred.numel()
            row[name] = math.exp(nll / count)
        out[m.name] = row
        print(m.name, {k: round(v, 4) for k, v in row.items()}, flush=True)
        del model
    dense = out[args.models[0].name]
    ratios = {k: {t: v[t] / dense[t] for t in v} for k, v in out.items()}
    for k, v in ratios.items():
        print(k, "ratio", {t: round(r, 4) for t, r in v.items()})
    if args.json:
        args.json.write_text(json.dumps({"ctx": args.ctx, "chunks": args.chunks, "ppl": out, "ratio": ratios},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
