"""moeify merge against mergekit-moe on the same work: the same YAML files and sources through both tools, each
output scored the same way. mergekit 0.1.5 runs from its own venv (out/mergekit-venv, made here when missing, CPU
torch first so that mergekit's `torch>=2.0.0` pulls no CUDA wheels):

    python -m venv out/mergekit-venv
    out/mergekit-venv/bin/pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    out/mergekit-venv/bin/pip install mergekit==0.1.5      # transformers>=5,<6 (has Qwen2Moe, Qwen3Moe)

    python scripts/bench_mergekit.py --rows exactness --json results/upcycling/mergekit-parity-exactness.json
    python scripts/bench_mergekit.py --rows speed --json results/upcycling/mergekit-parity-speed.json   # idle

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
- speed: SmolLM2-135M × 8 and Qwen2.5-Coder-0.5B × 4 (every expert the base, gate_mode random, bfloat16), one run
  of each tool each: wall seconds and peak RSS of the child (GNU time), moeify's end-of-run check included.
- routing: scripts/bench_merge_routing.py (three SmolLM2 fine-tunes, the same prompts, both tools).
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def exactness_rows(work: Path, save, venv: Path = VENV) -> list[dict]:
    from conftest import build_dense, corpus_text  # the test suite's tiny models and tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        make_tokenizer(tok_dir, corpus_text())
    rows = []
    for name, family, arch, shared in CLASSES:
        base = work / f"base-{family}"
        if not (base / "config.json").is_file():  # heads of 32 (vLLM's CPU attention takes no head_dim of 16)
            build_dense(base, tok_dir, family=family, seed=0, num_attention_heads=2, num_key_value_heads=1,
                        **({"head_dim": 32} if family == "qwen3" else {}))
        stem = arch if family in ("llama", arch) else f"{arch}-{family}"  # the first runs' names kept
        cfg = write_config(work / f"{stem}.yml", base, 4, arch, shared, "float32")
        for tool in ("mergekit-moe", "moeify merge"):
            out = work / f"out-{stem}-{tool.split()[0]}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = commands(cfg, out, venv)[tool]
            row = {"class": name, "base_family": family, "tool": tool,
                   "command": " ".join(cmd).replace(str(ROOT) + "/", ""), "base": str(base), "out": str(out)}
            try:
                row.update(timed(cmd))
                row.update(against_base(base, out))
            except RuntimeError as exc:
                row.update(loads=False, error=str(exc)[:300])
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


def make_tokenizer(out: Path, text: str) -> None:
    """tests/conftest.py's tokenizer (a byte-level BPE of 384 tokens trained on the test corpus), outside pytest."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)


def speed_rows(work: Path, save, venv: Path = VENV) -> list[dict]:
    rows = []
    for model, n in ((ROOT / "models" / "smollm2-135m", 8), (ROOT / "models" / "qwen2.5-coder-0.5b", 4)):
        arch = "qwen" if "qwen" in model.name else "mixtral"
        cfg = work / f"speed-{model.name}.yml"
        lines = [f"base_model: {model}", "gate_mode: random", "dtype: bfloat16", f"architecture: {arch}",
                 "experts:"] + [f"  - source_model: {model}"] * n
        if arch == "qwen":  # mergekit's Qwen MoE output needs its shared expert
            lines += ["shared_experts:", f"  - source_model: {model}"]
        cfg.write_text("\n".join(lines) + "\n")
        for tool, cmd in commands(cfg, work / "out", venv).items():
            shutil.rmtree(work / "out", ignore_errors=True)
            row = {"model": model.name, "experts": n, "tool": tool,
                   "command": " ".join(cmd).replace(str(ROOT) + "/", ""), **timed(cmd)}
            row["output_gb"] = round(sum(f.stat().st_size for f in (work / "out").glob("*.safetensors")) / 1e9, 3)
            rows.append(row)
            save(rows)
            print(f"{model.name:<22} {tool:<13} {row['seconds']:7.1f} s {row['peak_rss_gb']:6.2f} GB", flush=True)
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
    ap.add_argument("--rows", choices=("exactness", "speed"), default="exactness")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench_mergekit")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / "build" / "vllmvenv" / "bin" / "python",
                    help="vLLM's venv (scripts/check_vllm.py says how to make it); a missing path: no vLLM columns")
    ap.add_argument("--mergekit-venv", type=Path, default=VENV, help="mergekit's own venv, made here when missing")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    mergekit_moe(args.mergekit_venv)
    pins = subprocess.run([str(args.mergekit_venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                          capture_output=True, text=True)
    versions = {p["name"]: p["version"] for p in json.loads(pins.stdout or "[]")
                if p["name"] in ("mergekit", "torch", "transformers")} if pins.returncode == 0 else {}
    result = {"date": time.strftime("%Y-%m-%d"), "rows_kind": args.rows, "mergekit_venv": versions,
              "torch": torch.__version__, "rows": []}

    def save(rows):
        result["rows"] = rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")

    rows = (exactness_rows if args.rows == "exactness" else speed_rows)(args.work, save, args.mergekit_venv)
    if args.rows == "exactness" and args.vllm_python.is_file():
        vllm_columns(rows, args.work, args.vllm_python)
        save(rows)
    print(table(rows))


if __name__ == "__main__":
    main()
