"""Draw the task-retention frontier: each carve's retention of its dense model's zero-shot accuracy (with its paired
SE, from scripts/bench_tasks.py results) against the decode speed its layout gets over dense (llama.cpp, from a
scripts/bench_serve.py result at one shape), one line per model.

    python scripts/plot_task_frontier.py --decode results/serving/llamacpp-l1b-presets-q8_0.json \\
        --point SmolLM2-135M results/quality/tasks-smollm2-active75-1000.json smollm2-a75 s32e32k16 \\
        --point SmolLM2-135M results/quality/tasks-smollm2-active75-1000.json smollm2-a50 s16e48k16 \\
        ... -o results/quality/task-frontier.png --json results/quality/task-frontier.json

--point MODEL TASKS CARVE LAYOUT: the carve named CARVE in the TASKS file (its retention), drawn at the decode speed
of LAYOUT ([sS]eEkK, a row of the --decode file) over that file's dense row. The dense model is the point (1, 100%).
Needs the `plot` (or `bench`) extra: matplotlib.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def speedup(decode: dict, layout: str) -> float:
    rows = decode["rows"]
    if layout not in rows:
        raise SystemExit(f"--point: layout {layout} is not a row of the --decode file (rows: {', '.join(rows)})")
    tok_s = {k: (v.get("llama.cpp") or {}).get("decode_tok_s") for k, v in rows.items()}
    if not tok_s.get("dense") or not tok_s[layout]:
        raise SystemExit(f"--decode: no llama.cpp decode speed for dense or {layout}")
    return tok_s[layout] / tok_s["dense"]


def retention(tasks_file: Path, carve: str) -> dict:
    kept = json.loads(tasks_file.read_text())["retention"]["models"]
    if carve not in kept:
        raise SystemExit(f"--point: {carve} is not a carve of {tasks_file} (carves: {', '.join(kept)})")
    return {"retention": kept[carve]["retention"], "retention_se": kept[carve]["retention_se"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", type=Path, required=True, help="a scripts/bench_serve.py --json result")
    ap.add_argument("--point", nargs=4, action="append", required=True, metavar=("MODEL", "TASKS", "CARVE", "LAYOUT"))
    ap.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--json", type=Path, help="also write the points drawn")
    args = ap.parse_args()
    decode = json.loads(args.decode.read_text())
    points = []
    for model, tasks, carve, layout in args.point:
        points.append({"model": model, "carve": carve, "layout": layout, "tasks_file": tasks,
                       "decode_over_dense": speedup(decode, layout), **retention(Path(tasks), carve)})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = defaultdict(list)
    for p in points:
        lines[p["model"]].append(p)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for model, pts in lines.items():
        pts = [{"decode_over_dense": 1.0, "retention": 1.0, "retention_se": 0.0, "layout": "dense"}] + \
            sorted(pts, key=lambda p: p["decode_over_dense"])
        ax.errorbar([p["decode_over_dense"] for p in pts], [100 * p["retention"] for p in pts],
                    yerr=[100 * p["retention_se"] for p in pts], marker="o", capsize=3, label=model)
        for p in pts[1:]:
            ax.annotate(p["layout"], (p["decode_over_dense"], 100 * p["retention"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xlabel(f"decode speed over dense (llama.cpp {decode.get('outtype', '')}, {decode['model']}, "
                  f"{decode.get('threads')} thread)")
    ax.set_ylabel("task retention, % of dense accuracy (± paired SE)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    if args.json:
        args.json.write_text(json.dumps({"decode_file": str(args.decode), "points": points}, indent=1) + "\n")
    for p in points:
        print(f"{p['model']:<22} {p['carve']:<16} {p['layout']:<10} decode x{p['decode_over_dense']:.2f}  "
              f"retention {p['retention']:.1%} ± {p['retention_se']:.1%}")


if __name__ == "__main__":
    main()
