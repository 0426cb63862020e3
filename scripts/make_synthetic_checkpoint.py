"""Write a random-weight dense checkpoint with a real model's shape and tensor names, streaming tensor by tensor.

    python scripts/make_synthetic_checkpoint.py /tmp/bench/llama3-8b                      # Llama-3-8B shape (16 GB)
    python scripts/make_synthetic_checkpoint.py /tmp/bench/l1b --shape llama3.2-1b
    python scripts/make_synthetic_checkpoint.py /tmp/tiny --shape tiny --layers 2 --dtype float32
    python scripts/make_synthetic_checkpoint.py /tmp/x --hidden 1024 --intermediate 4096 --layers 4 --heads 8 \
        --kv-heads 2 --vocab 32000 --tokenizer path/with/tokenizer.json

The shards are planned up front (moeify.formats.checkpoint.ShardLayout) and every tensor is generated, written and
dropped before the next one (moeify.formats.checkpoint.ShardWriter), so memory stays at about one tensor whatever
the model size. Writes config.json (a real llama/mistral config), model.safetensors.index.json (when more
than one shard) and generation_config.json; no tokenizer unless --tokenizer names a directory to copy one
from (the weight-only `moeify convert` needs none; calibration does).

Weights are seeded normal(0, --std) like a freshly initialised model (std 0.02); RMSNorm weights are
1 + normal(0, 0.05) so that norm scales are not all equal. There is no cluster structure in gate_proj:
this is a speed/memory fixture, not a quality one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.formats.checkpoint import DTYPE_NAMES, TensorInfo  # noqa: E402
from moeify.formats.writer import ShardLayout, ShardWriter
from moeify.formats.config import parse_size  # noqa: E402

# name: (hidden, intermediate, layers, heads, kv_heads, vocab, tied, rope_theta, max_positions)
SHAPES = {
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256, False, 500000.0, 8192),
    "llama3-70b": (8192, 28672, 80, 64, 8, 128256, False, 500000.0, 8192),
    "llama3.2-1b": (2048, 8192, 16, 32, 8, 128256, True, 500000.0, 131072),
    "llama3.2-3b": (3072, 8192, 28, 24, 8, 128256, True, 500000.0, 131072),
    "mistral-7b": (4096, 14336, 32, 32, 8, 32768, False, 1000000.0, 32768),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, True, 100000.0, 8192),
    "tiny": (64, 256, 2, 4, 2, 512, False, 10000.0, 256),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def build_config(a: argparse.Namespace) -> dict:
    head_dim = a.head_dim or a.hidden // a.heads
    cfg = {
        "architectures": ["MistralForCausalLM" if a.model_type == "mistral" else "LlamaForCausalLM"],
        "model_type": a.model_type, "hidden_size": a.hidden, "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
        "head_dim": head_dim, "vocab_size": a.vocab, "max_position_embeddings": a.max_positions,
        "rms_norm_eps": 1e-5, "rope_theta": a.rope_theta, "hidden_act": "silu", "initializer_range": a.std,
        "tie_word_embeddings": a.tied, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": a.dtype, "use_cache": True,
    }
    if a.model_type == "mistral":
        cfg["sliding_window"] = None
    return cfg


def tensor_plan(a: argparse.Namespace, dtype: torch.dtype) -> list[TensorInfo]:
    """The tensors of a dense llama/mistral checkpoint, in layer order."""
    h, f, v = a.hidden, a.intermediate, a.vocab
    hd = a.head_dim or h // a.heads
    q, kv = a.heads * hd, a.kv_heads * hd
    out = [TensorInfo("model.embed_tokens.weight", dtype, (v, h))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [TensorInfo(p + "input_layernorm.weight", dtype, (h,)),
                TensorInfo(p + "self_attn.q_proj.weight", dtype, (q, h)),
                TensorInfo(p + "self_attn.k_proj.weight", dtype, (kv, h)),
                TensorInfo(p + "self_attn.v_proj.weight", dtype, (kv, h)),
                TensorInfo(p + "self_attn.o_proj.weight", dtype, (h, q)),
                TensorInfo(p + "post_attention_layernorm.weight", dtype, (h,)),
                TensorInfo(p + "mlp.gate_proj.weight", dtype, (f, h)),
                TensorInfo(p + "mlp.up_proj.weight", dtype, (f, h)),
                TensorInfo(p + "mlp.down_proj.weight", dtype, (h, f))]
    out.append(TensorInfo("model.norm.weight", dtype, (h,)))
    if not a.tied:
        out.append(TensorInfo("lm_head.weight", dtype, (v, h)))
    return out


def random_tensor(t: TensorInfo, std: float, gen: torch.Generator) -> torch.Tensor:
    """Generated directly in the target dtype (no float32 temporary of the whole tensor)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    if "norm" in t.name:
        return out.normal_(1.0, 0.05, generator=gen)
    return out.normal_(0.0, std, generator=gen)


def make_checkpoint(a: argparse.Namespace, log=print) -> Path:
    out = Path(a.out)
    if out.exists():
        if not a.overwrite:
            raise SystemExit(f"{out} exists; pass --overwrite")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    dtype = DTYPE_NAMES[a.dtype]
    tensors = tensor_plan(a, dtype)
    layout = ShardLayout.plan(tensors, parse_size(a.max_shard_size))
    total = layout.total_bytes()
    log(f"{out}: {sum(t.nbytes for t in tensors) / 2 ** 30:.2f} GiB in {len(layout.files)} shard(s), "
        f"{len(tensors)} tensors")
    gen = torch.Generator().manual_seed(a.seed)
    writer = ShardWriter(out, layout)
    t0, done = time.time(), 0
    try:
        for t in tensors:
            writer.write(t.name, random_tensor(t, a.std, gen))
            done += t.nbytes
            if a.verbose and t.name.endswith("down_proj.weight"):
                log(f"  {t.name}: {done / 2 ** 30:.1f}/{total / 2 ** 30:.1f} GiB, {time.time() - t0:.0f} s")
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    (out / "config.json").write_text(json.dumps(build_config(a), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    if a.tokenizer:
        for name in TOKENIZER_FILES:
            src = Path(a.tokenizer) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
    log(f"wrote {out} in {time.time() - t0:.1f} s")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="base shape [llama3-8b]")
    for flag in ("hidden", "intermediate", "layers", "heads", "kv-heads", "vocab", "head-dim", "max-positions"):
        p.add_argument(f"--{flag}", type=int, default=None, help="override the shape's value")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie_word_embeddings")
    p.add_argument("--model-type", default="llama", choices=("llama", "mistral"))
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_NAMES))
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="directory to copy tokenizer files from (vocab must fit)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="progress per layer")
    a = p.parse_args(argv)
    h, f, n, heads, kv, v, tied, theta, maxpos = SHAPES[a.shape]
    defaults = dict(hidden=h, intermediate=f, layers=n, heads=heads, kv_heads=kv, vocab=v, tied=tied,
                    max_positions=maxpos)
    for k, val in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, val)
    a.rope_theta = theta
    return a


def main(argv=None) -> None:
    make_checkpoint(parse_args(argv))


if __name__ == "__main__":
    main()
