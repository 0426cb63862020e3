"""Do the engines run a moeify output, and do they compute what transformers computes? A benchmark, not CI.

    .venv/bin/python scripts/check_engines.py models/smollm2-135m OUT1 OUT2 ... \\
        --llamacpp-python build/llvenv/bin/python [--json results.json]

For the dense source and each converted checkpoint (e.g. the tuned presets kept by `scripts/bench_quality.py --keep
DIR`): greedy decoding of --new-tokens tokens after the same --prompt-tokens tokens of real text (the first of
WikiText-2 valid by default), in transformers (AutoModelForCausalLM, CPU float32) and in llama.cpp (its own
`convert_hf_to_gguf.py` from the pinned llama-cpp-python sdist, --outtype f32, run by the prebuilt `xllamacpp`
server with the prompt given as token ids). It reports whether each engine loaded and ran the model, and how many
of transformers' generated tokens llama.cpp's text reproduces before the first difference. Greedy decoding of a model whose top-2 next tokens are close
can part after a few tokens under float32 rounding differences alone; the dense row shows what that looks like.
vLLM is checked by scripts/check_vllm.py (its CPU build, in a venv of its own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_llamacpp as llc  # noqa: E402

RUNNER = """
import json, sys
import xllamacpp as x
gguf, ids, n_new, kv = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
p = x.CommonParams()
if kv == "f32":  # llama.cpp's default KV cache is F16: its rounding alone can flip an MoE's near-tied routing
    p.cache_type_k = p.cache_type_v = x.ggml_type.GGML_TYPE_F32
p.model.path = gguf
p.n_ctx = 1024
p.cpuparams.n_threads = 1
p.cpuparams_batch.n_threads = 1
p.n_parallel = 1
s = x.Server(p)
req = {"prompt": ids, "n_predict": n_new, "temperature": 0, "top_k": 1, "ignore_eos": True, "cache_prompt": False}
r = s.handle_completions(req)
print("RESULT " + json.dumps({"text": r["choices"][0]["text"]}), flush=True)
"""


def transformers_greedy(path: Path, ids: list[int], n_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def llamacpp_greedy(path: Path, ids: list[int], n_new: int, args) -> tuple[str | None, str]:
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    top, py = llc.fetch_llamacpp(work, llc.PIN), llc.converter_python(work)
    gguf = work / f"{path.resolve().parent.name}-{path.name}-f32.gguf"
    err = llc.to_gguf(py, top, path, gguf, None, "f32")
    if err:
        return None, err
    runner = work / "greedy_runner.py"
    runner.write_text(RUNNER)
    res = subprocess.run([str(args.llamacpp_python), str(runner), str(gguf), json.dumps(ids), str(n_new), args.kv],
                         capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode or line is None:
        text = res.stderr + res.stdout
        assert_line = next((ln.strip() for ln in text.splitlines() if "GGML_ASSERT" in ln), None)
        return None, "aborts: " + (assert_line or llc.last_error(text))
    return json.loads(line[len("RESULT "):])["text"], "ok"


def agree(tok, hf: list[int], text: str) -> int:
    """How many of transformers' generated tokens llama.cpp's text reproduces before the first difference (the
    server returns text, not token ids: the longest run of transformers' tokens whose decoding starts its text)."""
    n = 0
    while n < len(hf) and text.startswith(tok.decode(hf[:n + 1])):
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+", help="the dense source first, then converted checkpoints")
    ap.add_argument("--prompt-file", type=Path, default=ROOT.parent / "shared/corpora/wikitext2/valid.txt")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--llamacpp-python", type=Path, required=True, help="a Python with xllamacpp installed")
    ap.add_argument("--kv", default="f32", choices=("f32", "f16"), help="llama.cpp's KV cache type (its default: f16)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "serve" / "llamacpp")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.models[0])
    ids = tok(args.prompt_file.read_text()[:20000], add_special_tokens=False)["input_ids"][:args.prompt_tokens]
    rows = []
    for path in args.models:
        hf = transformers_greedy(path, ids, args.new_tokens)
        cpp, status = llamacpp_greedy(path, ids, args.new_tokens, args)
        rows.append({"model": str(path), "llama.cpp": status, "transformers_tokens": hf,
                     "agree": None if cpp is None else agree(tok, hf, cpp),
                     "transformers_text": tok.decode(hf), "llamacpp_text": cpp})
        print(json.dumps({k: rows[-1][k] for k in ("model", "llama.cpp", "agree")}), flush=True)
    print(f"greedy, {args.new_tokens} tokens after {len(ids)} prompt tokens; transformers CPU float32 vs llama.cpp f32 "
          f"weights, {args.kv} KV cache")
    print("| model | transformers | llama.cpp | same tokens before the first difference |")
    print("|---|---|---|---:|")
    for r in rows:
        same = "–" if r["agree"] is None else f"{r['agree']} of {args.new_tokens}"
        print(f"| {Path(r['model']).name} | runs | {r['llama.cpp']} | {same} |")
    if args.json:
        args.json.write_text(json.dumps({"prompt_tokens": ids, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
