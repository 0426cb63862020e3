"""The 50% preset's tokens -> quality curve on the real SmolLM2, on a GPU, in one command inside a time budget:

    python3 scripts/bench_gpu_curve.py --model models/smollm2-135m --calib .gpu/curve/calib.txt \
        --eval .gpu/curve/wikitext2/valid.txt .gpu/curve/tinyshakespeare/valid.txt .gpu/curve/GPL-3 \
        --curve-points 1048576,4194304,16777216 --mix-check 4194304 --budget-s 540 --json curve.json

The 50% preset carved on the device (`moeify convert --no-tune`, calibrated), then single `moeify tune` runs of the
--curve-points totals, each from the carve, each scored on the held-out texts (perplexity ratio to dense per text,
by scripts/bench_curve.py's Scorer in this process: the dense model scored once), and the floor they approach
fitted (scripts/fit_tuning_curve.py: ratio = r_inf + c * tokens^-b); --mix-check T: one more run of T tokens with
--tune-generated 0.9 (sampled text in place of repeated real text), beside the curve's point of the same tokens. A
run the budget would stop (predicted from the last one's time a token, its scoring included) is not started.

It needs the real weights (the curve depends on them): a device machine reaches no package index, so
scripts/device_carry.py brings the model there first. CI runs it on the CPU with a tiny model (`--device cpu
--quick`, tests/test_bench_gpu.py): the numbers of that run mean nothing, only that every step still works.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from gpu_steps import SMOL, Bench, arguments, moeify


def main() -> None:
    ap = arguments(__doc__, "bench_gpu_curve")
    ap._option_string_actions["--offline"].help = "no fetching: --model must hold the real SmolLM2"
    ap.add_argument("--curve-points", default="1048576,4194304,16777216", help="comma-separated token totals, each "
                    "one run from the carve, then fitted: ratio = r_inf + c * tokens^-b [1M, 4M, 16M]")
    ap.add_argument("--mix-check", type=int, default=0, help="also one run of this many tokens with "
                    "--tune-generated 0.9, beside the curve's point of the same tokens")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--eval", type=Path, nargs="+", default=None, help="held-out texts [default: bench_curve.py's "
                    "three]")
    args = ap.parse_args()
    try:
        totals = sorted(int(t) for t in args.curve_points.split(","))
    except ValueError:
        raise SystemExit(f"--curve-points: {args.curve_points!r} is not comma-separated token totals") from None
    if args.offline and not (args.model / "config.json").is_file():
        raise SystemExit(f"the curve needs the real SmolLM2 at {args.model} (scripts/device_carry.py brings it to a "
                         "device machine)")
    b = Bench(args, curve=[], curve_fit={})
    res, budget = b.results, b.budget
    b.fetch_smollm2()
    b.smollm2()
    b.carved(SMOL, "active-50")
    curve_dir = args.work / "curve-active-50"
    scores = args.work / "curve.json"  # every point's scores (scripts/bench_curve.py's --json)

    def fresh() -> None:  # the carve again (and no stopped run's state)
        subprocess.run(["rm", "-rf", str(curve_dir), f"{curve_dir}.moeify-tune"], check=True)
        subprocess.run(["cp", "-r", str(b.carves[(SMOL, "active-50")]), str(curve_dir)], check=True)

    def point(scorer, tokens: int, *extra: str) -> dict:
        """One run of `tokens` from the carve, scored on the held-out texts."""
        t0 = time.time()
        fresh()
        r = moeify(budget, "tune", str(args.model), str(curve_dir), "--tokens", str(tokens), *extra, *b.dev,
                   json_out=True)
        ratio = scorer.point(curve_dir)["ratio"]
        scores.write_text(json.dumps(scorer.results, indent=1) + "\n")
        run = r.get("tuning", {}).get("runs", [{}])[-1]
        print(f"curve: {tokens:,} tokens {' '.join(extra)}, ratio " + " ".join(f"{v:.3f}" for v in ratio.values())
              + f" ({r['wall_s']:.0f} s tuning)", flush=True)
        return {"tokens": tokens, "tune_wall_s": r["wall_s"], "leg_with_scoring_s": time.time() - t0,
                "ratio": ratio, **{k: run.get(k) for k in (
                    "seconds_per_1k_tokens", "peak_bytes", "predicted_peak_bytes", "holdout_kl_before",
                    "holdout_kl_after", "train_kl_end", "batch_tokens", "micro_windows", "moe_kernel", "lr_scale",
                    "teacher", "text")}}

    def fits(tokens: int) -> bool:  # the next run's time from the last one's per token, with its scoring
        last = res["curve"][-1] if res["curve"] else None
        need = last["leg_with_scoring_s"] * tokens / last["tokens"] if last else 0.0
        if need > budget.left():
            res["skipped"].append(f"curve run of {tokens:,} tokens (~{need:.0f} s predicted, {budget.left():.0f} s "
                                  "left)")
            return False
        return True

    def points() -> str:  # single runs of the given totals, then the floor they approach
        from bench_curve import TEXTS, Scorer

        scorer = Scorer(args.model, args.eval or TEXTS, args.eval_tokens, 256, args.device)  # dense scored once
        for tokens in totals:
            if not fits(tokens):
                break
            res["curve"].append(point(scorer, tokens))
            b.save()
        if args.mix_check and fits(args.mix_check):  # sampled text in place of repeated real text
            res["mix"] = {"tokens": args.mix_check, "generated": 0.9,
                          **point(scorer, args.mix_check, "--tune-generated", "0.9")}
            b.save()
        from fit_tuning_curve import fit_asymptote

        for text in (res["curve"][0]["ratio"] if res["curve"] else {}):
            pts = [(p["tokens"], p["ratio"][text]) for p in res["curve"]]
            if len({t for t, _ in pts}) >= 3:
                res["curve_fit"][text] = fit_asymptote(pts)
        return f"{len(res['curve'])} points, fits: " + ", ".join(
            f"{k} r_inf {v['r_inf']:.3f} b {v['b']:.2f}" for k, v in res["curve_fit"].items())

    if (SMOL, "active-50") in b.carves:
        scores.unlink(missing_ok=True)
        b.step("curve", points, need=60)
    b.finish()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
