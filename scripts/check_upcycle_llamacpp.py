"""Upcycled MoEs in llama.cpp: are the exact constructions exact there too?

    .venv/bin/python scripts/check_upcycle_llamacpp.py --json results/upcycling/exactness-smollm2-llamacpp.json
    .venv/bin/python scripts/check_upcycle_llamacpp.py --model models/qwen2.5-coder-0.5b --rows s25e2g1k2,s25e4g2k4 \
        --clean --json results/upcycling/exactness-qwen05-llamacpp.json

`moeify upcycle` of SmolLM2-135M (models/smollm2-135m, or --model) into Mixtral (--rows): identical copies at full
width (E4 top-2), a fine-grained upcycle (E4 G4 top-4, virtual-group router rows, down_proj × 4), the same with each copy's slices
permuted, and Drop-Upcycling (r = 0.5, not exact: how far it is); each through llama.cpp's own converter
(convert_hf_to_gguf.py, --outtype f32) and `llama-perplexity -c 256` on the first --eval-chars of WikiText-2 valid,
beside the dense model's GGUF on the same text. Exact means the same perplexity (llama.cpp computes a renormalised
top-k for Mixtral: `llm_graph_context::build_moe_ffn` with norm_w). A Qwen2 source (its q/k/v biases) upcycles into
Qwen2-MoE, which llama.cpp runs only with a shared expert and never renormalises (src/models/qwen2moe.cpp: norm_w
false): exact there only with every routed expert active (e.g. s25e2g1k2); a sparse top-k (s25e4g2k4) measures the
cost of the missing renormalisation. The llama.cpp tree, its converter venv and llama-perplexity are
scripts/check_llamacpp.py's (built once into --work).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_llamacpp as llc  # noqa: E402
from bench_upcycle import parse_layout  # noqa: E402

ROWS = {  # id: (label, flags). E4 by default: four float32 checkpoints and GGUFs of ~1.5 GB each (SmolLM2)
    "e4k2": ("E4 top-2, identical copies", ["--copies", "4", "--top-k", "2", "--symmetry", "none"]),
    "e4g4k4": ("E4 G4 top-4 (virtual groups)",
               ["--copies", "4", "--granularity", "4", "--top-k", "4", "--symmetry", "none"]),
    "e4g4k4-permute": ("E4 G4 top-4, slices permuted",
                       ["--copies", "4", "--granularity", "4", "--top-k", "4", "--symmetry", "permute"]),
    "e4k2-drop": ("E4 top-2, drop r=0.5 (not exact)",
                  ["--copies", "4", "--top-k", "2", "--symmetry", "drop", "--drop-share", "0.5"]),
    "e8k2": ("E8 top-2, identical copies", ["--copies", "8", "--top-k", "2", "--symmetry", "none"]),
    "e8g8k8": ("E8 G8 top-8 (virtual groups: the dense model's compute)",
               ["--copies", "8", "--granularity", "8", "--top-k", "8", "--symmetry", "none"]),
}
DEFAULT_ROWS = "e4k2,e4g4k4,e4g4k4-permute,e4k2-drop"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "llamacpp")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-chars", type=int, default=100_000)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, of {', '.join(ROWS)} (default: {DEFAULT_ROWS})")
    ap.add_argument("--clean", action="store_true", help="delete each upcycle and its GGUF once scored (a 0.5B's E8 in "
                    "float32 is 11 GB, and its GGUF as much)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    d_ff = json.loads((args.model / "config.json").read_text())["intermediate_size"]
    rows = []
    for r in args.rows.split(","):
        if r in ROWS:
            rows.append(ROWS[r])
        elif re.fullmatch(r"(?:s\d+)?e\d+g\d+k\d+", r):  # a layout as scripts/bench_upcycle.py names them
            rows.append((f"{r} (identical copies)", parse_layout(r, d_ff) + ["--symmetry", "none"]))
        else:
            ap.error(f"--rows: unknown {r}; choose from {', '.join(ROWS)} or a layout such as s25e2g1k2")
    top = llc.fetch_llamacpp(args.work, llc.PIN)
    exe = llc.build_perplexity(args.work, top, llc.PIN)
    py = llc.converter_python(args.work)
    gguf_py = llc.fixed_gguf_py(top, args.work, llc.PIN)
    up = args.work / "upcycle"
    up.mkdir(parents=True, exist_ok=True)
    text = up / "wikitext2-valid-cut.txt"
    text.write_text(llc.EVAL.read_text()[: args.eval_chars])
    model = args.model.resolve()
    result = {"model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model), "llama_cpp_python": llc.PIN, "llama_cpp": llc.llamacpp_commit(top),
              "date": time.strftime("%Y-%m-%d"), "ctx": args.ctx, "chunks": args.chunks, "eval_chars": args.eval_chars,
              "rows": {}}

    def score(name: str, path: Path) -> dict:
        gguf = up / f"{llc.slug(name)}.gguf"
        err = llc.to_gguf(py, top, path, gguf, gguf_py)
        row = {"error": err} if err else llc.perplexity(exe, gguf, text, args.ctx, args.chunks, args.threads,
                                                         up / f"{llc.slug(name)}.log")
        print(name, row, flush=True)
        return row

    result["rows"]["dense"] = score("dense", args.model)
    for name, flags in rows:
        out = up / llc.slug(name)
        if not (out / "report.json").is_file():
            subprocess.run([str(ROOT / ".venv" / "bin" / "moeify"), "upcycle", str(args.model), str(out), "--dtype",
                            "float32", "--overwrite", *flags], check=True, capture_output=True)
        row = score(name, out)
        row["check"] = json.loads((out / "report.json").read_text())["check"]
        d = result["rows"]["dense"].get("ppl")
        if row.get("ppl") and d:
            row["ratio_to_dense"] = row["ppl"] / d
        result["rows"][name] = row
        if args.clean:
            shutil.rmtree(out)
            (up / f"{llc.slug(name)}.gguf").unlink(missing_ok=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
