"""A tiny random Qwen3 with a real Qwen tokenizer, and its Qwen3-MoE carves: the inputs of the engine check for Qwen3
sources (llama.cpp's converter accepts a tokenizer only when it recognises its pre-tokenizer, so the tiny model takes
the real Qwen2.5 tokenizer, which Qwen3 shares; its vocabulary, 151,936, sets the embedding size).

    .venv/bin/python scripts/tiny_qwen3.py build/qwen3 --tokenizer models/qwen2.5-coder-0.5b

Writes OUT/dense (hidden 128, 3 layers, 4 heads / 2 KV heads of head_dim 64, d_ff 192, q/k norms and norms random
in [0.5, 1.5], untied) and, with `moeify convert --weight-only --no-tune`: OUT/e4k4 (all 4 experts active: must
score as dense), OUT/e4k2 (top-2 of 4: must score as transformers scores it), OUT/e4k4-dense1 (layer 1 kept dense:
llama.cpp's qwen3moe has no dense layers, so its converter or loader is expected to refuse it) and OUT/e4k4-tied
(from a tied copy of the source). Then, for example:

    .venv/bin/python scripts/bench_llamacpp_quants.py build/qwen3/dense build/qwen3/e4k4 build/qwen3/e4k2 \\
        build/qwen3/e4k4-dense1 --quants f32 --texts ../shared/corpora/wikitext2/valid.txt --chars 20000 --ctx 128 \\
        --chunks 8 --gguf-dir build/qwen3/gguf --json results/serving/llamacpp-qwen3-tiny.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"e4k4": ["--experts", "4", "--top-k", "4"], "e4k2": ["--experts", "4", "--top-k", "2"],
           "e4k4-dense1": ["--experts", "4", "--top-k", "4", "--dense-layers", "1"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "models/qwen2.5-coder-0.5b",
                    help="a Qwen2/2.5/3 checkpoint directory whose tokenizer files are copied")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_dense

    if not (a.tokenizer / "tokenizer.json").is_file():
        ap.error(f"{a.tokenizer}/tokenizer.json not found: run scripts/get_qwen05.py or pass --tokenizer")
    tok = a.out / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        if (a.tokenizer / name).is_file():
            shutil.copyfile(a.tokenizer / name, tok / name)
    vocab = json.loads((a.tokenizer / "config.json").read_text())["vocab_size"]
    shape = dict(family="qwen3", vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}, initializer_range=0.08)
    for name, tied in (("dense", False), ("dense-tied", True)):
        if not (a.out / name / "config.json").is_file():
            build_dense(a.out / name, tok, tie_word_embeddings=tied, **shape)
    jobs = [(a.out / "dense", a.out / n, flags) for n, flags in LAYOUTS.items()]
    jobs.append((a.out / "dense-tied", a.out / "e4k4-tied", LAYOUTS["e4k4"]))
    for src, out, flags in jobs:
        if (out / "config.json").is_file():
            continue
        subprocess.run([sys.executable, "-m", "moeify", "convert", str(src), str(out), "--weight-only", "--no-tune",
                        "--format", "qwen3_moe", *flags], check=True)
        print(f"{out}: {' '.join(flags)}", flush=True)


if __name__ == "__main__":
    main()
