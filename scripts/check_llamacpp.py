"""llama.cpp round trip: does llama.cpp run moeify's output, and does it score it as `moeify eval` does?

    .venv/bin/python scripts/check_llamacpp.py                      # pinned llama-cpp-python, work dir build/llamacpp
    .venv/bin/python scripts/check_llamacpp.py --llama-cpp-python 0.3.16 --fix-router-mapping

A benchmark, not a CI test (it downloads and builds llama.cpp: about an hour the first time on 2 busy cores, of
which the llama.cpp build ~15 min and the two calibrated conversions most of the rest; minutes when the work dir
is kept). Steps, each skipped when its output is already in the work dir:

1. `pip download --no-binary :all: llama-cpp-python==PIN` (the source distribution vendors a llama.cpp tree, its
   `convert_hf_to_gguf.py` and `gguf-py`), unpacked; cmake builds only `llama-perplexity` (Release, -j2, nice).
2. A converter venv next to it that sees this interpreter's packages (torch, transformers) plus the converter's
   own needs, `sentencepiece` and `mistral_common`; the converter uses its own vendored `gguf-py`.
3. `moeify convert` (the CLI) of the dense model (default: models/smollm2-135m from scripts/get_smollm2.py, run
   here when missing; needs `pip install -e '.[bench]'`) into the MoE checkpoints of ROWS below: Mixtral and
   Qwen2-MoE (shared expert), with every expert active and calibrated top-2, plus the Qwen2-MoE variants that
   llama.cpp cannot load (tied embeddings, a dense layer, no shared expert), to record how they fail.
4. llama.cpp's converter (`--outtype f32`, so the comparison is not blurred by float16) of the dense model and
   every MoE output, then `llama-perplexity -c 256 --chunks N` on the first chars of WikiText-2 valid.
5. `moeify eval --seq-len 256 --max-tokens T` of the same models on the same text (T = the tokens llama-perplexity
   read), and one table: llama.cpp perplexity and its ratio to llama.cpp's dense, next to moeify eval's.

The two perplexities are not the same number: llama-perplexity scores the second half of each 256-token chunk,
moeify eval every token of each window; the ratios to dense are what must agree.
`--fix-router-mapping` applies the one-line workaround for trees whose `gguf-py/gguf/tensor_mapping.py` maps
Mixtral's `block_sparse_moe.gate` to `ffn_gate` (another architecture's entry overriding Mixtral's): it deletes
that entry. The check reports the mis-mapping either way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIN = "0.3.36"  # newest llama-cpp-python on the package index, 2026-11-23 (vendors llama.cpp 0c1e570, 2026-10-01)
CONVERTER_DEPS = ("sentencepiece==0.2.3", "mistral_common==1.13.1")  # what convert_hf_to_gguf.py imports besides torch
CALIB = Path("/work/shared/corpora/wikitext2/calib_train_200k.txt")
EVAL = Path("/work/shared/corpora/wikitext2/valid.txt")
CALIB_FALLBACK = ROOT / "examples/calib/wikitext2_train_sample.txt"

# name -> moeify convert flags. "all" rows: every expert active (must match dense); "cal" rows: calibrated top-2.
ROWS = {
    "mixtral e8k8 (all active)": ["--experts", "8", "--top-k", "8"],
    "mixtral e8k2 calibrated": ["--experts", "8", "--top-k", "2", "--calib", "{calib}", "--calib-tokens", "16384"],
    "qwen2_moe s1e7k7 tied (all active)": ["--format", "qwen2_moe", "--shared", "1", "--experts", "7", "--top-k", "7"],
    "qwen2_moe s1e7k7 + dense layer 0 (all active)": ["--format", "qwen2_moe", "--shared", "1", "--experts", "7",
                                                      "--top-k", "7", "--dense-layers", "0", "--untie-embeddings"],
    "qwen2_moe s1e7k7 (all active)": ["--format", "qwen2_moe", "--shared", "1", "--experts", "7", "--top-k", "7",
                                      "--untie-embeddings"],
    "qwen2_moe e8k8 no shared (all active)": ["--format", "qwen2_moe", "--experts", "8", "--top-k", "8",
                                              "--untie-embeddings"],
    "qwen2_moe s1e7k2 calibrated": ["--format", "qwen2_moe", "--shared", "1", "--experts", "7", "--top-k", "2",
                                    "--calib", "{calib}", "--calib-tokens", "16384", "--untie-embeddings"],
    # the presets' layouts as they resolve for the model (configs/active-50.toml: Qwen2-MoE, a shared expert of 25%
    # of d_ff + routed experts to 50%; active-25.toml: shared 12.5% + routed to 25%; README "Presets at your model's
    # shape"), carved without tuning (llama.cpp runs the layout; tuning changes values, not tensors), the earlier
    # fixed 64-slice preset layouts, the previous presets' Mixtral layouts, and the previous 50% layout, which aborts
    "qwen2_moe active-50 preset (resolved), untuned": ["--preset", str(ROOT / "configs/active-50.toml"), "--calib",
                                                       "{calib}", "--no-tune"],
    "qwen2_moe active-25 preset (resolved), untuned": ["--preset", str(ROOT / "configs/active-25.toml"), "--calib",
                                                       "{calib}", "--no-tune"],
    "qwen2_moe s16e48k16 earlier active-50 layout, untuned": ["--preset", str(ROOT / "configs/active-50.toml"),
                                                              "--experts", "48", "--shared", "16", "--top-k", "16",
                                                              "--calib", "{calib}", "--no-tune"],
    "qwen2_moe s8e56k8 earlier active-25 layout, untuned": ["--preset", str(ROOT / "configs/active-25.toml"),
                                                            "--experts", "56", "--shared", "8", "--top-k", "8",
                                                            "--calib", "{calib}", "--no-tune"],
    "mixtral e32k16 previous active-50 layout (weight-only)": ["--experts", "32", "--top-k", "16", "--weight-only"],
    "mixtral e64k16 previous active-25 layout (weight-only)": ["--experts", "64", "--top-k", "16", "--weight-only"],
    "mixtral e64k32 previous 50% layout (weight-only)": ["--experts", "64", "--top-k", "32", "--weight-only"],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], **kw)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ------------------------------------------------------------------------------------------- llama.cpp


def fetch_llamacpp(work: Path, pin: str) -> Path:
    """The sdist's top directory (vendor/llama.cpp inside), downloaded and unpacked once."""
    top = work / f"llama_cpp_python-{pin}"
    if (top / "vendor/llama.cpp/convert_hf_to_gguf.py").is_file():
        return top
    dl = work / "dl"
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={pin}", "-d", dl], check=True)
    with tarfile.open(dl / f"llama_cpp_python-{pin}.tar.gz") as tf:
        tf.extractall(work, filter="data")
    return top


def llamacpp_commit(top: Path) -> str:
    """The vendored llama.cpp commit and date (the sdist carries the submodule's git directory)."""
    res = subprocess.run(["git", "-C", str(top / "vendor/llama.cpp"), "log", "-1", "--format=%h %cs"],
                         capture_output=True, text=True)
    if res.returncode == 0 and res.stdout.strip():
        return res.stdout.strip()
    head = top / ".git/modules/vendor/llama.cpp/HEAD"
    return head.read_text().strip()[:7] if head.is_file() else "unknown"


def build_perplexity(work: Path, top: Path, pin: str) -> Path:
    build = work / f"build-{pin}"
    exe = build / "bin/llama-perplexity"
    if exe.is_file():
        return exe
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["nice", "-n", "10", "cmake", "-S", top / "vendor/llama.cpp", "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release",
         "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
         "-DLLAMA_USE_PREBUILT_UI=OFF"], check=True, stdout=subprocess.DEVNULL)
    run(["nice", "-n", "10", "cmake", "--build", build, "--target", "llama-perplexity", "-j2"], check=True,
        stdout=subprocess.DEVNULL)
    return exe


def converter_python(work: Path) -> Path:
    """A venv for convert_hf_to_gguf.py: this interpreter's packages (a .pth at the end of its path) plus the
    converter's own dependencies, installed there so that the moeify venv is not changed."""
    venv = work / "convert-venv"
    py = venv / "bin/python"
    stamp = venv / ".installed"
    if stamp.is_file():
        return py
    run([sys.executable, "-m", "venv", venv], check=True)
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "zz_moeify_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([py, "-m", "pip", "install", "-q", *CONVERTER_DEPS], check=True)
    stamp.write_text("ok\n")
    return py


ROUTER_OVERRIDE = re.compile(r'^\s*"model\.layers\.\{bid\}\.block_sparse_moe\.gate",\s*#\s*smallthinker.*\n', re.M)


def router_mapping(gguf_py: Path, py: Path) -> str:
    """What a gguf-py tree maps Mixtral's router to (should be ffn_gate_inp)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import gguf; "
            "m = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2); "
            "print(m.get_name('model.layers.0.block_sparse_moe.gate.weight', try_suffixes=('.weight',)))")
    res = subprocess.run([str(py), "-c", code, str(gguf_py)], capture_output=True, text=True)
    return res.stdout.strip() or f"error: {res.stderr.strip().splitlines()[-1:]}"


def fixed_gguf_py(top: Path, work: Path, pin: str) -> Path | None:
    """A copy of the vendored gguf-py with the one-line workaround (the entry that maps block_sparse_moe.gate to
    FFN_GATE deleted); None when the tree has no such entry. The vendored tree itself is left as it is."""
    dst = work / f"gguf-py-{pin}-fixed"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(top / "vendor/llama.cpp/gguf-py", dst)
    path = dst / "gguf/tensor_mapping.py"
    new, n = ROUTER_OVERRIDE.subn("", path.read_text())
    if not n:
        shutil.rmtree(dst)
        return None
    path.write_text(new)
    return dst


def to_gguf(py: Path, top: Path, model: Path, out: Path, gguf_py: Path | None, outtype: str = "f32") -> str | None:
    """None on success, else the converter's telling error line. gguf_py: a gguf-py to use instead of the vendored."""
    if out.is_file():
        return None
    env = dict(os.environ, NO_LOCAL_GGUF="1", PYTHONPATH=str(gguf_py)) if gguf_py else None
    res = run([py, top / "vendor/llama.cpp/convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile",
               str(out) + ".part"], capture_output=True, text=True, env=env)
    if res.returncode:
        return "convert: " + last_error(res.stderr + res.stdout)
    os.replace(str(out) + ".part", out)
    return None


def last_error(text: str) -> str:
    """The telling line of a failure: a model-load or tensor-mapping error if any, else the last error line."""
    for pat in (r"error loading model: (.*)", r"(Can not map tensor .*)", r"(missing tensor .*)"):
        found = re.findall(pat, text)  # the last one: a traceback quotes the raising source line first
        if found:
            return found[-1].strip()[:200]
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    bad = [l for l in lines if re.search(r"error|Error", l)]
    return (bad or lines or ["(no output)"])[-1][:200]


def perplexity(exe: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int, log_path: Path) -> dict:
    """{"ppl": final estimate or None, "error": None, or why there is none (load error, NaN chunks)}."""
    if not log_path.is_file():
        res = run([exe, "-m", gguf, "-f", text, "-c", ctx, "--chunks", chunks, "-b", ctx, "-t", threads],
                  capture_output=True, text=True)
        log_path.write_text(res.stdout + res.stderr)
    out = log_path.read_text()
    m = re.search(r"Final estimate: PPL = (\S+)", out)
    chunk = re.findall(r"\[\d+\](-?[0-9.]+|-?nan|-?inf)", out)
    if m and m.group(1).replace(".", "", 1).isdigit():
        return {"ppl": float(m.group(1)), "error": None}
    if chunk and all("nan" in c for c in chunk):
        return {"ppl": None, "error": f"every chunk NaN ({len(chunk)} chunks)"}
    return {"ppl": None, "error": "llama-perplexity: " + last_error(out)}


# ------------------------------------------------------------------------------------------------ moeify


def moeify_convert(src: Path, out: Path, flags: list[str], calib: Path) -> str | None:
    if (out / "moeify.toml").is_file() and (out / "config.json").is_file():
        return None
    cmd = [Path(sys.executable).parent / "moeify", "convert", src, out, *[f.format(calib=calib) for f in flags],
           "--overwrite"]
    res = run(cmd, capture_output=True, text=True)
    return None if res.returncode == 0 else "moeify convert: " + last_error(res.stderr + res.stdout)


def moeify_eval(models: list[Path], text: Path, seq_len: int, max_tokens: int, out_json: Path) -> dict[str, float]:
    """{resolved path: perplexity}; an earlier result in out_json is reused when it covers every model."""
    if out_json.is_file():
        got = {str(Path(m["path"]).resolve()): m["perplexity"] for m in json.loads(out_json.read_text())["models"]}
        if all(str(m.resolve()) in got for m in models):
            return got
    res = run([Path(sys.executable).parent / "moeify", "eval", *models, "--data", text, "--seq-len", seq_len,
               "--max-tokens", max_tokens, "--device", "cpu", "--no-oracle", "--json", out_json],
              capture_output=True, text=True)
    if res.returncode:
        print(res.stdout[-3000:], res.stderr[-3000:])
        raise SystemExit("moeify eval failed")
    data = json.loads(out_json.read_text())
    return {str(Path(m["path"]).resolve()): m["perplexity"] for m in data["models"]}


def ensure_model(model: Path) -> None:
    if (model / "config.json").is_file():
        return
    if model.resolve() != (ROOT / "models/smollm2-135m").resolve():
        raise SystemExit(f"{model} has no config.json")
    run([sys.executable, ROOT / "scripts/get_smollm2.py", model], check=True)


def versions(py: Path) -> dict:
    code = ("import json, torch, transformers, sentencepiece, mistral_common; print(json.dumps({'torch': "
            "torch.__version__, 'transformers': transformers.__version__, 'sentencepiece': sentencepiece.__version__, "
            "'mistral_common': mistral_common.__version__}))")
    conv = json.loads(subprocess.check_output([str(py), "-c", code], text=True))
    import transformers

    from moeify import __version__

    return {"moeify": __version__, "moeify transformers": transformers.__version__, "converter env": conv}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp-python", default=PIN, help="llama-cpp-python sdist version whose llama.cpp is used")
    p.add_argument("--work", type=Path, default=ROOT / "build/llamacpp", help="downloads, build, checkpoints, GGUFs")
    p.add_argument("--model", type=Path, default=ROOT / "models/smollm2-135m", help="dense llama/mistral checkpoint")
    p.add_argument("--rows", default="all", help="comma-separated row names (or slugs) of ROWS, or 'all'")
    p.add_argument("--chunks", type=int, default=32, help="llama-perplexity chunks of --ctx tokens")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="llama-perplexity threads (1: its spinning thread barrier "
                   "is slow on a shared, busy machine; raise it on an idle one)")
    p.add_argument("--eval-chars", type=int, default=200_000, help="first chars of WikiText-2 valid to score")
    p.add_argument("--skip-eval", action="store_true", help="llama.cpp only, no moeify eval column")
    p.add_argument("--fix-router-mapping", action="store_true", help="apply the one-line router-mapping workaround")
    p.add_argument("--json", type=Path, default=None, help="write every number here (default: WORK/result-PIN.json)")
    a = p.parse_args(argv)

    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    pin = a.llama_cpp_python
    t0 = time.time()
    model = a.model.resolve()
    ensure_model(model)
    calib = CALIB if CALIB.is_file() else CALIB_FALLBACK
    text_src = EVAL if EVAL.is_file() else ROOT / "examples/calib/wikitext2_train_sample.txt"
    text = work / f"eval-{a.eval_chars}.txt"
    if not text.is_file():
        text.write_text(text_src.read_text()[: a.eval_chars])

    top = fetch_llamacpp(work, pin)
    commit = llamacpp_commit(top)
    log(f"llama-cpp-python {pin}: llama.cpp {commit}")
    exe = build_perplexity(work, top, pin)
    py = converter_python(work)
    vendored = top / "vendor/llama.cpp/gguf-py"
    mapped = router_mapping(vendored, py)
    log(f"Mixtral router block_sparse_moe.gate -> {mapped}")
    gguf_py = fixed_gguf_py(top, work, pin) if a.fix_router_mapping else None
    fixed = gguf_py is not None
    if a.fix_router_mapping:
        log(f"workaround {'applied' if fixed else 'not needed (no overriding entry)'}: "
            f"router -> {router_mapping(gguf_py or vendored, py)}")

    rows = ROWS if a.rows == "all" else {k: v for k, v in ROWS.items() if k in a.rows.split(",")
                                         or slug(k) in a.rows.split(",")}
    tag = f"{pin}{'-fixed' if fixed else ''}"
    ggufs = work / f"gguf-{tag}"
    ggufs.mkdir(exist_ok=True)
    results = {"dense": {"path": model, "flags": [], "error": None}}
    for name, flags in rows.items():
        out = work / "moe" / slug(name)
        results[name] = {"path": out, "flags": flags}
    for name, r in results.items():  # one row at a time: moeify convert, GGUF, perplexity
        if name != "dense":
            r["error"] = moeify_convert(model, r["path"], r["flags"], calib)
        if r["error"]:
            continue
        g = ggufs / f"{slug(name)}.gguf"
        r["error"] = to_gguf(py, top, r["path"], g, gguf_py)
        if r["error"] is None:
            r.update(perplexity(exe, g, text, a.ctx, a.chunks, a.threads, ggufs / f"{slug(name)}.ppl.log"))
    n_tokens = a.ctx * a.chunks
    ok = [r["path"] for r in results.values() if (r["path"] / "config.json").is_file()]
    evals = {} if a.skip_eval else moeify_eval(ok, text, a.ctx, n_tokens, work / f"moeify-eval-{n_tokens}.json")
    dense_l, dense_m = results["dense"].get("ppl"), evals.get(str(model))

    lines = [f"llama-cpp-python {pin} (llama.cpp {commit}){', router mapping fixed' if fixed else ''}: "
             f"Mixtral router -> `{mapped}`",
             "", "| model | llama.cpp PPL | ratio to dense | moeify eval PPL | ratio to dense | llama.cpp |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lp, mp = r.get("ppl"), evals.get(str(r["path"].resolve()))
        r["moeify_eval_ppl"] = mp
        status = r.get("error") or "ok"
        lr = f"{lp / dense_l:.5f}" if lp and dense_l else "-"
        mr = f"{mp / dense_m:.5f}" if mp and dense_m else "-"
        lines.append(f"| {name} | {f'{lp:.4f}' if lp is not None else '-'} | {lr} | "
                     f"{f'{mp:.4f}' if mp else '-'} | {mr} | {status} |")
    lines += ["", f"llama-perplexity -c {a.ctx} --chunks {a.chunks} (f32 GGUFs); moeify eval --seq-len {a.ctx} "
              f"--max-tokens {n_tokens}; text: first {a.eval_chars} chars of {text_src.name}; "
              f"{(time.time() - t0) / 60:.1f} min"]
    print("\n".join(lines))
    summary = {"llama_cpp_python": pin, "llama_cpp": commit, "router_mapping": mapped, "router_fix_applied": fixed,
               "versions": versions(py), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "rows": {k: {kk: str(vv) if isinstance(vv, Path) else vv for kk, vv in v.items()}
                        for k, v in results.items()}, "table": lines}
    out_json = a.json or work / f"result-{tag}.json"
    out_json.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {out_json}")


if __name__ == "__main__":
    main()
