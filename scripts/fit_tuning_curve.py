"""Fit quality against tuning tokens and say how many tokens the quality targets need.

    python scripts/fit_tuning_curve.py results/quality/tuning-curve-points.json --layout resolved \\
        --plot results/quality/tuning-curve-fit-smollm2.png

Model (a principle, not a constant fitted to one text): the excess of the perplexity ratio over the dense model
decays as a power of the tuning tokens, ratio - 1 = c * tokens^-b (the shape of loss against training tokens in
the scaling literature, with the dense model as the floor), fitted by least squares on log(ratio - 1) against
log(tokens) for each preset and text from that preset's end-of-run points. It predicts the tokens at which the
ratio reaches a target: tokens = (c / (target - 1))^(1 / b). With two or three points per line the exponent is
uncertain: the prediction is a planning number, re-fitted as points come in.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

TARGETS = {"active-50": {"wikitext2": 1.25, "tinyshakespeare": 1.50, "GPL-3": 1.75},
           "active-25": {"wikitext2": 1.60, "tinyshakespeare": 2.10, "GPL-3": 3.00}}  # quality bars at 1M tokens


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(c, b) of ratio - 1 = c * tokens^-b by least squares in log space."""
    xs = [math.log(t) for t, _ in points]
    ys = [math.log(r - 1) for _, r in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return math.exp(my - slope * mx), -slope


def fit_asymptote(points: list[tuple[float, float]]) -> dict:
    """ratio = r_inf + c * tokens^-b: a floor r_inf (>= 1, the dense model) that more tokens approach, fitted by
    least squares: for each exponent b on a grid (0.02-2), (r_inf, c) are linear, solved in closed form (r_inf held
    at 1 where the unconstrained floor falls below it); the b with the least squared error wins. Three points
    determine it exactly: a planning number, not a law. Returns r_inf, c, b, the residual RMS and the ratio the fit
    gives at 16M, 64M and 256M tokens."""
    if len({t for t, _ in points}) < 3:
        raise ValueError("the floor needs at least 3 distinct token counts")
    best = None
    for k in range(1, 101):
        b = 0.02 * k
        xs = [t ** -b for t, _ in points]
        ys = [r for _, r in points]
        n, sx, sy = len(xs), sum(xs), sum(ys)
        sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
        det = n * sxx - sx * sx
        c = (n * sxy - sx * sy) / det if det else 0.0
        r_inf = (sy - c * sx) / n
        if r_inf < 1.0:  # the floor cannot be below dense
            r_inf = 1.0
            c = sum(x * (y - 1.0) for x, y in zip(xs, ys)) / sxx
        sse = sum((r_inf + c * x - y) ** 2 for x, y in zip(xs, ys))
        if best is None or sse < best[0]:
            best = (sse, r_inf, c, b)
    sse, r_inf, c, b = best
    return {"r_inf": r_inf, "c": c, "b": b, "rms": math.sqrt(sse / len(points)),
            "at": {str(t): r_inf + c * t ** -b for t in (16 << 20, 64 << 20, 256 << 20)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", type=Path)
    ap.add_argument("--machine", default=None, help="only the points of this machine")
    ap.add_argument("--layout", default="fixed", help="only the points of this preset layout: fixed (the presets' "
                    "64 slices of d_ff, before per-model resolution) or resolved (per model: SmolLM2 48 slices of 32) "
                    "[default: fixed]")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    pts = [p for p in json.loads(args.points.read_text())["points"] if args.machine in (None, p["machine"])
           and p.get("layout", "fixed") == args.layout]
    lines = {}
    for p in pts:
        for text, r in p["ratio"].items():
            lines.setdefault((p["preset"], text), []).append((p["tokens"], r))
    print(f"{'preset':10s} {'text':16s} {'points':>6s} {'b':>6s} {'at 1M':>7s} {'target':>7s} {'tokens for target':>18s}")
    fits = {}
    for (preset, text), line in sorted(lines.items()):
        line = sorted(line)
        if len({t for t, _ in line}) < 2:
            continue
        c, b = fit(line)
        fits[(preset, text)] = (c, b, line)
        target = TARGETS.get(preset, {}).get(text)
        need = (c / (target - 1)) ** (1 / b) if target and b > 0 else float("inf")
        print(f"{preset:10s} {text:16s} {len(line):6d} {b:6.3f} {1 + c * (2**20) ** -b:7.3f} "
              f"{target or float('nan'):7.2f} {need:18,.0f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        presets = [p for p in ("active-50", "active-25") if any(pr == p for pr, _ in fits)]  # those with a fit
        fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 4.2), sharex=True, squeeze=False)
        for ax, preset in zip(axes[0], presets):
            for (pr, text), (c, b, line) in fits.items():
                if pr != preset:
                    continue
                xs = [t for t, _ in line]
                (h,) = ax.plot(xs, [r for _, r in line], "o", label=f"{text} (b = {b:.2f})")
                grid = [2 ** (k / 4) for k in range(4 * 15, 4 * 24 + 1)]
                ax.plot(grid, [1 + c * g ** -b for g in grid], "-", color=h.get_color(), alpha=0.5)
                target = TARGETS[preset].get(text)
                if target:
                    ax.axhline(target, color=h.get_color(), ls=":", alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{preset}: perplexity ratio to dense vs tuning tokens")
            ax.set_xlabel("tuning tokens")
            ax.set_ylabel("perplexity ratio (MoE / dense)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
