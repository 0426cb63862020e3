#!/usr/bin/env python
"""Train the tiny Llama bundled in examples/tiny-llama/ (CPU, ~7 minutes on 2 cores).

    python scripts/train_tiny_llama.py            # reproduces the bundled model
    python scripts/train_tiny_llama.py --out /tmp/tl --steps 50

Steps: (1) train a 4096-token byte-level BPE tokenizer on WikiText-2 text,
(2) train a 6-layer GQA LlamaForCausalLM on random 256-token windows of the
same text, (3) save model + tokenizer with save_pretrained (bfloat16 if the
fp32 weights would exceed 20 MB), (4) reload the saved files in float32 and
measure validation perplexity, (5) write a README with provenance and results.

Data: /work/shared/corpora/wikitext2/train.txt (the official WikiText-2 *test*
split, as shipped in pytorch/examples) for training; valid.txt (the official
validation split) is used only for the perplexity evaluation.
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast)

CORPUS = "/work/shared/corpora/wikitext2"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB, SEQ = 4096, 256
MAX_FP32_BYTES = 20 * 1024 * 1024  # keep the bundled weights under 20 MB
VAL_TOKENS = 100_000


def train_tokenizer(path):
    """Byte-level BPE (GPT-2/Llama-3 style), wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([path], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def encode_file(tokenizer, path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


@torch.no_grad()
def perplexity(model, ids):
    """exp(mean NLL) over non-overlapping SEQ-token windows of ids[:VAL_TOKENS]."""
    model.eval()
    ids = ids[:VAL_TOKENS]
    windows = ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)
    nll, count = 0.0, 0
    for batch in windows.split(32):
        logits = model(input_ids=batch).logits.float()
        nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train()
    return math.exp(nll / count)


def lr_at(step, steps, peak, warmup):
    """Linear warmup then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="examples/tiny-llama")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4)  # small batches, many steps: best for a CPU budget
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_path, valid_path = f"{CORPUS}/train.txt", f"{CORPUS}/valid.txt"

    # 1. Tokenizer ----------------------------------------------------------
    tokenizer = train_tokenizer(train_path)
    train_ids = encode_file(tokenizer, train_path)
    valid_ids = encode_file(tokenizer, valid_path)
    print(f"tokenizer: vocab {len(tokenizer)}, train {len(train_ids):,} tokens, "
          f"valid {len(valid_ids):,} tokens ({time.time() - t0:.0f}s)", flush=True)

    # 2. Model --------------------------------------------------------------
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=720,  # 720 = 8*90 = 16*45 = 18*40
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5, hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    # 3. Training: random SEQ-token windows of the training text ------------
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t_train, recent = time.time(), []
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - SEQ, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s:s + SEQ] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-50:]  # last-50-step mean: less noisy than one batch
        if step % 20 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step + 1}/{args.steps} loss {loss.item():.3f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {el:.0f}s "
                  f"({el / (step + 1):.2f}s/step)", flush=True)
    train_time = time.time() - t_train
    final_loss = sum(recent) / len(recent)
    print(f"final train loss (mean of last {len(recent)} steps): {final_loss:.3f}", flush=True)
    ppl_mem = perplexity(model, valid_ids)
    print(f"validation perplexity (in memory, fp32): {ppl_mem:.2f}", flush=True)

    # 4. Save: float32 if it fits in 20 MB, else bfloat16 -------------------
    os.makedirs(args.out, exist_ok=True)
    unique_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    if unique_params * 4 > MAX_FP32_BYTES:
        model.to(torch.bfloat16)  # save_pretrained then records dtype=bfloat16
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)

    # 5. Reload from disk (offline) and re-measure ---------------------------
    tok2 = AutoTokenizer.from_pretrained(args.out)
    sample = "The game 's story takes place in 1935 , after the events of\nthe war."
    assert tok2.decode(tok2(sample)["input_ids"]) == sample, "tokenizer round-trip failed"
    assert tok2(sample)["input_ids"] == tokenizer(sample)["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    ppl = perplexity(reloaded, valid_ids)
    print(f"validation perplexity (reloaded from {args.out}, fp32): {ppl:.2f}", flush=True)

    total_time = time.time() - t0
    sizes = {f: os.path.getsize(os.path.join(args.out, f))
             for f in sorted(os.listdir(args.out)) if f != "README.md"}
    write_readme(args, n_params, len(train_ids), final_loss, ppl, train_time,
                 total_time, str(model.dtype).split(".")[1], sizes,
                 tokenizer.bos_token_id, tokenizer.eos_token_id)
    print(f"done in {total_time:.0f}s; files: {sizes}")


def write_readme(args, n_params, n_train, final_loss, ppl, train_time, total_time,
                 dtype, sizes, bos_id, eos_id):
    files = "\n".join(f"| `{f}` | {s:,} |" for f, s in sizes.items())
    cmd = "python scripts/train_tiny_llama.py"
    if args.out != "examples/tiny-llama" or args.steps != 800 or args.seed != 0:
        cmd += f" --out {args.out} --steps {args.steps} --seed {args.seed}"
    text = f"""# tiny-llama

A very small Llama-architecture causal LM, bundled as moeify's default model for
tests and examples. It is a toy: useful for exercising dense→MoE conversion
end to end, not for generating good text.

## Provenance

Produced by `{cmd}` (seed {args.seed}, CPU, {args.threads} threads).
The script trains the tokenizer and the model from scratch; no pretrained
weights are involved.

- **Training text**: `/work/shared/corpora/wikitext2/train.txt`, which is the
  official WikiText-2 **test** split (`wiki.test.tokens`) as shipped in
  [pytorch/examples](https://github.com/pytorch/examples) (word_language_model/data/wikitext-2).
  {n_train:,} tokens with this tokenizer.
- **Validation text**: `/work/shared/corpora/wikitext2/valid.txt`, the official
  WikiText-2 validation split. Used only for evaluation, never for training.
- WikiText-2: Merity, Xiong, Bradbury, Socher, *Pointer Sentinel Mixture Models*,
  2016 (arXiv:1609.07843). Derived from Wikipedia; licensed CC BY-SA 3.0.

## Tokenizer

Byte-level BPE (HF `tokenizers`: ByteLevel pre-tokenizer and decoder, BpeTrainer),
vocabulary 4096 including the special tokens `{BOS}` (id {bos_id})
and `{EOS}` (id {eos_id}). Saved as a `PreTrainedTokenizerFast`, so
`AutoTokenizer.from_pretrained("examples/tiny-llama")` works offline. No BOS/EOS is
added automatically when encoding (the model was trained on plain text windows).

## Architecture

`LlamaForCausalLM`: hidden size 256, intermediate (SwiGLU) size 720 (divisible
by 8, 16 and 18 for expert splits), 6 layers, 8 attention heads with 2
key/value heads (GQA, head dim 32), RoPE θ = 10000, RMSNorm ε = 1e-5,
max positions 512, tied input/output embeddings. {n_params:,} parameters.
Weights stored in **{dtype}** (`model.safetensors`).

## Training

AdamW (β = 0.9/0.95, weight decay 0.1, grad-norm clip 1.0), peak LR {args.lr:g},
linear warmup for {max(1, args.steps // 20)} steps then cosine decay to 10% of peak;
{args.steps} steps × batch {args.batch_size} random windows of {SEQ} tokens
({args.steps * args.batch_size * SEQ:,} tokens seen).
Training took {train_time:.0f} s; the whole script {total_time:.0f} s.
Final training loss (mean over the last {min(50, args.steps)} steps): {final_loss:.3f}.

## Evaluation

Validation perplexity **{ppl:.2f}**: first {VAL_TOKENS:,} tokens of valid.txt,
non-overlapping {SEQ}-token windows, mean NLL over all predicted tokens,
measured on the saved weights reloaded with
`AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32)`.

## Files

| file | bytes |
|---|---|
{files}

## Licence

The weights and tokenizer are derived from WikiText-2 (CC BY-SA 3.0, text from
Wikipedia); redistribute them with attribution and under compatible terms.
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
