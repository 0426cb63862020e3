"""Calibrated conversion against a plain layer-sequential forward on the same tokens, in one run.

    python scripts/make_synthetic_checkpoint.py /tmp/bench/l1b --shape llama3.2-1b --tokenizer examples/tiny-llama
    python scripts/bench_calibrate.py /tmp/bench/l1b --tokens 4096 --append BENCHMARKS.md

Two subprocesses, one after the other, each on the same calibration tokens (the checkpoint's tokenizer on
WikiText-2 train text):
  forward  the dense model layer by layer exactly as calibration runs it (moeify.carving.calibrate.LayerwiseModel: load
           one decoder layer, attention over all hidden states, dense FFN, next layer), nothing written
  convert  `moeify convert --calib ... --method activation --router fitted --no-compensate`, the whole
           conversion including writing the output (what the scale issue names)
  refit    the same with the down_proj refit (`--compensate`, the default with --calib)
Each reports wall seconds, peak RSS (os.wait4) and its RSS after every layer (the memory must stay flat as
layers go by: one decoder layer resident). `convert` also reports where its time goes (stage timers around
the carving functions). The machine may be shared: compare the ratio measured side by side, not seconds
across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CORPUS = ROOT.parent / "shared" / "corpora" / "wikitext2" / "calib_train_200k.txt"


def rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _timer(store: dict, key: str, fn, sync):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        store[key] += time.perf_counter() - t0
        return out
    return wrapped


def phase_forward(a) -> dict:
    import torch

    from moeify.carving.calibrate import LayerwiseModel, resolve_device
    from moeify.formats.text import calibration_tokens
    from moeify.formats.checkpoint import CheckpointReader
    from moeify.formats.families import load_source

    t0 = time.perf_counter()
    src = load_source(a.src)
    reader = CheckpointReader(src.path)
    device = resolve_device(a.device)
    tokens, _ = calibration_tokens(src.path, [a.calib], a.tokens, a.seq_len)
    model = LayerwiseModel(src, reader, tokens, device=device)
    rss = []
    with torch.no_grad():
        for i in range(src.n_layers):
            layer = model.load_layer(i)
            h_mid, x = model.attention(layer)
            model.advance(h_mid, layer.mlp(x))
            del layer, h_mid, x
            rss.append(rss_now())
    if device == "cuda":
        torch.cuda.synchronize()
    return {"seconds_inner": time.perf_counter() - t0, "rss_per_layer": rss, "tokens": int(tokens.numel())}


def phase_convert(a) -> dict:
    import torch

    import moeify.carving.calibrate as cal
    import moeify.carving.carve as carve
    from moeify.formats.config import build_config
    from moeify.carving.conversion import plan_conversion, run_conversion

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    stages: dict[str, float] = defaultdict(float)
    for mod, name in ((cal, "ffn_activations"), (cal, "neuron_stats"), (carve, "partition_from_stats"),
                      (carve, "partition_neurons"), (carve, "expert_output_norms"), (carve, "build_router"),
                      (carve, "topk_agreement"), (carve, "fit_router"), (carve, "routing_mask"), (carve, "refit_down")):
        setattr(mod, name, _timer(stages, name, getattr(mod, name), sync))
    for name in ("load_layer", "attention"):
        setattr(cal.LayerwiseModel, name, _timer(stages, "forward: " + name, getattr(cal.LayerwiseModel, name), sync))
    carve_fn = carve.carve_calibrated
    cal_stage = {}

    def timed_carve(*args, **kwargs):
        t0 = time.perf_counter()
        out = carve_fn(*args, **kwargs)
        sync()
        cal_stage["carve_calibrated"] = cal_stage.get("carve_calibrated", 0.0) + time.perf_counter() - t0
        return out
    carve.carve_calibrated = timed_carve

    rss, marks = [], {}

    def progress(stage: str, done: int, total: int) -> None:
        marks.setdefault(stage + " start", time.perf_counter())
        marks[stage + " end"] = time.perf_counter()
        if stage == "calibrating":
            rss.append(rss_now())

    t0 = time.perf_counter()
    if a.phase == "preset":  # the preset's whole pipeline on the same tokens
        cfg = build_config(a.preset, calib=[a.calib], calib_tokens=a.tokens, calib_seq_len=a.seq_len, device=a.device)
    else:
        cfg = build_config(experts=a.experts, top_k=a.top_k, method="activation", router="fitted", calib=[a.calib],
                           calib_tokens=a.tokens, calib_seq_len=a.seq_len, device=a.device,
                           compensate=a.phase == "refit")
    out = Path(a.out)
    run_conversion(plan_conversion(a.src, cfg), out, overwrite=True, progress=progress)
    seconds = time.perf_counter() - t0
    stages["carve_calibrated (total)"] = cal_stage.get("carve_calibrated", 0.0)
    writing = marks.get("writing end", 0) - marks.get("calibrating end", marks.get("writing start", 0))
    return {"seconds_inner": seconds, "rss_per_layer": rss, "stages": dict(stages),
            "calibration_pass": marks.get("calibrating end", t0) - t0, "writing_pass": writing}


def run_phase(phase: str, a) -> dict:
    from bench_convert import RssSampler

    out_json = Path(a.work) / f"{phase}.json"
    cmd = [sys.executable, __file__, str(a.src), "--phase", phase, "--tokens", str(a.tokens), "--seq-len",
           str(a.seq_len), "--device", a.device, "--experts", str(a.experts), "--top-k", str(a.top_k),
           "--calib", str(a.calib), "--work", str(a.work), "--result", str(out_json)]
    if a.preset:
        cmd += ["--preset", str(a.preset)]
    log = Path(a.work) / f"{phase}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        sampler = RssSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        sampler.stop()
    os.sync()
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{phase} failed; see {log}:\n{log.read_text()[-3000:]}")
    result = json.loads(out_json.read_text())
    result.update(seconds=seconds, peak_rss=usage.ru_maxrss * 1024)
    return result


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calib", type=Path, default=CORPUS)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench/calib-work"))
    p.add_argument("--label", default=None)
    p.add_argument("--append", type=Path, default=None, help="markdown file to add the result to")
    p.add_argument("--no-refit", action="store_true", help="skip the run with the down_proj refit")
    p.add_argument("--preset", type=Path, default=None, help="time this preset's whole pipeline instead of the "
                   "convert/refit runs (e.g. configs/active-50.toml)")
    p.add_argument("--phase", choices=("forward", "convert", "refit", "preset"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out = str(Path(a.work) / "moe")
    if a.phase:
        result = (phase_forward if a.phase == "forward" else phase_convert)(a)
        a.result.write_text(json.dumps(result))
        return

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((a.src / "config.json").read_text())
    label = a.label or a.src.name
    if a.preset:  # the header names the preset's experts, not the --experts/--top-k defaults
        from moeify.formats.config import load_preset

        a.experts, a.top_k = (load_preset(a.preset).get(k, v) for k, v in (("experts", a.experts), ("top_k", a.top_k)))
    fwd = run_phase("forward", a)
    print(f"forward: {fwd['seconds']:.1f} s, peak RSS {gb(fwd['peak_rss'])} GB", flush=True)
    runs = {}
    phases = ("preset",) if a.preset else ("convert",) + (() if a.no_refit else ("refit",))
    for phase in phases:
        runs[phase] = run_phase(phase, a)
        shutil.rmtree(a.out, ignore_errors=True)
        print(f"{phase}: {runs[phase]['seconds']:.1f} s, peak RSS {gb(runs[phase]['peak_rss'])} GB", flush=True)

    def flat(r):
        xs = r["rss_per_layer"]
        return f"{gb(min(xs))}–{gb(max(xs))} GB" if xs else "–"

    what = {"convert": "convert --method activation --router fitted --no-compensate, incl. writing",
            "refit": "the same + down_proj refit (--compensate, the --calib default)",
            "preset": f"convert --preset {a.preset}, incl. writing"}
    shape = (f"hidden {cfg['hidden_size']}, d_ff {cfg['intermediate_size']}, {cfg['num_hidden_layers']} layers, "
             f"vocab {cfg['vocab_size']}")
    lines = [f"### Calibrated conversion: {label} ({shape}), {fwd['tokens']} tokens × seq {a.seq_len}, "
             f"{a.experts} experts top-{a.top_k}, {a.device}, {time.strftime('%Y-%m-%d %H:%M')}", "",
             "```", f"python scripts/bench_calibrate.py {a.src} --tokens {a.tokens} --seq-len {a.seq_len}"
             + (f" --device {a.device}" if a.device != "cpu" else "") + (" --no-refit" if a.no_refit else "")
             + (f" --preset {a.preset}" if a.preset else ""), "```", "",
             "| run | seconds | × forward | peak RSS | RSS after each layer (min–max) |", "|---|---:|---:|---:|---|",
             f"| plain layer-sequential forward | {fwd['seconds']:.1f} | 1.00 | {gb(fwd['peak_rss'])} GB | {flat(fwd)} |"]
    for phase, r in runs.items():
        lines.append(f"| {what[phase]} | {r['seconds']:.1f} | {r['seconds'] / fwd['seconds']:.2f} | "
                     f"{gb(r['peak_rss'])} GB | {flat(r)} |")
    lines += ["", "Where the conversions' time goes (stage timers around the carving functions; nested stages overlap):",
              "", "| stage | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    for name in ("calibration pass", "writing pass"):
        key = name.replace(" ", "_")
        lines.append(f"| {name} | " + " | ".join(f"{r[key]:.1f}" for r in runs.values()) + " |")
    names = sorted({n for r in runs.values() for n in r["stages"]},
                   key=lambda n: -max(r["stages"].get(n, 0) for r in runs.values()))
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r['stages'].get(name, 0.0):.1f}" for r in runs.values()) + " |")
    from bench_convert import publish

    publish(lines, a.append)


if __name__ == "__main__":
    main()
