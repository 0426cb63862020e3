"""Plot the tokens -> quality curve of recovery tuning from scripts/bench_quality.py results run with --curve.

    python scripts/plot_tuning_curve.py p50.json p25.json -o results/quality/smollm2-64slices-tuning-131k.png

One panel per evaluation text: perplexity ratio to dense (log scale) against the tuning tokens seen so far, one line
per row (preset). The first point of each line (0 tokens) is the training-free carve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def markdown_table(runs: list[dict], texts: list[str]) -> str:
    """One row per (preset, tokens): the perplexity ratio to dense on every text."""
    lines = ["| preset | tuning tokens | " + " | ".join(texts) + " |", "|---|---:|" + "---:|" * len(texts)]
    for run in runs:
        for row in run["rows"]:
            name = row["config"].split("/")[-1].removesuffix(".toml")
            for point in row.get("curve") or []:
                ratios = [point["ppl"][t] / run["dense_ppl"][t] for t in texts]
                lines.append(f"| {name} | {point['tokens']:,} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")
            if row.get("ratio") and row.get("tuning"):
                kept = row["tuning"]
                lines.append(f"| {name}, kept weights (step {kept['step_kept']}) | {kept['tokens']:,} | "
                             + " | ".join(f"**{row['ratio'][t]:.3f}**" for t in texts) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("-o", "--out", type=Path, default=Path("tuning_curve.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text()) for p in args.results]
    texts = list(runs[0]["dense_ppl"])
    print(markdown_table(runs, texts))
    fig, axes = plt.subplots(1, len(texts), figsize=(4.2 * len(texts), 3.6), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for run in runs:
            dense = run["dense_ppl"][text]
            for row in run["rows"]:
                if not row.get("curve"):
                    continue
                xs = [max(p["tokens"], 1024) / 1024 for p in row["curve"]]
                ys = [p["ppl"][text] / dense for p in row["curve"]]
                label = f"{row['config'].split('/')[-1].removesuffix('.toml')} ({row['active']:.0%} active)"
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tuning tokens (K; first point: none)")
        ax.set_ylabel("perplexity / dense")
        ax.set_title(text, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
