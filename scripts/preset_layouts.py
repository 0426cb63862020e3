"""The presets' layouts at the shapes people carve, as the table of docs/converting.md ("Presets at your model's
shape"): each row is `moeify plan --preset` of the model's published config (the same resolution `convert` does), not
typed by hand.

    python scripts/preset_layouts.py                                # print the markdown table
    python scripts/preset_layouts.py --write [docs/converting.md]   # replace the table between its markers
    python scripts/preset_layouts.py --check [docs/converting.md]   # exit 1 if the page's table is not what plan says

tests/test_layout.py checks docs/converting.md against this script.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = ROOT / "docs" / "converting.md"  # the page whose table this is
BEGIN = "<!-- preset-layouts:begin (scripts/preset_layouts.py --write docs/converting.md) -->"
END = "<!-- preset-layouts:end -->"
PRESETS = ("active-75", "active-50", "active-25")

# Published config.json values that plan reads (hidden, d_ff, layers, heads, kv heads, vocab, tied embeddings).
SHAPES = [
    ("SmolLM2-135M", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)),
    ("SmolLM2-360M", dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                          num_key_value_heads=5, vocab_size=49152, tie_word_embeddings=True)),
    ("TinyLlama-1.1B", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                            num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)),
    ("Llama-3.2-1B", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)),
    ("Llama-3.2-3B", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)),
    ("SmolLM2-1.7B", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True)),
    ("Llama-2-7B", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)),
    ("Llama-2-13B", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                         num_key_value_heads=40, vocab_size=32000, tie_word_embeddings=False)),
    ("Llama-3/3.1-8B", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    ("Mistral-7B", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False, model_type="mistral")),
    ("Mistral-Nemo-12B", dict(hidden_size=5120, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=131072, tie_word_embeddings=False,
                              model_type="mistral")),
    ("Llama-3/3.1-70B", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    # Qwen2.5 (and Qwen2.5-Coder): q/k/v biases, so the Qwen2-MoE format whatever the layout
    ("Qwen2.5-0.5B", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2")),
    ("Qwen2.5-1.5B", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2")),
    ("Qwen2.5-3B", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2")),
    ("Qwen2.5-7B", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2")),
    ("Qwen2.5-14B", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                         num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2")),
    ("Qwen2.5-32B", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                         num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2")),
    ("Qwen2.5-72B", dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2")),
]


def plan_rows() -> list[dict]:
    """One entry per (shape, preset): moeify.evaluation.planning.plan_preset on the published config."""
    from moeify.formats.families import read_source_config
    from moeify.evaluation.planning import plan_preset, serving_fit

    rows = []
    with tempfile.TemporaryDirectory(prefix="moeify-layouts-") as tmp:
        for name, cfg in SHAPES:
            model_type = cfg.get("model_type", "llama")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps({"architectures": [arch], "model_type": model_type, "hidden_act": "silu",
                                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, **cfg}))
            src = read_source_config(path)
            for preset in PRESETS:
                plan = plan_preset(src, ROOT / "configs" / f"{preset}.toml")  # the preset's own widths: k-quants
                carve = next(r for r in plan.regimes if r.name == "inference saving")
                fit = {rule.name: tp for rule, tp in serving_fit(carve.expert_width)}
                fails = sorted({n.engine for n in plan.engine_notes() if n.fails})
                alt = {a["serve"]: f"{a['experts'] + a['shared']}×{a['width']}" for a in plan.alternatives}
                rows.append({"model": name, "d_ff": src.d_ff, "preset": preset, "experts": plan.experts,
                             "engines_failing": fails, "serve": alt,
                             "shared": plan.shared, "top_k": plan.top_k, "width": carve.expert_width,
                             "active": (plan.shared + plan.top_k) / (plan.experts + plan.shared),
                             "active_params": carve.budget.active_ratio, "serving": fit})
    return rows


def _fits(tp: int, per_gpu: bool) -> str:
    return "no" if not tp else ("yes" if not per_gpu else f"TP ≤ {tp}")


def markdown(rows: list[dict]) -> str:
    """Rows of one d_ff and preset are merged (the layout depends only on d_ff)."""
    from moeify.evaluation.planning import SERVING_RULES

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["d_ff"], r["preset"], tuple(r["engines_failing"])), []).append(r)
    names = {rule.name: rule for rule in SERVING_RULES}
    lines = ["| models (d_ff) | preset | experts: shared + top-k of routed | width | active | Q8_0 | K-quants "
             "| vLLM FP8 / Marlin | `--serve` k-quants · fp8 · q8_0 · bf16 |", "|---|---|---|---:|---:|---|---|---|---|"]
    for (d_ff, preset, fails), rs in groups.items():
        r = rs[0]
        models = ", ".join(x["model"] for x in rs) + f" ({d_ff:,})"
        if fails:  # e.g. vLLM's Qwen2-MoE with head_dim != hidden / heads (Mistral-Nemo): convert says what to do
            models += f" [{', '.join(fails)}: not this layout]"
        s = r["serving"]
        vllm = _fits(s["vLLM FP8 block"], True)
        marlin = _fits(s["vLLM int4 Marlin"], True)
        lines.append(f"| {models} | {preset} | {r['shared']} + {r['top_k']} of {r['experts']} "
                     f"({r['shared'] + r['experts']} slices) | {r['width']} | {r['active']:.1%} "
                     f"| {_fits(s['llama.cpp Q8_0'], names['llama.cpp Q8_0'].per_gpu)} "
                     f"| {_fits(s['llama.cpp K-quants'], names['llama.cpp K-quants'].per_gpu)} "
                     f"| {vllm if vllm == marlin else vllm + ' / ' + marlin} "
                     f"| {' · '.join(r['serve'][f] for f in ('k-quants', 'fp8', 'q8_0', 'bf16'))} |")
    return "\n".join(lines) + "\n"


def page_table(page: str) -> str:
    """The table between the markers of a page's text."""
    if BEGIN not in page or END not in page:
        raise SystemExit(f"the page has no {BEGIN} ... {END} markers")
    return page.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path, nargs="?", const=PAGE,
                    help="Replace the table between the markers in this file [default: docs/converting.md].")
    ap.add_argument("--check", type=Path, nargs="?", const=PAGE,
                    help="Exit 1 when this file's table differs from plan's [default: docs/converting.md].")
    args = ap.parse_args()
    table = markdown(plan_rows())
    if args.write:
        text = args.write.read_text()
        page_table(text)  # the markers are there
        head, rest = text.split(BEGIN, 1)
        args.write.write_text(head + BEGIN + "\n" + table + END + rest.split(END, 1)[1])
        print(f"wrote the table to {args.write}", file=sys.stderr)
    elif args.check:
        if page_table(args.check.read_text()) != table:
            print(f"{args.check}: the preset layout table differs from `moeify plan`; run "
                  f"python scripts/preset_layouts.py --write {args.check}", file=sys.stderr)
            return 1
        print(f"{args.check}: the preset layout table matches plan", file=sys.stderr)
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
