"""Question-and-answer text that an instruct model writes itself from its own chat template, for calibration and
tuning mixes (BENCHMARKS.md, "The third lever"): no task data, no hand-written prompts.

Each conversation is two samplings at temperature 1 (as tuning's free sampling): the user's turn, continued from the
template's opening (its default system prompt and the user header), up to the end-of-turn token; then the
assistant's reply to it, from the template's generation prompt. The file holds the turns as plain text (the
question, a blank line, the answer, a blank line), as the zero-shot tasks are scored without a template.

    python scripts/chat_text.py MODEL OUT.txt [--tokens 24576] [--seed 0] [--batch 16]
        [--prefix TEXT --prefix-tokens N]     # OUT starts with TEXT's first N tokens (a calibration mix)
        [--spread]                            # ... with N tokens in 512-token windows spread over all of TEXT
        [--control OTHER]                     # the same mix with OTHER's text in place of conversations

Calibration spreads its --calib-tokens in whole windows evenly over the file (it read the file's first tokens until
2026-11-29, when the mixes of `bench_tasks.sh smollm2-chat` were written: `--prefix moeify/data/calib_sample.txt
--prefix-tokens 8192`, the first half of a preset's 16,384 tokens). A mix of half the bundled sample spread as the
presets now read it and half conversations is `--prefix moeify/data/calib_sample.txt --prefix-tokens 12288 --spread`
with --tokens 12288: the windows then cover both halves evenly.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

MARK = "\x00MOEIFY\x00"


def template_opening(tok) -> str:
    """The chat template rendered up to where the user's words go (its default system prompt included)."""
    text = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    if MARK not in text:
        raise SystemExit("chat_text.py: the chat template does not place the user's message")
    return text.split(MARK)[0]


def end_ids(tok, model) -> list[int]:
    """Token ids that end a turn: the template's end-of-turn marker and the generation config's end tokens."""
    ids = set()
    eos = model.generation_config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for t in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        i = tok.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tok.unk_token_id and i is not None:
            ids.add(i)
    return sorted(ids)


def sample(model, tok, prompts: list[str], new: int, stop: list[int]) -> list[str]:
    """One batch of continuations (temperature 1, no truncation), each cut at its first end-of-turn token."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new,
                         eos_token_id=stop, pad_token_id=tok.pad_token_id)
    return [tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip() for row in out]


def prefix_text(tok, path: Path | None, n_tokens: int, spread: bool = False, window: int = 512) -> str:
    """The first n_tokens tokens of the text at path, cut where the tokenizer puts the end of token n_tokens, and a
    blank line ('' without a path); with spread, n_tokens // window windows of `window` tokens evenly spaced over
    the whole text (as calibration picks its windows), each followed by a blank line."""
    if path is None or n_tokens <= 0:
        return ""
    text = path.read_text(encoding="utf-8")
    spans = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(spans) < n_tokens:
        raise SystemExit(f"chat_text.py: {path} has {len(spans)} tokens, fewer than --prefix-tokens {n_tokens}")
    if not spread:
        return text[:spans[n_tokens - 1][1]] + "\n\n"
    from moeify.formats.text import spread as spaced

    starts = spaced(n_tokens // window, len(spans) // window) * window
    return "".join(text[spans[s][0]:spans[s + window - 1][1]] + "\n\n" for s in starts.tolist())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", type=int, default=24576, help="stop once the text has this many tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--question-tokens", type=int, default=96)
    ap.add_argument("--answer-tokens", type=int, default=320)
    ap.add_argument("--prefix", type=Path, help="a text whose first --prefix-tokens tokens open OUT")
    ap.add_argument("--prefix-tokens", type=int, default=0)
    ap.add_argument("--spread", action="store_true", help="the prefix's tokens in windows spread over all of it")
    ap.add_argument("--control", type=Path, help="write the mix with this text in place of conversations (a control)")
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if a.control:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        prefix = prefix_text(tok, a.prefix, a.prefix_tokens, a.spread)
        a.out.write_text(prefix + a.control.read_text(encoding="utf-8"), encoding="utf-8")
        print(f"{a.out}: {a.prefix} then {a.control}")
        return 0
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    stop, opening = end_ids(tok, model), template_opening(tok)
    texts, n_tokens, t0, b = [], 0, time.time(), 0
    with torch.no_grad():
        while n_tokens < a.tokens:
            torch.manual_seed(a.seed * 1_000_003 + b)
            questions = [q for q in sample(model, tok, [opening] * a.batch, a.question_tokens, stop) if q]
            replies = sample(model, tok, [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                  add_generation_prompt=True) for q in questions],
                             a.answer_tokens, stop)
            for q, r in zip(questions, replies):
                if r:
                    texts.append(f"{q}\n\n{r}\n\n")
                    n_tokens += len(tok(texts[-1], add_special_tokens=False)["input_ids"])
            b += 1
            print(f"batch {b}: {n_tokens} tokens, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(prefix_text(tok, a.prefix, a.prefix_tokens, a.spread) + "".join(texts), encoding="utf-8")
    print(f"{a.out}: {len(texts)} conversations, {n_tokens} tokens, {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
