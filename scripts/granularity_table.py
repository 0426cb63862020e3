"""The table of BENCHMARKS.md "Granularity and shared experts", from the result files of scripts/bench_granularity.sh
(results/granularity/) beside the shipped layouts' own rows (results/quality/: the same protocol, the same texts):
each layout's perplexity ratio to dense per text, and how much nearer dense (ratio - 1) it is than the preset's
shipped layout at the same budget (negative: nearer).

    .venv/bin/python scripts/granularity_table.py            # prints the markdown table
    .venv/bin/python scripts/granularity_table.py --tradeoff # the --serve trade-off table (markdown)
    .venv/bin/python scripts/granularity_table.py --write    # writes moeify/data/granularity.json
    .venv/bin/python scripts/granularity_table.py --check    # fails if that file or BENCHMARKS.md's two tables
                                                             # are not what the result files give

The trade-off: for each measured model and preset, every --serve format whose layout differs from the K-quant one
(the default), that layout's quality (the range over the texts of the change in ratio - 1 against the K-quant
layout, training-free and after 65,536 tuning tokens, where both were measured) and decode speed (tokens/s against
the K-quant layout: llama.cpp in the format's own GGUF type, and transformers; results/granularity/decode-*.json).
`moeify plan` and `convert --dry-run` print it under their --serve table from moeify/data/granularity.json, which
tests/test_docs.py keeps equal to what this script computes from the result files.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # moeify from this checkout: the presets' own resolution
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


def nearer(mine: dict, ship: dict, text: str) -> float:
    """How much further from dense than the shipped layout (negative: nearer), in ratio - 1, on one text."""
    return (mine["ratio"][text] - ship["ratio"][text]) / (ship["ratio"][text] - 1)


def markdown(rs: list[dict]) -> str:
    lines = ["| model | preset | tokens | layout | WikiText-2 | Shakespeare | GPL-3 | code | vs shipped (ratio − 1) | "
             "result |", "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rs:
        base = next((b for b in rs if b["model"] == r["model"] and b["preset"] == r["preset"]
                     and b["tokens"] == r["tokens"] and "shipped" in b["layout"]), None)
        delta = "—" if base is None or base is r else " / ".join(
            f"{nearer(r, base, t):+.0%}" for t in TEXTS)
        lines.append(f"| {NAMES[r['model']]} | {r['preset']}% | {r['tokens']:,} | {r['layout']} | "
                     + " | ".join(f"× {r['ratio'][t]:.3f}" for t in TEXTS)
                     + f" | {delta} | [{Path(r['file']).name}]({r['file']}) |")
    return "\n".join(lines) + "\n"


# the models measured: d_ff, and the llama.cpp GGUF type each --serve format is served in (bf16: llama.cpp's f16; a
# layout no --serve format gives: Q8_0, which every width in the tables takes)
MODELS = {"qwen05": ("Qwen2.5-Coder-0.5B", 4864), "smollm2": ("SmolLM2-135M", 1536),
          "l1b": ("1.1B Llama shape", 8192), "l8b": ("Llama-3-8B shape", 14336)}
GGUF = {"k-quants": "q4_k_m", "fp8": "q8_0", "q8_0": "q8_0", "bf16": "f16", None: "q8_0"}
GGUF_NAME = {"q8_0": "Q8_0", "f16": "F16", "q4_k_m": "Q4_K_M"}
PACKAGED = ROOT / "moeify" / "data" / "granularity.json"


def resolved(d_ff: int, preset: int) -> dict[str | None, tuple[int, int, int]]:
    """--serve format (None: none given, the preset's own layout) -> (routed, shared, top_k) the preset resolves to at
    this d_ff (moeify's own resolution)."""
    from moeify.formats.config import load_preset, resolve_preset
    from moeify.formats.layout import SERVE_QUANTA

    out = {}
    for fmt in (None, *SERVE_QUANTA):
        r = resolve_preset(load_preset(ROOT / "configs" / f"active-{preset}.toml"), d_ff, serve=fmt)
        out[fmt] = (r["experts"], r["shared"], r["top_k"])
    return out


def serve_name(layout: tuple[int, int, int]) -> str:
    """(routed, shared, top_k) -> the layout's name in scripts/bench_serve.py's rows, e.g. s10e66k9."""
    n, sh, k = layout
    return (f"s{sh}" if sh else "") + f"e{n}k{k}"


def decode_ratio(model: str, engine: str, layout: str, base: str, what: str = "decode_tok_s") -> float | None:
    path = ROOT / "results" / "granularity" / f"decode-{model}-{engine}.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())["rows"]
    key = "transformers" if engine == "transformers" else "llama.cpp"
    try:
        a, b = rows[layout][key], rows[base][key]
    except KeyError:
        return None
    if a.get("status", "ok") != "ok" or b.get("status", "ok") != "ok" or what not in a or what not in b:
        return None
    return round(a[what] / b[what], 3)


def measured_layouts(quality: list[dict], model: str, preset: int) -> list[tuple[int, int, int]]:
    """(routed, shared, top_k) of every layout with a quality row at this model and preset (a shared expert)."""
    out = []
    for r in quality:
        m = re.match(r"(\d+) × (\d+) \((\d+) \+ top-(\d+) of (\d+)\)", r["layout"])
        if r["model"] == model and r["preset"] == preset and m and "no shared" not in r["layout"]:
            out.append((int(m.group(5)), int(m.group(3)), int(m.group(4))))
    return out


def tradeoff() -> list[dict]:
    """One row per (model, preset, layout other than the preset's own): the --serve formats that give it (none: a
    layout measured for comparison only), its quality against the preset's layout (min, max of the change in ratio - 1
    over the texts, training-free and tuned; None where not measured) and its decode speed and GGUF size against it."""
    quality = rows()
    out = []
    for model, (name, d_ff) in MODELS.items():
        for preset in (25, 50):
            res = resolved(d_ff, preset)
            base = res[None]
            layouts = {v: [f for f, w in res.items() if f and w == v] for v in res.values() if v != base}
            for lay in measured_layouts(quality, model, preset):
                if lay != base:
                    layouts.setdefault(lay, [])
            for lay, serve in layouts.items():
                n, sh, k = lay
                slices, width = n + sh, d_ff // (n + sh)
                row = {"model": name, "d_ff": d_ff, "preset": preset, "serve": serve, "slices": slices,
                       "width": width, "top_k": k, "shared": sh,
                       "base": {"slices": sum(base[:2]), "width": d_ff // sum(base[:2]), "top_k": base[2],
                                "shared": base[1]}}
                for tokens, key in ((0, "trainingfree"), (65536, "tuned")):
                    mine = next((r for r in quality if r["model"] == model and r["preset"] == preset
                                 and r["tokens"] == tokens and r["layout"].startswith(f"{slices} × {width} ")
                                 and "no shared" not in r["layout"]), None)
                    ship = next((r for r in quality if r["model"] == model and r["preset"] == preset
                                 and r["tokens"] == tokens and "shipped" in r["layout"]), None)
                    row[key] = None if mine is None or ship is None else [
                        round(f(nearer(mine, ship, t) for t in TEXTS), 4)
                        for f in (min, max)]
                gguf = GGUF[serve[0] if serve else None]
                mine_name, base_name = serve_name(lay), serve_name(base)
                row["decode"] = {"llama.cpp": decode_ratio(model, f"llamacpp-{gguf}", mine_name, base_name),
                                 "llama.cpp type": GGUF_NAME[gguf],
                                 "file": decode_ratio(model, f"llamacpp-{gguf}", mine_name, base_name, "gguf_bytes"),
                                 "transformers": decode_ratio(model, "transformers", mine_name, base_name)}
                d = row["decode"]
                if row["trainingfree"] or row["tuned"] or d["llama.cpp"] or d["transformers"]:  # measured
                    out.append(row)
    return out


def tradeoff_markdown(rs: list[dict]) -> str:
    pct = (lambda r: "–" if r is None else f"{r[0]:+.0%} … {r[1]:+.0%}")
    lines = ["| model (d_ff) | preset | --serve | layout | against | quality: training-free | tuned 65k | "
             "decode llama.cpp | GGUF size | decode transformers |", "|---|---|---|---|---|---|---|---:|---:|---:|"]
    for r in rs:
        d = r["decode"]
        b = r["base"]
        lines.append(f"| {r['model']} ({r['d_ff']:,}) | {r['preset']}% | {', '.join(r['serve']) or '(measured)'} | "
                     f"{r['slices']} × {r['width']}, top-{r['top_k']} | "
                     f"{b['slices']} × {b['width']}, top-{b['top_k']} | "
                     f"{pct(r['trainingfree'])} | {pct(r['tuned'])} | "
                     + ("–" if d["llama.cpp"] is None else f"× {d['llama.cpp']:.2f} ({d['llama.cpp type']})")
                     + " | " + ("–" if d["file"] is None else f"× {d['file']:.3f}")
                     + " | " + ("–" if d["transformers"] is None else f"× {d['transformers']:.2f}") + " |")
    return "\n".join(lines) + "\n"


def packaged() -> str:
    return json.dumps({"about": "the layouts --serve gives, and others measured, against each preset's own (BENCHMARKS.md "
                                "\"Granularity and shared experts\"); written by scripts/granularity_table.py --write",
                       "rows": tradeoff()}, indent=1) + "\n"


if __name__ == "__main__":
    if "--check" in sys.argv:
        if not PACKAGED.is_file() or PACKAGED.read_text() != packaged():
            sys.exit(f"{PACKAGED.relative_to(ROOT)} is not what results/ give: "
                     "run scripts/granularity_table.py --write")
        page = (ROOT / "BENCHMARKS.md").read_text()
        for what, table in (("table", markdown(rows())), ("--tradeoff table", tradeoff_markdown(tradeoff()))):
            if table not in page:
                sys.exit(f"BENCHMARKS.md does not hold this script's {what} as the result files give it now")
    elif "--write" in sys.argv:
        PACKAGED.write_text(packaged())
        print(f"wrote {PACKAGED.relative_to(ROOT)}")
    elif "--tradeoff" in sys.argv:
        print(tradeoff_markdown(tradeoff()), end="")
    else:
        print(markdown(rows()), end="")
