"""The table of BENCHMARKS.md "Granularity and shared experts", from the result files of scripts/bench_granularity.sh
(results/granularity/) beside the shipped layouts' own rows (results/quality/: the same protocol, the same texts):
each layout's perplexity ratio to dense per text, and how much nearer dense (ratio - 1) it is than the preset's
shipped layout at the same budget (negative: nearer).

    .venv/bin/python scripts/granularity_table.py            # prints the markdown table
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("wikitext2", "tinyshakespeare", "GPL-3", "argparse.py")
# the shipped layouts' rows: (model, preset, tokens) -> (result file, the checkpoint in it)
SHIPPED = {("qwen05", 25, 0): ("quality/qwen05-trainingfree.json", "out/scale-q25"),
           ("qwen05", 50, 0): ("quality/qwen05-trainingfree.json", "out/scale-q50"),
           ("qwen05", 25, 65536): ("quality/qwen05-active25-65k.json", None),
           ("qwen05", 50, 65536): ("quality/qwen05-active50-65k.json", None),
           ("smollm2", 25, 0): ("quality/smollm2-trainingfree.json", "out/scale-s25"),
           ("smollm2", 50, 0): ("quality/smollm2-trainingfree.json", "out/scale-s50"),
           ("smollm2", 25, 65536): ("quality/smollm2-active25-65k.json", None),
           ("smollm2", 50, 65536): ("quality/smollm2-active50-65k.json", None)}
NAMES = {"qwen05": "Qwen2.5-Coder-0.5B", "smollm2": "SmolLM2-135M"}
LAYOUT = {"qwen05": {25: "38 × 128 (5 + top-5 of 33)", 50: "38 × 128 (10 + top-9 of 28)"},
          "smollm2": {25: "48 × 32 (6 + top-6 of 42)", 50: "48 × 32 (12 + top-12 of 36)"}}


def ratios(path: Path, checkpoint: str | None = None) -> dict[str, float]:
    points = json.loads(path.read_text())["points"]
    p = next(p for p in points if checkpoint is None or p["checkpoint"] == checkpoint)
    return {t: p["ratio"][t] for t in TEXTS}


def rows() -> list[dict]:
    out = []
    for f in sorted((ROOT / "results" / "granularity").glob("*.json")):
        m = re.match(r"(qwen05|smollm2)-active(\d+)-(\d+)x(\d+)(-noshared)?-(trainingfree|65k)\.json", f.name)
        if not m:
            continue
        model, preset, slices, width, noshared, budget = m.groups()
        tokens = 0 if budget == "trainingfree" else 65536
        label = json.loads(f.read_text())["points"][0]["label"]
        layout = re.search(r"(\d+ x \d+.*?)\),", label) or re.search(r"(\d+ x \d+ \(.*?\))", label)
        text = layout.group(1) + (")" if layout.group(1).count("(") > layout.group(1).count(")") else "")
        text = text.replace(" x ", " × ").replace("(shared ", "(") + (", no shared expert" if noshared else "")
        out.append({"model": model, "preset": int(preset), "tokens": tokens, "file": f"results/granularity/{f.name}",
                    "layout": text, "ratio": ratios(f)})
    for (model, preset, tokens), (rel, ckpt) in SHIPPED.items():
        path = ROOT / "results" / rel
        if path.is_file() and any(r["model"] == model and r["preset"] == preset and r["tokens"] == tokens
                                  for r in out):
            out.append({"model": model, "preset": preset, "tokens": tokens, "file": f"results/{rel}",
                        "layout": LAYOUT[model][preset] + ", shipped", "ratio": ratios(path, ckpt)})
    return sorted(out, key=lambda r: (r["model"], -r["preset"], r["tokens"], "shipped" not in r["layout"]))


def markdown(rs: list[dict]) -> str:
    lines = ["| model | preset | tokens | layout | WikiText-2 | Shakespeare | GPL-3 | code | vs shipped (ratio − 1) | "
             "result |", "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rs:
        base = next((b for b in rs if b["model"] == r["model"] and b["preset"] == r["preset"]
                     and b["tokens"] == r["tokens"] and "shipped" in b["layout"]), None)
        delta = "—" if base is None or base is r else " / ".join(
            f"{(r['ratio'][t] - base['ratio'][t]) / (base['ratio'][t] - 1):+.0%}" for t in TEXTS)
        lines.append(f"| {NAMES[r['model']]} | {r['preset']}% | {r['tokens']:,} | {r['layout']} | "
                     + " | ".join(f"× {r['ratio'][t]:.3f}" for t in TEXTS)
                     + f" | {delta} | [{Path(r['file']).name}]({r['file']}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(rows()), end="")
