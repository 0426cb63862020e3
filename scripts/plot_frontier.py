"""Draw the quality frontier (perplexity ratio vs share of the FFN active) from bench_quality.py results.

    python scripts/plot_frontier.py results/quality/smollm2-trainingfree-frontier.json \\
        -o results/quality/smollm2-trainingfree-frontier.png

One panel per evaluation text, one line per row kind (method / router / pipeline), log-scale ratio. Needs the
`plot` (or `bench`) extra: matplotlib.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+", help="bench_quality.py --json files (rows are merged)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text()) for p in args.results]
    texts = list(runs[0]["dense_ppl"])
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    for ax, text in zip(axes[0], texts):
        lines = defaultdict(list)
        for run in runs:
            for r in run["rows"]:
                label = r["row"] if r["row"] != "preset" else f"preset ({Path(r['config']).stem})"
                label = "preset" if label.startswith("preset") else label
                lines[label].append((r["active"], r["ratio"][text]))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_yscale("log")
        ax.set_xlabel("FFN neurons active per token (%)")
        ax.set_ylabel("perplexity / dense")
        ax.set_title(f"{Path(runs[0]['model']).name}: {text} (held out)")
        ax.grid(True, which="both", alpha=0.3)
        ax.axhline(1.0, color="black", lw=0.8)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
