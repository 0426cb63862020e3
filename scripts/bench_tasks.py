"""Zero-shot task accuracy of a dense model and its MoE carves, as the field reports quality: the six standard tasks
(ARC-Easy, ARC-Challenge, PIQA, HellaSwag, BoolQ, LAMBADA) through lm-evaluation-harness, every model on the same
items, with the difference to the dense model and its paired standard error.

    python scripts/bench_tasks.py models/smollm2-135m out/smollm2-a50 out/smollm2-a25 \\
        --task-data ../shared/tasks --limit 500 --out results/quality/tasks-smollm2-trainingfree.json

`moeify eval DENSE MOE... --tasks ... --task-data ...` measures it (moeify.api.evaluate: the bundled task definitions
over the local files, lm-eval's HFLM over each loaded model); this program runs it for the six tasks and writes what
it measured as JSON: per task the items scored (the first --limit of each set, or all with --limit 0), per model
acc (and acc_norm, LAMBADA's perplexity) ± SE, and for each MoE the difference to the dense model ± its paired SE
and the relative drop; plus the generation health (repeated 4-grams of greedy continuations) and the perplexity on
the bundled held-out sample. Needs `pip install -e '.[tasks]'`; models named by folder (no local paths recorded).
Each model's answers are kept in --cache as they are computed (`moeify eval --task-cache`): a run stopped part-way
resumes, and the dense model scored in an earlier run is not scored again (the file says how many answers each
model reused).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.evaluation.tasks import BUNDLED  # noqa: E402


def summary(result, names: list[str], limit: int | None, seconds: float) -> dict:
    """The measurement as the result file records it: numbers by task, metric and model name."""
    tasks = {}
    for task, t in result.tasks["tasks"].items():
        per_model = {}
        for metric, entries in t["metrics"].items():
            for name, e in zip(names, entries):
                per_model.setdefault(name, {})[metric] = {k: e[k] for k in ("value", "se")} | (
                    {} if e["diff"] is None else {"diff": e["diff"], "diff_se": e["diff_se"], "relative": e["relative"]})
        tasks[task] = {"n": t["n"], "of": t["of"], "num_fewshot": t["num_fewshot"], "models": per_model}
    models = {}
    for name, m in zip(names, result.models):
        g = m.generation or {}
        models[name] = {"model_type": m.model_type, "total_params": m.total_params, "active_params": m.active_params,
                        "perplexity_sample": m.perplexity, "perplexity_ratio": m.ratio,
                        "repeated_4grams": g.get("repeated"), "repeated_4grams_se": g.get("se"),
                        "repeated_4grams_diff": g.get("diff"), "repeated_4grams_diff_se": g.get("diff_se")}
    return {
        "what": "zero-shot accuracy of the dense model and its MoE carves (lm-evaluation-harness, the bundled task "
                "definitions over shared/tasks; every model on the same items); diff: model - dense (perplexity: "
                "model / dense) with the paired SE (sd of per-item differences / sqrt n); relative: diff / dense",
        "reference": names[0], "limit": limit, "lm_eval": result.tasks["lm_eval"],
        "device": result.settings["device"], "dtype": result.settings["dtype"],
        "perplexity_sample": {"tokens": result.data["tokens"], "seq_len": result.settings["seq_len"]},
        "generation": result.settings.get("generation"), "tasks": tasks, "models": models,
        "retention": retention_summary(result.tasks["retention"], names),
        "seconds": round(seconds, 1), "task_seconds": result.tasks["seconds"],
        # answers read from --cache rather than computed (a model scored in an earlier run): not in task_seconds
        "task_answers_reused": result.tasks.get("reused"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
    }


def retention_summary(r: dict, names: list[str]) -> dict:
    """Each MoE's retention of the dense model's accuracy (moeify.evaluation.tasks.retention), by model name."""
    return {"informative_ses": r["informative_ses"], "tasks": r["tasks"], "informative": r["informative"],
            "models": {name: {k: v for k, v in m.items() if k != "path"} for name, m in zip(names[1:], r["models"])}}


def print_table(s: dict) -> None:
    names = list(s["models"])
    print(f"{'task':15} {'metric':10} " + " ".join(f"{n[:22]:>22}" for n in names))
    for task, t in s["tasks"].items():
        for metric in t["models"][names[0]]:
            cells = []
            for n in names:
                e = t["models"][n][metric]
                d = "" if "diff" not in e else (f" ×{e['diff']:.2f}" if metric == "perplexity" else f" {e['diff']:+.3f}")
                cells.append(f"{e['value']:.4g}{d}" if metric == "perplexity" else f"{e['value']:.3f}{d}")
            print(f"{task:15} {metric:10} " + " ".join(f"{c:>22}" for c in cells))
    for name, m in s["retention"]["models"].items():
        if "retention" in m:
            vs = (f"; {m['vs_first']:+.1%} ± {m['vs_first_se']:.1%} against {names[1]}" if "vs_first" in m else "")
            print(f"{name}: retention {m['retention']:.1%} ± {m['retention_se']:.1%}, margin above chance kept "
                  f"{m['margin_kept']:.1%} ± {m['margin_kept_se']:.1%} ({', '.join(m['tasks'])}){vs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path, help="the dense model folder, then MoE folders")
    ap.add_argument("--task-data", type=Path, default=ROOT.parent / "shared" / "tasks",
                    help="folder of the six tasks' files (default: ../shared/tasks)")
    ap.add_argument("--tasks", default=",".join(BUNDLED), help="comma-separated (default: the six)")
    ap.add_argument("--limit", type=int, default=500, help="the first N items of each task; 0: all (default 500)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="tokens of the bundled sample for perplexity and "
                    "the generation prompts (default 8192)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16 (what users serve; 1.7x faster on a CPU with "
                    "AVX512-BF16) or auto (moeify eval's default)")
    ap.add_argument("--task-batch-size", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=ROOT / "out" / "task-cache", help="each model's answers kept here "
                    "as computed (moeify eval --task-cache): a stopped run resumes, a model scored before (the dense "
                    "one of an earlier run) is not scored again (default: out/task-cache)")
    ap.add_argument("--no-cache", action="store_true", help="score every model afresh, keeping nothing")
    ap.add_argument("--out", type=Path, required=True, help="the result file (JSON)")
    args = ap.parse_args(argv)

    import moeify

    limit = args.limit or None
    t0 = time.perf_counter()
    result = moeify.evaluate(args.models, tasks=args.tasks, task_data=args.task_data, limit=limit,
                             task_batch_size=args.task_batch_size, task_cache=None if args.no_cache else args.cache,
                             max_tokens=args.max_tokens, device=args.device, dtype=args.dtype,
                             oracle=False, kl=False, progress=lambda stage, done, total: print(
                                 f"{time.strftime('%H:%M:%S')} {stage}: {done}/{total}", flush=True)
                             if done == total else None)
    s = summary(result, [p.resolve().name for p in args.models], limit, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(s, indent=1) + "\n")
    print_table(s)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
