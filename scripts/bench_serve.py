"""Serving speed: decode and prompt tokens/s of MoE outputs against their dense source, as ratios from one run.

    .venv/bin/python scripts/bench_serve.py models/smollm2-135m --layouts e64k16,e32k16,e16k4,e16k8 --threads 1
    .venv/bin/python scripts/make_synthetic_checkpoint.py build/l1b --hidden 2048 --intermediate 8192 --layers 16 \\
        --heads 32 --kv-heads 8 --vocab 49152 --dtype float32 --tokenizer models/smollm2-135m
    .venv/bin/python scripts/bench_serve.py build/l1b --layouts e64k16,e32k16,e16k4,e16k8 --threads 1

Each layout ([sS]eEkK, as scripts/bench_quality.py) is converted weight-only (`moeify convert --weight-only`: the
speed of an output does not depend on how it was calibrated or tuned, only on its layout) and run in transformers on
the CPU (float32): greedy decoding of --new-tokens tokens after a --prompt-tokens prompt, with the KV cache. The
partition is contiguous with mean-gate routers (fast to carve; routing a random-weight model is as realistic as any).
The models are measured round-robin (one resident at a time), --rounds times, and each one's median is reported: decode tokens/s (the time of
generate(new) minus the time of generate(1), per new token) and prompt tokens/s (generate(1)), wall and CPU seconds,
with the ratio to the dense model's. Transformers runs an MoE block as grouped expert products; on a CPU that is
what a user gets from `AutoModelForCausalLM`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_quality import active_fraction, parse_config  # noqa: E402


def convert(src: Path, layout: str, work: Path) -> Path:
    shape = parse_config(layout)
    out = work / f"{src.name}-{layout}"
    if (out / "config.json").is_file():
        return out
    flags = ["--experts", str(shape["experts"]), "--top-k", str(shape["top_k"]), "--method", "contiguous",
             "--router", "mean-gate"]
    if shape.get("shared"):
        flags += ["--shared", str(shape["shared"]), "--format", "qwen2_moe", "--untie-embeddings"]
    subprocess.run([str(ROOT / ".venv/bin/moeify"), "convert", str(src), str(out), "--weight-only", "--overwrite",
                    *flags], check=True, stdout=subprocess.DEVNULL)
    return out


LLAMACPP_RUNNER = """
import json, sys
import xllamacpp as x
gguf, threads, n_prompt, n_new, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
p = x.CommonParams()
p.model.path = gguf
p.n_ctx = 1024
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
p.n_parallel = 1
s = x.Server(p)
prompt = " ".join(["The cat sat on the mat."] * (n_prompt // 7))
req = {"prompt": prompt, "n_predict": n_new, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
print("TIMINGS " + json.dumps([s.handle_completions(req).get("timings") for _ in range(rounds)]), flush=True)
"""


def llamacpp_speed(src: Path, name: str, args) -> dict:
    """llama.cpp's converter (the llama-cpp-python sdist's, as scripts/check_llamacpp.py) to --outtype, then the
    prebuilt xllamacpp runner in a subprocess (an abort cannot take this process down): median decode and prompt
    tokens/s over --rounds completions, or the failure."""
    import check_llamacpp as llc

    work = args.work / "llamacpp"
    work.mkdir(parents=True, exist_ok=True)
    top, py = llc.fetch_llamacpp(work, llc.PIN), llc.converter_python(work)
    gguf = work / f"{src.name}-{args.outtype}.gguf"
    err = llc.to_gguf(py, top, src, gguf, None, args.outtype)
    if err:
        return {"status": err}
    fallback = None
    if args.quantize:  # llama-quantize of the vendored tree (scripts/bench_llamacpp_quants.py builds it once)
        import bench_llamacpp_quants as blq

        tools = ROOT / "build" / "llamacpp"
        _, quant_exe = blq.build_tools(tools, llc.fetch_llamacpp(tools, llc.PIN), llc.PIN)
        qgguf = work / f"{src.name}-{args.quantize}.gguf"
        err, fallback = blq.quantize(quant_exe, gguf, qgguf, args.quantize, work / f"{src.name}-{args.quantize}.log")
        if err:
            return {"status": err}
        gguf = qgguf
    runner = work / "runner.py"
    runner.write_text(LLAMACPP_RUNNER)
    res = subprocess.run([str(args.llamacpp_python), str(runner), str(gguf), str(args.threads),
                          str(args.prompt_tokens), str(args.llamacpp_new_tokens), str(args.rounds)],
                         capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() + res.stderr.splitlines() if "TIMINGS " in ln), None)
    if res.returncode or line is None:
        text = res.stderr + res.stdout
        assert_line = next((ln.strip() for ln in text.splitlines() if "GGML_ASSERT" in ln), None)
        return {"status": "aborts: " + (assert_line.split(": ", 1)[-1] if assert_line else llc.last_error(text))}
    t = json.loads(line.split("TIMINGS ", 1)[1])
    types = None
    if args.quantize:  # which type each tensor that could not take the K-quant fell back to (llama-quantize's log)
        import re
        from collections import Counter

        log = (work / f"{src.name}-{args.quantize}.log").read_text()
        found = re.findall(r"required for type\s+(\w+)\)\s*(?:\(WARNING[^)]*\)\s*)?-> falling back to\s+(\w+)", log)
        types = dict(Counter(f"{a} -> {b}" for a, b in found))
    return {"status": "ok", "decode_tok_s": statistics.median(x["predicted_per_second"] for x in t),
            "prompt_tok_s": statistics.median(x["prompt_per_second"] for x in t), "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size, "quant_fallback_tensors": fallback, "quant_fallback_types": types}


def timed_generate(model, ids: torch.Tensor, new: int) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--layouts", default="e64k16,e32k16,e16k4,e16k8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "serve")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--llamacpp-python", type=Path, default=None, help="a Python with xllamacpp installed (e.g. "
                    "python -m venv build/llvenv && build/llvenv/bin/pip install xllamacpp): also run llama.cpp")
    ap.add_argument("--outtype", default="f32", help="llama.cpp converter --outtype (f32, f16, q8_0)")
    ap.add_argument("--quantize", default="", help="then llama-quantize the --outtype GGUF to this type (e.g. "
                    "Q4_K_M, from --outtype f16) and time that; the JSON says how many tensors took a fallback type")
    ap.add_argument("--llamacpp-new-tokens", type=int, default=64)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--experts-impl", default="", help="comma-separated transformers experts implementations to time "
                    "each MoE layout under (grouped_mm, batched_mm, eager; rows named LAYOUT@IMPL); default: "
                    "what from_pretrained picks")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    args.work.mkdir(parents=True, exist_ok=True)
    layouts = [lay for lay in args.layouts.split(",") if lay]
    paths = {"dense": args.model, **{lay: convert(args.model, lay, args.work) for lay in layouts}}
    impls = {}  # row -> transformers experts implementation (LAYOUT@IMPL rows)
    if args.experts_impl:
        if args.llamacpp_python:
            raise SystemExit("--experts-impl times transformers only: leave out --llamacpp-python")
        base, paths = paths, {"dense": args.model}
        for lay in layouts:
            for impl in args.experts_impl.split(","):
                paths[f"{lay}@{impl}"], impls[f"{lay}@{impl}"] = base[lay], impl
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    rows = {name: {"active": 1.0 if name == "dense" else active_fraction(parse_config(name.split("@")[0]))}
            for name in paths}
    if not args.no_transformers:
        runs = {name: {"prefill": [], "full": [], "prefill_cpu": [], "full_cpu": []} for name in paths}
        for _ in range(args.rounds):  # one model resident at a time (a 1B float32 model is 4+ GB)
            for name, p in paths.items():
                kw = {"experts_implementation": impls[name]} if name in impls else {}
                m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, **kw).eval()
                timed_generate(m, ids, 2)  # warm-up
                w1, c1 = timed_generate(m, ids, 1)
                wn, cn = timed_generate(m, ids, args.new_tokens + 1)
                r = runs[name]
                r["prefill"].append(w1), r["prefill_cpu"].append(c1), r["full"].append(wn), r["full_cpu"].append(cn)
                del m
        for name, r in runs.items():
            pre, full = statistics.median(r["prefill"]), statistics.median(r["full"])
            rows[name]["transformers"] = {
                "decode_tok_s": args.new_tokens / (full - pre), "prompt_tok_s": args.prompt_tokens / pre,
                "decode_cpu_s_per_tok": (statistics.median(r["full_cpu"]) - statistics.median(r["prefill_cpu"]))
                / args.new_tokens}
        d = rows["dense"]["transformers"]
        print(f"{args.model.name}: transformers CPU float32, {args.threads} thread(s), greedy {args.new_tokens} "
              f"tokens after {args.prompt_tokens}; median of {args.rounds} round-robin rounds")
        print("| model | FFN active | decode tok/s | × dense | CPU s/token | prompt tok/s | × dense |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, row in rows.items():
            r = row["transformers"]
            print(f"| {name} | {row['active']:.0%} | {r['decode_tok_s']:.1f} | "
                  f"{r['decode_tok_s'] / d['decode_tok_s']:.2f} | {r['decode_cpu_s_per_tok']:.3f} | "
                  f"{r['prompt_tok_s']:.0f} | {r['prompt_tok_s'] / d['prompt_tok_s']:.2f} |")
    if args.llamacpp_python:
        for name, p in paths.items():
            rows[name]["llama.cpp"] = llamacpp_speed(p, name, args)
        d = rows["dense"]["llama.cpp"]
        print(f"{args.model.name}: llama.cpp ({args.quantize or args.outtype}, xllamacpp), {args.threads} thread(s), "
              "greedy "
              f"{args.llamacpp_new_tokens} tokens after ~{args.prompt_tokens}; median of {args.rounds} completions")
        print("| model | FFN active | decode tok/s | × dense | prompt tok/s | × dense | status |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for name, row in rows.items():
            r = row["llama.cpp"]
            if r["status"] != "ok" or d["status"] != "ok":
                print(f"| {name} | {row['active']:.0%} | – | – | – | – | {r['status'][:60]} |")
                continue
            print(f"| {name} | {row['active']:.0%} | {r['decode_tok_s']:.1f} | "
                  f"{r['decode_tok_s'] / d['decode_tok_s']:.2f} | {r['prompt_tok_s']:.0f} | "
                  f"{r['prompt_tok_s'] / d['prompt_tok_s']:.2f} | ok |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "outtype": args.outtype,
                                         "quantize": args.quantize, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
