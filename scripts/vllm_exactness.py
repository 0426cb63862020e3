"""The tiny all-experts exactness check of scripts/check_vllm.py (--exactness): tiny random Llama/Mistral/Qwen3
checkpoints (tests/conftest.py's build_dense, head_dim >= 32 because vLLM's CPU attention takes head sizes 32, 64,
80, ...) converted with `moeify convert --weight-only --no-tune --top-k N` (all experts active) to Mixtral and to
Qwen2-MoE (no shared expert, a shared expert, a dense layer), a Qwen3 to Qwen3-MoE (and with a dense layer); vLLM
float32 prompt logprobs over the whole vocabulary of the MoE against the dense model's, and both against
transformers. Sparse outputs (top-k < experts) are checked against transformers on the same MoE instead.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_runner import ROOT, log, route_by_logits, run_vllm

EXACT = 1e-4  # max |logprob difference| accepted as "the same" in float32 (tests/test_convert.py's logit bound)

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
# upcycles (`moeify upcycle`, identical copies): exact under each class's own sparse top-k routing (renormalised)
UP_MIXTRAL = ("upcycle-mixtral-E4k2", ["--copies", "4", "--top-k", "2", "--symmetry", "none"], "upcycle")
UP_FINE = ("upcycle-mixtral-E2G4k4", ["--copies", "2", "--granularity", "4", "--top-k", "4", "--symmetry", "permute"],
           "upcycle")
UP_QWEN_SHARED = ("upcycle-qwen2_moe-shared-E4G2k2", ["--copies", "4", "--granularity", "2", "--top-k", "2",
                                                      "--shared-width", "64", "--symmetry", "none"], "upcycle")
UP_QWEN3 = ("upcycle-qwen3_moe-E4k2", ["--copies", "4", "--top-k", "2", "--symmetry", "none"], "upcycle")
QWEN3_SOURCE = dict(family="qwen3", head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
TINY_CASES = {
    "llama-gqa-llama3rope": (dict(rope_parameters=LLAMA3_ROPE), [MIXTRAL, QWEN, QWEN_SHARED, QWEN_SHARED_DENSE,
                                                                 MIXTRAL_TOP2, QWEN_SHARED_TOP1, UP_MIXTRAL, UP_FINE,
                                                                 UP_QWEN_SHARED]),
    "llama-tied": (dict(tie_word_embeddings=True), [MIXTRAL, QWEN_SHARED]),
    "llama-headdim64": (dict(head_dim=64), [MIXTRAL, QWEN_SHARED]),  # head_dim != hidden / heads (32)
    "mistral-sliding8": (dict(family="mistral", sliding_window=8), [MIXTRAL]),  # window < prompt (24)
    "qwen3-headdim64": (QWEN3_SOURCE, [QWEN3, QWEN3_DENSE, QWEN3_TOP2, UP_QWEN3]),
    "qwen3-tied": ({**QWEN3_SOURCE, "tie_word_embeddings": True}, [QWEN3]),
}


def tiny_tokenizer(out: Path) -> Path:
    """tests/conftest.py's tokenizer (a byte-level BPE, vocab 384) trained on the bundled text."""
    from conftest import build_tokenizer

    return build_tokenizer(out, (ROOT / "examples" / "calib" / "wikitext2_train_sample.txt").read_text()[:20000])


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
        for oname, flags, *how in outputs:
            out = work / case / oname
            cmd = [sys.executable, "-m", "moeify", "convert", str(src), str(out), "--weight-only", "--no-tune", *flags]
            if how == ["upcycle"]:  # exact by construction at any top-k
                cmd = [sys.executable, "-m", "moeify", "upcycle", str(src), str(out), "--dtype", "float32", *flags]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if p.returncode:
                pairs.append({"case": case, "output": oname, "flags": flags,
                              "convert_error": (p.stderr or p.stdout)[-800:]})
                log(f"tiny {case}/{oname}: moeify convert failed: {(p.stderr or p.stdout)[-300:]}")
                continue
            models.append((f"{case}/{oname}", out))
            pairs.append({"case": case, "output": oname, "flags": flags, "upcycle": how == ["upcycle"]})
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
             }
        flags = pr["flags"]
        r["all_experts_active"] = pr.get("upcycle") or flags[flags.index("--top-k") + 1] == flags[flags.index(
            "--experts") + 1]  # (an upcycle of identical copies computes the dense model at its own top-k)
        r["transformers_moe_vs_dense"] = maxdiff(hf[name], hf[dense]) if name in hf and r["all_experts_active"] else None
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
            "exact_means": "all experts active, or an upcycle of identical copies: vLLM MoE vs vLLM dense <= "
                           "tolerance; sparse (top-k < experts): vLLM MoE vs transformers MoE <= tolerance",
            "tiny_config": TINY, "vllm_versions": {k: out[k] for k in ("vllm", "torch", "transformers")},
            "results": results}


def print_exactness(ex: dict) -> None:
    print("\ntiny models: max |logprob diff| (vLLM float32); all experts active except the topKofN outputs")
    print("| model | loads | vLLM MoE vs vLLM dense | vLLM vs transformers | vLLM vs transformers, top-k by "
          "logits | transformers MoE vs dense |")
    print("|---|---|---:|---:|---:|---:|")
    for r in ex["results"]:
        def f(x):
            return "–" if x is None else f"{x:.2e}"
        vt = r.get("vllm_moe_vs_transformers_moe", r.get("vllm_vs_transformers"))
        print(f"| {r['model']} | {'yes' if r['vllm_loaded'] else 'NO'} | {f(r.get('vllm_moe_vs_vllm_dense'))} | "
              f"{f(vt)} | {f(r.get('vllm_moe_vs_transformers_moe_topk_by_logits'))} | "
              f"{f(r.get('transformers_moe_vs_dense'))} |")

