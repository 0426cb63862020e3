"""Quality in the formats llama.cpp serves: perplexity of the dense model and of tuned MoE outputs as GGUF at
f32, f16, Q8_0 and Q4_K_M, on the held-out texts, each MoE as a ratio to the dense model at the same quant.

    .venv/bin/python scripts/bench_llamacpp_quants.py models/smollm2-135m OUT50 OUT25 \\
        --json results/serving/llamacpp-quants-smollm2.json

Uses scripts/check_llamacpp.py's pieces (its work dir, default build/llamacpp): the llama.cpp tree vendored in the
pinned llama-cpp-python sdist, its converter (`convert_hf_to_gguf.py --outtype f32 | f16 | q8_0`) and its
`llama-quantize` (Q4_K_M, from the f16 GGUF) and `llama-perplexity` (built here once: cmake, Release, -j2, nice).
`llama-perplexity -c 256 --chunks N` scores the second half of each 256-token chunk of the first --chars characters
of each text. Where an expert's width is not a multiple of 256, llama-quantize stores that tensor in a fallback type
(its log says which; counted in the table): the K-quant row of a narrow-expert layout measures that mix.

The table's last column is what serving in that format costs the carve beyond what it costs the dense model:
(MoE / dense at this quant) / (MoE / dense at f32) - 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_llamacpp as ll  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPORA = next((p / "shared/corpora" for p in ROOT.parents if (p / "shared/corpora").is_dir()), None)
TEXTS = ([CORPORA / "wikitext2/valid.txt", CORPORA / "tinyshakespeare/valid.txt"] if CORPORA else []) + [
    Path("/usr/share/common-licenses/GPL-3")]
QUANTS = ("f32", "f16", "q8_0", "Q4_K_M")


def build_tools(work: Path, top: Path, pin: str) -> tuple[Path, Path]:
    """llama-perplexity and llama-quantize of the vendored tree (built once)."""
    build = work / f"build-{pin}"
    exe, quant = build / "bin/llama-perplexity", build / "bin/llama-quantize"
    if not quant.is_file():
        ll.build_perplexity(work, top, pin)  # configures the build dir (and builds llama-perplexity)
        ll.run(["nice", "-n", "10", "cmake", "--build", build, "--target", "llama-quantize", "-j2"], check=True,
               stdout=ll.subprocess.DEVNULL)
    return exe, quant


def quantize(quant_exe: Path, f16: Path, out: Path, qtype: str, log_path: Path) -> tuple[str | None, int]:
    """(error or None, how many tensors took a fallback type: llama-quantize's own count)."""
    if not out.is_file():
        res = ll.run([quant_exe, f16, str(out) + ".part", qtype], capture_output=True, text=True)
        log_path.write_text(res.stdout + res.stderr)
        if res.returncode:
            return "llama-quantize: " + ll.last_error(res.stdout + res.stderr), 0
        Path(str(out) + ".part").rename(out)
    text = log_path.read_text() if log_path.is_file() else ""
    m = re.search(r"(\d+) of \d+ tensor\(s\) required fallback", text)
    return None, int(m.group(1)) if m else 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dense", type=Path)
    p.add_argument("outputs", type=Path, nargs="+", help="moeify outputs (tuned MoE checkpoints)")
    p.add_argument("--texts", type=Path, nargs="+", default=TEXTS)
    p.add_argument("--quants", default=",".join(QUANTS))
    p.add_argument("--chars", type=int, default=60_000, help="first characters of each text scored")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=ROOT / "build/llamacpp")
    p.add_argument("--llama-cpp-python", default=ll.PIN)
    p.add_argument("--gguf-dir", type=Path, default=None, help="where the GGUFs and text cuts go [default: WORK/quants]; "
                   "a GGUF already there is reused, so give each set of models its own")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)

    t0 = time.time()
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    top = ll.fetch_llamacpp(work, a.llama_cpp_python)
    exe, quant_exe = build_tools(work, top, a.llama_cpp_python)
    py = ll.converter_python(work)
    ggufs = (a.gguf_dir or work / "quants").resolve()
    ggufs.mkdir(parents=True, exist_ok=True)
    texts = {}
    for t in a.texts:
        name = t.parent.name if t.stem in ("valid", "test", "train") else t.name  # the corpus, not its split
        cut = ggufs / f"text-{ll.slug(name)}-{a.chars}.txt"
        if not cut.is_file():
            cut.write_text(t.read_text(errors="replace")[: a.chars])
        texts[name] = cut
    models = {"dense": a.dense.resolve(), **{m.name: m.resolve() for m in a.outputs}}
    quants = a.quants.split(",")
    rows: dict = {}
    for name, path in models.items():
        for q in quants:
            g = ggufs / f"{ll.slug(name)}-{q}.gguf"
            err, fallbacks = None, 0
            if q in ("f32", "f16", "q8_0"):
                err = ll.to_gguf(py, top, path, g, None, outtype=q)
            else:
                f16 = ggufs / f"{ll.slug(name)}-f16.gguf"
                err = ll.to_gguf(py, top, path, f16, None, outtype="f16")
                if err is None:
                    err, fallbacks = quantize(quant_exe, f16, g, q, ggufs / f"{ll.slug(name)}-{q}.quantize.log")
            for tname, tpath in texts.items():
                r = {"error": err, "fallback_tensors": fallbacks, "gguf_bytes": g.stat().st_size if g.is_file() else None}
                if err is None:
                    r.update(ll.perplexity(exe, g, tpath, a.ctx, a.chunks, a.threads,
                                           ggufs / f"{ll.slug(name)}-{q}-{ll.slug(tname)}.ppl.log"))
                rows[(name, q, tname)] = r
                ll.log(f"{name} {q} {tname}: {r.get('ppl')} {r.get('error') or ''}")
    lines = [f"llama.cpp {ll.llamacpp_commit(top)}; llama-perplexity -c {a.ctx} --chunks {a.chunks}, first "
             f"{a.chars:,} chars of each text; ratio: MoE / dense at the same quant; vs f32: that ratio over f32's",
             "", "| model | quant | " + " | ".join(texts) + " | vs f32 (" + " / ".join(texts) + ") |",
             "|---|---|" + "---:|" * len(texts) + "---|"]
    for name in models:
        if name == "dense":
            continue
        for q in quants:
            cells, vs = [], []
            for t in texts:
                r, d, r0, d0 = (rows[(name, q, t)], rows[("dense", q, t)], rows[(name, "f32", t)],
                                rows[("dense", "f32", t)]) if "f32" in quants else (rows[(name, q, t)],
                                                                                     rows[("dense", q, t)], None, None)
                if r.get("ppl") and d.get("ppl"):
                    ratio = r["ppl"] / d["ppl"]
                    cells.append(f"× {ratio:.3f}")
                    if r0 and d0 and r0.get("ppl") and d0.get("ppl"):
                        vs.append(f"{ratio / (r0['ppl'] / d0['ppl']) - 1:+.2%}")
                else:
                    cells.append((r.get("error") or d.get("error") or "?")[:30])
            fb = rows[(name, q, next(iter(texts)))]["fallback_tensors"]
            lines.append(f"| {name} | {q}{f' ({fb} tensors fallback)' if fb else ''} | " + " | ".join(cells) + " | "
                         + " / ".join(vs) + " |")
    print("\n".join(lines))
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps({
            "llamacpp": ll.llamacpp_commit(top), "ctx": a.ctx, "chunks": a.chunks, "chars": a.chars,
            "texts": {k: str(v) for k, v in texts.items()}, "models": {k: str(v) for k, v in models.items()},
            "rows": [{"model": m, "quant": q, "text": t, **r} for (m, q, t), r in rows.items()]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
