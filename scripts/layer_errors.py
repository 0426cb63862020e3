"""The carve's per-layer errors side by side: each output's report.json (convert's record of every carved layer, on
its calibration tokens) summarised by depth, so carves of different models can be compared layer for layer.

    .venv/bin/python scripts/layer_errors.py out/scale-q50 out/scale-s50 [--json errors.json]

Per output: the relative error of each carved FFN's output after the carve (`rel_error`: |carved - dense| / |dense|
over the calibration tokens, after routing, refit and feed correction), before the refit (`rel_error_before`), and
the fitted router's agreement with the best top-k by true expert output (`agreement_fitted`), as the mean over all
layers and over each third of the depth (first, middle, last), plus the worst layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = ("rel_error", "rel_error_before", "agreement_fitted")


def summary(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    layers = [e for e in report["layers"] if not e.get("dense")]
    n = len(layers)
    thirds = [layers[: n // 3], layers[n // 3: 2 * n // 3], layers[2 * n // 3:]]
    row = {"output": str(out), "source": report.get("source"), "layers": n,
           "active": report.get("ffn_flops_ratio"), "layout": report.get("settings", {}).get("experts")}
    for key in KEYS:
        values = [e[key] for e in layers if isinstance(e.get(key), (int, float))]
        if not values:
            continue
        row[key] = {"mean": statistics.fmean(values),
                    "thirds": [statistics.fmean(e[key] for e in t) if t else None for t in thirds],
                    "worst": max(values) if key.startswith("rel_error") else min(values),
                    "worst_layer": layers[values.index(max(values) if key.startswith("rel_error") else min(values))][
                        "layer"]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outputs", type=Path, nargs="+")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [summary(o) for o in args.outputs]
    print(f"{'output':<28} {'layers':>6} {'rel_error mean':>15} {'by thirds':>20} {'worst (layer)':>14} "
          f"{'router agree':>12}")
    for r in rows:
        e, a = r.get("rel_error", {}), r.get("agreement_fitted", {})
        thirds = " / ".join(f"{v:.3f}" for v in e.get("thirds", []) if v is not None)
        print(f"{Path(r['output']).name:<28} {r['layers']:>6} {e.get('mean', float('nan')):>15.3f} {thirds:>20} "
              f"{e.get('worst', float('nan')):>8.3f} ({e.get('worst_layer', '-')}) {a.get('mean', float('nan')):>12.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
