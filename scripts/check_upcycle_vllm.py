"""Upcycled MoEs of a real model in vLLM: do the exact constructions give the dense model's perplexity there too?

    nice -n 19 .venv/bin/python scripts/check_upcycle_vllm.py --model models/smollm2-135m \\
        --vllm-python "$PWD/build/vllmvenv/bin/python" --json results/upcycling/exactness-smollm2-vllm-cpu.json

`moeify upcycle MODEL` into each --layouts layout ([sP]eEgGkK as scripts/bench_upcycle.py names them: E8 top-2 into
Mixtral, E8 G8 top-8 into Mixtral, P% of d_ff shared + E4 G2 top-4 into Qwen2-MoE; identical copies, float32), then
vLLM (its own model classes, float32, enforce_eager, 1 OpenMP thread; the venv of scripts/check_vllm.py) scores the
dense model and every upcycle on the same windows of WikiText-2 `valid.txt` (the first --tokens tokens, windows of
--seq-len, each window's first token not scored): perplexity, and the max |difference| of any scored token's
log-probability to the dense model's in vLLM. vLLM computes each class's own top-k routing (Mixtral renormalises;
the Qwen2-MoE output sets norm_topk_prob), so exact means the dense model's numbers to float32 rounding. Outputs are
removed once scored unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_upcycle import parse_layout  # noqa: E402
from vllm_runner import DEFAULT_VLLM_PYTHON, ROOT, log, ppl_of, run_vllm  # noqa: E402

LAYOUTS = "e8g1k2,e8g8k8,s25e4g2k4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--eval", type=Path, default=ROOT.parent / "shared" / "corpora" / "wikitext2" / "valid.txt")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds for the vLLM subprocess")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "vllm_check" / "upcycle")
    ap.add_argument("--keep", action="store_true", help="keep the upcycled outputs")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = args.model.resolve()
    cfg = json.loads((model / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(args.eval.read_text()[: args.tokens * 8])["input_ids"][: args.tokens]
    windows = [ids[i:i + args.seq_len] for i in range(0, len(ids) - args.seq_len + 1, args.seq_len)]
    args.work.mkdir(parents=True, exist_ok=True)
    models, rows = [("dense", model)], {}
    for name in filter(None, args.layouts.split(",")):
        out = args.work / name
        flags = parse_layout(name, cfg["intermediate_size"]) + ["--symmetry", "none"]
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "moeify", "upcycle", str(model), str(out), "--dtype", "float32",
                            *flags], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{name}: moeify upcycle failed: {(p.stderr or p.stdout)[-1500:]}")
        report = json.loads((out / "report.json").read_text())
        rows[name] = {"flags": " ".join(flags), "format": report["format"], "experts": report["experts"],
                      "top_k": report["top_k"], "upcycle_seconds": round(time.time() - t0, 1),
                      "check": report["check"]}
        log(f"upcycled {name} ({report['format']}) in {time.time() - t0:.0f} s")
        models.append((name, out))
    job = {"dtype": "float32", "max_model_len": args.seq_len + 8, "max_num_seqs": 8, "prompt_logprobs": 0,
           "models": [{"path": str(p.resolve()), "name": n} for n, p in models], "windows": {"wikitext2": windows}}
    out = run_vllm(args, job, "upcycle-float32")
    got = {r["name"]: r for r in out["models"]}
    dense = got["dense"]
    if not dense.get("loaded") or "wikitext2" not in dense.get("logprobs", {}):
        raise SystemExit(f"vLLM could not score the dense model: {dense.get('error') or dense.get('run_error')}")
    ref = [lp for w in dense["logprobs"]["wikitext2"] for lp in w]
    result = {"model": model.name, "vllm_versions": {k: out.get(k) for k in ("vllm", "torch", "transformers")},
              "dtype": "float32", "eval": {"text": args.eval.name, "tokens": len(windows) * args.seq_len,
                                           "seq_len": args.seq_len, "scored": len(ref)},
              "dense": {"class": dense.get("class"), "ppl": ppl_of(dense["logprobs"]["wikitext2"])},
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    for name, row in rows.items():
        r = got.get(name, {})
        row.update({"vllm_loaded": bool(r.get("loaded")), "class": r.get("class"), "moe": r.get("moe"),
                    "error": r.get("error") or r.get("run_error")})
        if r.get("loaded") and "wikitext2" in r.get("logprobs", {}):
            lps = [lp for w in r["logprobs"]["wikitext2"] for lp in w]
            row["ppl"] = ppl_of(r["logprobs"]["wikitext2"])
            row["ppl_ratio_to_dense"] = row["ppl"] / result["dense"]["ppl"]
            row["max_logprob_diff_to_dense"] = max(abs(a - b) for a, b in zip(lps, ref))
        log(f"vLLM {name}: " + (f"class {row['class']}, ppl {row['ppl']:.4f} (dense {result['dense']['ppl']:.4f}), "
                                f"max |log-prob diff| {row['max_logprob_diff_to_dense']:.2e}" if "ppl" in row
                                else f"FAILED {str(row['error'])[:300]}"))
        if not args.keep:
            shutil.rmtree(args.work / name, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
