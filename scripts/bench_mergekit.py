"""moeify merge against mergekit-moe on the same work: the same YAML files and sources through both tools, each
output scored the same way. mergekit 0.1.5 runs from its own venv (out/mergekit-venv, made here when missing, CPU
torch first so that mergekit's `torch>=2.0.0` pulls no CUDA wheels):

    python -m venv out/mergekit-venv
    out/mergekit-venv/bin/pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    out/mergekit-venv/bin/pip install mergekit==0.1.5      # transformers>=5,<6 (has Qwen2Moe, Qwen3Moe)

    python scripts/bench_mergekit.py --rows exactness --json results/upcycling/mergekit-parity-exactness.json
    python scripts/bench_mergekit.py --rows speed --repeat 3 --json results/upcycling/mergekit-parity-speed.json  # idle

Rows:
- exactness: where a merge is defined to compute its base (every expert the base's own FFN), does the output? Per
  output class: Mixtral (a Llama base), Qwen MoE (a Llama base and a Qwen2 base, whose q/k/v biases are not zero;
  4 routed copies and mergekit's required shared expert, also the base), Qwen3 MoE (a Qwen3 base); tiny random
  models made here (tests/conftest.py's build_dense and tokenizer: hidden 64, 3 layers, d_ff 96, vocab 384), one
  YAML per row read unchanged by both tools (`mergekit-moe CONFIG OUT --i-understand-this-is-not-useful-without-
  training --random-seed 0`, `moeify merge OUT --config CONFIG`), gate_mode random, 4 experts top-2, float32.
  Each output loaded by transformers (AutoModelForCausalLM, float32): max |logit difference| to the base on 4 × 32
  random tokens, and mean KL(base || output) per token, or the one-line error that stopped it loading; wall seconds
  and peak RSS of each tool's run (GNU time). Then by vLLM (--vllm-python, its CPU build; float32; a missing path
  skips it) beside the base on the same tokens: max |log-probability difference| of the scored tokens, or the error
  that stopped it.
- llamacpp: the exactness rows in llama.cpp, where its graph can. The tiny bases' 384-token BPE is not one that
  llama.cpp's convert_hf_to_gguf.py recognises, so these rows have bases of their own (WORK/llamacpp/base-FAMILY): the
  same shapes and seed, untied embeddings (llama.cpp's qwen2moe has no tied output), SmolLM2-135M's tokenizer (vocab
  49152; the converter's "smollm"), for the Qwen2 base Qwen2.5-Coder's (vocab 151936; transformers 5 loads any
  model_type qwen2 tokenizer as Qwen2Tokenizer, whose pre-tokenizer gives SmolLM2's vocabulary a hash the converter
  does not know). Both tools run on one YAML per row as above; each output is scored in transformers as above, then
  the base and the output go through llama.cpp's own converter (the pinned llama-cpp-python sdist,
  scripts/check_llamacpp.py; --outtype f32) and run by the prebuilt xllamacpp server (--llamacpp-python: a Python with
  `pip install xllamacpp`; F32 KV cache, 1 thread) on the same 4 × 32 random token ids, one request per prefix
  (n_predict 1, greedy, logprobs 16): llamacpp_max_logprob_diff is the max |log-probability difference| to the base in
  llama.cpp over the tokens in both top-16 lists at all 128 positions, or llamacpp_error (the converter's or
  llama.cpp's one-line refusal). Also the output in llama.cpp against itself in transformers
  (out_llamacpp_vs_transformers; with norm_topk_prob off where the config has it on), and the base the same way
  (base_llamacpp_vs_transformers: llama.cpp's float32 path against transformers', the floor):

    python -m venv build/llvenv && build/llvenv/bin/pip install xllamacpp
    nice -n 10 python scripts/bench_mergekit.py --rows llamacpp --json results/upcycling/mergekit-parity-llamacpp.json

- speed: SmolLM2-135M × 8 and Qwen2.5-Coder-0.5B × 4 (every expert the base, gate_mode random, bfloat16), each
  tool --repeat times in turn after a warm-up run of each: median wall seconds and peak RSS of the child (GNU time),
  moeify's end-of-run check included, and the median of the paired ratios moeify / mergekit.
- routing: scripts/bench_merge_routing.py (three SmolLM2 fine-tunes, the same prompts, both tools).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_merge_routing import timed  # noqa: E402 (one timing helper for both benchmarks)

VENV = ROOT / "out" / "mergekit-venv"
MERGEKIT = "mergekit==0.1.5"
# The local version label lets pip pick only a CPU wheel: from PyTorch's CPU index, or, where that index is out of
# reach, pip's own configured sources (here /opt/wheels); never PyPI's CUDA build and its GBs of nvidia-* wheels.
CPU_TORCH = ("torch==2.13.0+cpu", "--index-url", "https://download.pytorch.org/whl/cpu")
MOEIFY = str(ROOT / ".venv" / "bin" / "moeify")
# (output class, base family, mergekit's `architecture:`, with mergekit's one shared expert)
CLASSES = (("Mixtral", "llama", "mixtral", False), ("Qwen MoE", "llama", "qwen", True),
           ("Qwen MoE", "qwen2", "qwen", True), ("Qwen3 MoE", "qwen3", "qwen3", False))


def mergekit_moe(venv: Path = VENV) -> Path:
    """venv/bin/mergekit-moe, the venv made first when missing (CPU torch, then mergekit); checked with --help."""
    exe = venv / "bin" / "mergekit-moe"
    if not exe.is_file():
        subprocess.run([shutil.which("python3") or "python3", "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *CPU_TORCH], check=True)
        subprocess.run([*pip, MERGEKIT], check=True)
        listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list"], capture_output=True, text=True)
        if "nvidia-" in listed.stdout:
            raise SystemExit(f"{venv}: CUDA wheels came with mergekit; remove the venv and install CPU torch first")
    subprocess.run([str(exe), "--help"], check=True, capture_output=True)
    return exe


def write_config(path: Path, base: Path, n: int, architecture: str, shared: bool, dtype: str) -> Path:
    lines = [f"base_model: {base}", "gate_mode: random", f"dtype: {dtype}", "experts_per_token: 2",
             f"architecture: {architecture}", "experts:"] + [f"  - source_model: {base}"] * n
    if shared:
        lines += ["shared_experts:", f"  - source_model: {base}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def commands(cfg: Path, out: Path, venv: Path = VENV) -> dict[str, list[str]]:
    """Each tool's command line on one YAML, seeded alike (mergekit's random gates are unseeded torch.randn without
    --random-seed; moeify merge's --seed is 0 by default)."""
    return {"mergekit-moe": [str(venv / "bin" / "mergekit-moe"), str(cfg), str(out),
                             "--i-understand-this-is-not-useful-without-training", "--random-seed", "0"],
            "moeify merge": [MOEIFY, "merge", str(out), "--config", str(cfg)]}


@torch.no_grad()
def against_base(base: Path, out: Path, seed: int = 0) -> dict:
    """max |logit difference| and mean KL(base || out) per token on 4 × 32 random tokens, float32."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    try:
        moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 - any failure to load is the row's result
        return {"loads": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    ids = torch.randint(0, dense.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(seed))
    a, b = dense(ids).logits.float(), moe(ids).logits.float()
    kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    return {"loads": True, "max_logit_diff": float((a - b).abs().max()), "logit_scale": float(a.abs().max()),
            "kl_nats": max(float(kl), 0.0)}


def tool_row(name: str, family: str, tool: str, cfg: Path, base: Path, out: Path, venv: Path) -> dict:
    """One tool run on one YAML into a fresh out, then scored in transformers against the base."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = commands(cfg, out, venv)[tool]
    row = {"class": name, "base_family": family, "tool": tool,
           "command": " ".join(cmd).replace(str(ROOT) + "/", ""), "base": str(base), "out": str(out)}
    try:
        row.update(timed(cmd))
        row.update(against_base(base, out))
    except RuntimeError as exc:
        row.update(loads=False, error=str(exc)[:300])
    return row


def exactness_rows(work: Path, save, venv: Path = VENV) -> list[dict]:
    from conftest import build_dense, build_tokenizer  # the test suite's tiny models and tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        build_tokenizer(tok_dir)
    rows = []
    for name, family, arch, shared in CLASSES:
        base = work / f"base-{family}"
        if not (base / "config.json").is_file():  # heads of 32 (vLLM's CPU attention takes no head_dim of 16)
            build_dense(base, tok_dir, family=family, seed=0, num_attention_heads=2, num_key_value_heads=1,
                        **({"head_dim": 32} if family == "qwen3" else {}))
        stem = arch if family in ("llama", arch) else f"{arch}-{family}"  # the first runs' names kept
        cfg = write_config(work / f"{stem}.yml", base, 4, arch, shared, "float32")
        for tool in ("mergekit-moe", "moeify merge"):
            row = tool_row(name, family, tool, cfg, base, work / f"out-{stem}-{tool.split()[0]}", venv)
            rows.append(row)
            save(rows)
            print(f"{name:<10} {family:<6} {tool:<13} {row.get('max_logit_diff', row.get('error'))}", flush=True)
    return rows


def vllm_columns(rows: list[dict], work: Path, vllm_python: Path) -> None:
    """Each output that loads in transformers, scored by vLLM (its own classes and routing, float32) beside its
    base on the same 4 × 32 random tokens: vllm_max_logprob_diff, the max |log-probability difference| of any scored
    token to the base's in vLLM (or vllm_error)."""
    from vllm_runner import run_vllm

    bases = sorted({r["base"] for r in rows})
    models = [{"name": b, "path": b} for b in bases] + [{"name": r["out"], "path": r["out"]} for r in rows
                                                         if r.get("loads")]
    windows = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0)).tolist()
    job = {"dtype": "float32", "max_model_len": 40, "max_num_seqs": 4, "prompt_logprobs": 0,
           "models": models, "windows": {"random": windows}, "vocab": 384, "skip_tokenizer_init": True}
    res = run_vllm(argparse.Namespace(work=work / "vllm", vllm_python=vllm_python, kv_space=1, timeout=1800), job,
                   "exactness")
    got = {m["name"]: m for m in res["models"]}
    for r in rows:
        m, b = got.get(r["out"]), got.get(r["base"])
        if m is None or "random" not in m.get("logprobs", {}):
            r["vllm_error"] = ((m or {}).get("error") or (m or {}).get("run_error") or "not loaded in transformers"
                               )[:300]
            continue
        if "random" not in b.get("logprobs", {}):
            r["vllm_error"] = f"the base did not run: {b.get('run_error', b.get('error', ''))[:200]}"
            continue
        pairs = zip(sum(m["logprobs"]["random"], []), sum(b["logprobs"]["random"], []))
        r["vllm_max_logprob_diff"] = max(abs(x - y) for x, y in pairs)
        r["vllm_class"] = m.get("class")


LLAMACPP_RUNNER = """
import json, sys
import xllamacpp as x
gguf, prompts, n_probs, dest = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
p = x.CommonParams()
p.cache_type_k = p.cache_type_v = x.ggml_type.GGML_TYPE_F32  # not llama.cpp's default F16 KV cache
p.model.path = gguf
p.n_ctx = 256
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
p.n_parallel = 1
s = x.Server(p)
out = []
for ids in prompts:  # every prefix: one greedy token and the top n_probs log-probabilities before sampling
    row = []
    for k in range(1, len(ids) + 1):
        r = s.handle_completions({"prompt": ids[:k], "n_predict": 1, "temperature": 0, "top_k": 1,
                                  "ignore_eos": True, "cache_prompt": False, "logprobs": n_probs})
        if "choices" not in r:
            raise SystemExit("error: " + json.dumps(r)[:300])
        c = r["choices"][0]["logprobs"]["content"]
        row.append({"id": c[0]["id"], "top": {str(t["id"]): t["logprob"] for t in c[0]["top_logprobs"]}}
                   if len(c) == 1 else None)
    out.append(row)
open(dest, "w").write(json.dumps(out))
"""


def llamacpp_logprobs(gguf: Path, prompts: list[list[int]], runner: Path, python: Path,
                      n_probs: int = 16) -> tuple[list | None, str | None]:
    """xllamacpp's server on one GGUF (F32 KV cache, 1 thread), one request per prefix of each prompt (n_predict 1,
    greedy: a longer generation's logprobs list is not one entry per generated token when a token ends inside a
    UTF-8 character): per prompt, per position, the greedy next token and the top n_probs {token id: log-prob}; or
    (None, the one-line error)."""
    import check_llamacpp as llc

    dest = gguf.with_suffix(".logprobs.json")
    dest.unlink(missing_ok=True)
    res = subprocess.run([str(python), str(runner), str(gguf), json.dumps(prompts), str(n_probs), str(dest)],
                         capture_output=True, text=True)
    if res.returncode == 0 and dest.is_file():
        return json.loads(dest.read_text()), None
    said = res.stderr + res.stdout
    abort = [ln.strip() for ln in said.splitlines() if "GGML_ASSERT" in ln]
    return None, "llama.cpp: " + (abort[0] if abort else llc.last_error(said))


def logprob_diff(a: list, b: list) -> dict:
    """max |Δ log-probability| over the tokens in both top lists at every position (the same prefix in both), and
    at how many positions the greedy next token differs."""
    worst, compared, positions, differ = 0.0, 0, 0, 0
    for sa, sb in zip(sum(a, []), sum(b, [])):
        if sa is None or sb is None:
            continue
        common = sa["top"].keys() & sb["top"].keys()
        worst = max([worst, *(abs(sa["top"][t] - sb["top"][t]) for t in common)])
        compared, positions, differ = compared + len(common), positions + 1, differ + (sa["id"] != sb["id"])
    return {"llamacpp_max_logprob_diff": worst, "llamacpp_logprobs_compared": compared,
            "llamacpp_positions": positions, "llamacpp_greedy_differs": differ}


@torch.no_grad()
def transformers_vs_llamacpp(model_dir: Path, prompts: list[list[int]], got: list, **config) -> float:
    """A model in transformers (float32; config: attributes overridden) on each prompt: max |Δ log-probability| of
    llama.cpp's top tokens at every position (the server adds no BOS to a prompt of token ids)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config).eval()
    worst = 0.0
    for ids, steps in zip(prompts, got):
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for j, s in enumerate(steps):
            if s is not None:
                worst = max([worst, *(abs(float(lp[j, int(t)]) - v) for t, v in s["top"].items())])
    return worst


def llamacpp_rows(work: Path, save, venv: Path, llamacpp_python: Path, llamacpp_work: Path) -> list[dict]:
    """Each exactness row again on bases llama.cpp's converter takes, the base and each tool's output converted by
    llama.cpp's own convert_hf_to_gguf.py (--outtype f32) and run by xllamacpp on the same token ids."""
    import check_llamacpp as llc
    from conftest import build_dense

    if not llamacpp_python.is_file():
        raise SystemExit(f"{llamacpp_python}: no Python with xllamacpp (python -m venv build/llvenv && "
                         "build/llvenv/bin/pip install xllamacpp)")
    llamacpp_work.mkdir(parents=True, exist_ok=True)
    top, py = llc.fetch_llamacpp(llamacpp_work, llc.PIN), llc.converter_python(llamacpp_work)
    work = work / "llamacpp"
    (work / "gguf").mkdir(parents=True, exist_ok=True)
    runner = work / "logprob_runner.py"
    runner.write_text(LLAMACPP_RUNNER)
    # tokenizers convert_hf_to_gguf.py recognises: SmolLM2's ("smollm"); for the Qwen2 base Qwen2.5's ("qwen2"), as
    # transformers 5 loads any model_type qwen2 tokenizer as Qwen2Tokenizer, whose own pre-tokenizer has another hash
    tokenizers = {"qwen2": (ROOT / "models" / "qwen2.5-coder-0.5b", 151936, 151643, 151645)}
    smollm2 = (ROOT / "models" / "smollm2-135m", 49152, 1, 2)
    prompts = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0)).tolist()
    scored: dict[Path, tuple] = {}

    def gguf_logprobs(model: Path) -> tuple[list | None, str | None]:
        if model not in scored:
            gguf = work / "gguf" / f"{model.name}.gguf"
            gguf.unlink(missing_ok=True)
            err = llc.to_gguf(py, top, model, gguf, None, "f32")
            scored[model] = (None, err) if err else llamacpp_logprobs(gguf, prompts, runner, llamacpp_python)
        return scored[model]

    rows = []
    for name, family, arch, shared in CLASSES:
        base = work / f"base-{family}"
        if not (base / "config.json").is_file():  # the exactness rows' shapes, a real tokenizer, untied
            tok, vocab, bos, eos = tokenizers.get(family, smollm2)
            build_dense(base, None, family=family, seed=0, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=vocab, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
                        **({"head_dim": 32} if family == "qwen3" else {}))
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tok / f, base / f)
        stem = arch if family in ("llama", arch) else f"{arch}-{family}"
        cfg = write_config(work / f"{stem}.yml", base, 4, arch, shared, "float32")
        ref, ref_err = gguf_logprobs(base)
        base_check = transformers_vs_llamacpp(base, prompts, ref) if ref is not None else None
        for tool in ("mergekit-moe", "moeify merge"):
            out = work / f"out-{stem}-{tool.split()[0]}"
            scored.pop(out, None)
            row = tool_row(name, family, tool, cfg, base, out, venv)
            row["base_llamacpp_vs_transformers"] = base_check
            if ref is None:
                row["llamacpp_error"] = f"the base: {ref_err}"
            elif (out / "config.json").is_file():
                got, err = gguf_logprobs(out)
                row.update(logprob_diff(ref, got) if got is not None else {"llamacpp_error": err})
                if got is not None and row.get("loads"):  # does llama.cpp compute the output as transformers does?
                    row["out_llamacpp_vs_transformers"] = transformers_vs_llamacpp(out, prompts, got)
                    if json.loads((out / "config.json").read_text()).get("norm_topk_prob"):  # and without it?
                        row["out_llamacpp_vs_transformers_norm_topk_prob_false"] = transformers_vs_llamacpp(
                            out, prompts, got, norm_topk_prob=False)
            rows.append(row)
            save(rows)
            print(f"{name:<10} {family:<6} {tool:<13} {row.get('max_logit_diff', row.get('error'))} "
                  f"{row.get('llamacpp_max_logprob_diff', row.get('llamacpp_error'))}", flush=True)
    return rows


def llamacpp_table(rows: list[dict]) -> str:
    """80 columns: transformers' max |Δ logit| to the base, llama.cpp's max |Δ log-prob| to the base in llama.cpp
    (or its error, cut: whole in the JSON), and llama.cpp's output against the output in transformers, as written
    and (a norm_topk_prob output) with norm_topk_prob off."""
    lines = [f"{'class':<9} {'base':<5} {'tool':<12} {'HF |Δlogit|':>11} {'llama.cpp':>9} "
             f"{'cpp-vs-HF':>9} {'(norm off)':>10}"]
    for r in rows:
        diff = f"{r['max_logit_diff']:.1e}" if r.get("loads") else "no load"
        head = f"{r['class'][:9]:<9} {r['base_family']:<5} {r['tool']:<12} {diff:>11} "
        if "llamacpp_max_logprob_diff" not in r:
            lines.append((head + r.get("llamacpp_error", "-"))[:80])
            continue
        vs = r.get("out_llamacpp_vs_transformers")
        off = r.get("out_llamacpp_vs_transformers_norm_topk_prob_false")
        lines.append(head + f"{r['llamacpp_max_logprob_diff']:>9.1e} " + (f"{vs:>9.1e}" if vs is not None else
                     f"{'-':>9}") + (f" {off:>10.1e}" if off is not None else ""))
    return "\n".join(lines)


def speed_rows(work: Path, save, venv: Path = VENV, repeat: int = 1) -> list[dict]:
    """Each tool on each model's YAML, `repeat` times in turn (mergekit-moe, moeify merge, mergekit-moe, ...) after
    one warm-up run of each that is not counted: a row per tool with the median wall seconds and peak RSS, every
    run's figures, and (on moeify's row) the median of the paired ratios moeify / mergekit (the pairing keeps the
    ratio meaningful when the machine's speed drifts). The disk is synced before every run (mergekit-moe does not
    fsync its output, moeify does: unsynced, one run's writeback would fall into the next one's time), and again after
    each run, timed: `seconds_on_disk` is the run's seconds plus that sync's, until its output is on the disk."""
    rows = []
    for model, n in ((ROOT / "models" / "smollm2-135m", 8), (ROOT / "models" / "qwen2.5-coder-0.5b", 4)):
        arch = "qwen" if "qwen" in model.name else "mixtral"
        cfg = work / f"speed-{model.name}.yml"
        lines = [f"base_model: {model}", "gate_mode: random", "dtype: bfloat16", f"architecture: {arch}",
                 "experts:"] + [f"  - source_model: {model}"] * n
        if arch == "qwen":  # mergekit's Qwen MoE output needs its shared expert
            lines += ["shared_experts:", f"  - source_model: {model}"]
        cfg.write_text("\n".join(lines) + "\n")
        runs = {tool: [] for tool in commands(cfg, work / "out", venv)}
        for i in range(repeat + (repeat > 1)):  # the first of several runs warms the page cache, not counted
            for tool, cmd in commands(cfg, work / "out", venv).items():
                shutil.rmtree(work / "out", ignore_errors=True)
                os.sync()  # the last run's files on the disk before this one starts: each pays for its own writes
                run = timed(cmd)
                t = time.perf_counter()
                os.sync()  # what the run left unwritten: its output is on the disk only after this
                run["seconds_on_disk"] = round(run["seconds"] + time.perf_counter() - t, 2)
                if (work / "out" / "report.json").is_file() and tool == "moeify merge":
                    run["check_seconds"] = json.loads((work / "out" / "report.json").read_text())["check"]["seconds"]
                if i or repeat == 1:
                    runs[tool].append(run)
                print(f"{model.name:<22} {tool:<13} {run['seconds']:7.1f} s ({run['seconds_on_disk']:5.1f} s on disk)"
                      f" {run['peak_rss_gb']:6.2f} GB"
                      f"{'' if i or repeat == 1 else ' (warm-up)'}", flush=True)
        output_gb = round(sum(f.stat().st_size for f in (work / "out").glob("*.safetensors")) / 1e9, 3)
        for tool, cmd in commands(cfg, work / "out", venv).items():
            row = {"model": model.name, "experts": n, "tool": tool, "command": " ".join(cmd).replace(str(ROOT) + "/",
                                                                                                     ""),
                   "seconds": statistics.median(r["seconds"] for r in runs[tool]),
                   "seconds_on_disk": statistics.median(r["seconds_on_disk"] for r in runs[tool]),
                   "peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in runs[tool]), "output_gb": output_gb,
                   "runs": runs[tool]}
            if tool == "moeify merge":
                row["seconds_over_mergekit"] = round(statistics.median(
                    a["seconds"] / b["seconds"] for a, b in zip(runs[tool], runs["mergekit-moe"])), 3)
                row["on_disk_over_mergekit"] = round(statistics.median(
                    a["seconds_on_disk"] / b["seconds_on_disk"] for a, b in zip(runs[tool], runs["mergekit-moe"])), 3)
            rows.append(row)
            save(rows)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as an 80-column text table (a row that did not load says `no load`; its error is in the JSON)."""
    lines = [f"{'class':<10} {'base':<6} {'tool':<13} {'max |Δlogit|':>12} {'KL (nats)':>9} {'vLLM |Δlp|':>10} "
             f"{'s':>6} {'GB':>5}"]
    for r in rows:
        diff = f"{r['max_logit_diff']:.2e}" if r.get("loads") else "no load"
        kl = f"{r['kl_nats']:.1e}" if r.get("loads") else "-"
        vl = f"{r['vllm_max_logprob_diff']:.1e}" if "vllm_max_logprob_diff" in r else "-"
        base = r.get("base_family", f"×{r['experts']}" if "experts" in r else "")
        lines.append(f"{r.get('class', r.get('model', ''))[:10]:<10} {base[:6]:<6} {r['tool']:<13} {diff:>12} "
                     f"{kl:>9} {vl:>10} {r.get('seconds', 0):6.1f} {r.get('peak_rss_gb', 0):5.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", choices=("exactness", "speed", "llamacpp"), default="exactness")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench_mergekit")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / "build" / "vllmvenv" / "bin" / "python",
                    help="vLLM's venv (scripts/check_vllm.py says how to make it); a missing path: no vLLM columns")
    ap.add_argument("--llamacpp-python", type=Path, default=ROOT / "build" / "llvenv" / "bin" / "python",
                    help="a Python with xllamacpp installed (--rows llamacpp)")
    ap.add_argument("--llamacpp-work", type=Path, default=ROOT / "build" / "llamacpp",
                    help="the llama-cpp-python sdist (its llama.cpp's converter) and the converter's venv")
    ap.add_argument("--mergekit-venv", type=Path, default=VENV, help="mergekit's own venv, made here when missing")
    ap.add_argument("--repeat", type=int, default=1, help="speed rows: runs of each tool, in turn, after a warm-up "
                    "run of each (the medians and the paired ratio reported)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    mergekit_moe(args.mergekit_venv)
    pins = subprocess.run([str(args.mergekit_venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                          capture_output=True, text=True)
    versions = {p["name"]: p["version"] for p in json.loads(pins.stdout or "[]")
                if p["name"] in ("mergekit", "torch", "transformers")} if pins.returncode == 0 else {}
    result = {"date": time.strftime("%Y-%m-%d"), "rows_kind": args.rows,
              "command": " ".join(["python", "scripts/bench_mergekit.py", *sys.argv[1:]]), "mergekit_venv": versions,
              "torch": torch.__version__, "rows": []}

    def save(rows):
        result["rows"] = rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")

    if args.rows == "llamacpp":
        import check_llamacpp as llc

        top = llc.fetch_llamacpp(args.llamacpp_work, llc.PIN)
        xv = subprocess.run([str(args.llamacpp_python), "-c", "import xllamacpp; print(xllamacpp.__version__)"],
                            capture_output=True, text=True).stdout.strip()
        result.update({"llama_cpp_python_sdist": llc.PIN, "llama_cpp_converter": llc.llamacpp_commit(top),
                       "xllamacpp": xv})
        rows = llamacpp_rows(args.work, save, args.mergekit_venv, args.llamacpp_python, args.llamacpp_work)
        print(llamacpp_table(rows))
        return
    rows = exactness_rows(args.work, save, args.mergekit_venv) if args.rows == "exactness" else \
        speed_rows(args.work, save, args.mergekit_venv, args.repeat)
    if args.rows == "exactness" and args.vllm_python.is_file():
        vllm_columns(rows, args.work, args.vllm_python)
        save(rows)
    print(table(rows))


if __name__ == "__main__":
    main()
