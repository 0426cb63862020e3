"""Golden outputs: a fixed set of runs through the Python API on the tiny models conftest builds, every output's
files hashed and compared with tests/golden_hashes.json, so that a refactoring that moves code between stages shows
whether any output changed by one bit.

The runs (RUNS): convert weight-only (Mixtral) and calibrated (Qwen2-MoE with a shared expert), convert with the
active-50 preset and a short tuning (carve and tune in one call), upcycle full-width (Mixtral, Drop-Upcycling) and
fine-grained (Qwen2-MoE with a shared expert), merge of two sources with routers from text, a short tune of the
calibrated carve (sampled and real text) and a short next-token training of the full-width upcycle.

What is hashed, per output: every *.safetensors file (by its path in the output; the hash covers each tensor's name,
dtype, shape and bytes, in name order, read from the file's own header), config.json, README.md (the model card) and
moeify.toml. report.json is not: it holds absolute paths, wall-clock seconds and measured memory peaks, and what it
records of the run is repeated in the card and moeify.toml.

Normalised before hashing (README.md and moeify.toml only; found by running the set twice in different folders):
the moeify version (`moeify 0.1.0`, `moeify_version = "0.1.0"`: it changes with every release, not with the code's
output) and `seconds = ...` lines (a tuning or training run's wall-clock time). Nothing else changed between runs:
the outputs name their sources by folder name, not by path, and every tensor, every KL and logit difference a card
reports came out bit-identical.

The builds run in a process of their own with the processor's kernels pinned (PINNED): torch's scalar kernels
(ATEN_CPU_CAPABILITY=default, not the AVX2 or AVX512 ones it picks by processor) and MKL's conditional numerical
reproducibility (MKL_CBWR=COMPATIBLE), on one thread. Unpinned, each processor rounds differently: the hashes
written on 2026-12-01 came out different on 2026-12-02's CI machine and again on an AMD EPYC with AVX512 (the random
initialisation of the sources, the calibration statistics, the tuning and the cards' numbers), with the code
unchanged; on that EPYC a product, a softmax and torch's normal_ each changed bits between torch's AVX512, AVX2 and
scalar kernels, and between MKL's own choice and MKL_CBWR=COMPATIBLE, while the pinned pair gave the same bits with
MKL limited to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2) and numpy's AVX512 off (NPY_DISABLE_CPU_FEATURES): checked so
far on that one processor by limiting what it may use; a processor that still differs asks for another pin, not
for new hashes. One thread, because `train` depends on the thread count (the order of float sums in its training
steps: bit-identical run to run at a given count, different at one and two). Tuning and training in float32
(MOEIFY_AUTOCAST=off), because by default they run under bf16 autocast only where the CPU computes bf16 fast
(AVX512-BF16 or AMX): the trained outputs written on such a machine came out different on an AVX2-only one
(2026-12-02), every carve the same.

A mismatch names the output and the files that differ. When a change to an output is intended, regenerate the file
on purpose and say why in the commit:

    MOEIFY_GOLDEN_UPDATE=1 .venv/bin/pytest -q -n 0 tests/test_golden.py

A change of torch or transformers may change the sources themselves (built from seeds with transformers' own
initialisation) and so every hash: regenerate then too, after checking that only the upgrade changed (a git worktree
of the code before the change, regenerated with the new versions, gives the hashes the change must match).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeify
from conftest import CORPUS, build_dense, built_once
from moeify.version import __version__

GOLDEN = Path(__file__).with_name("golden_hashes.json")
UPDATE = os.environ.get("MOEIFY_GOLDEN_UPDATE") == "1"
SAMPLE = Path(moeify.__file__).parent / "data" / "calib_sample.txt"  # a second text, the bundled sample
CALIB = dict(calib=[str(CORPUS)], calib_tokens=2048, calib_seq_len=64)
HASHED = ("config.json", "README.md", "moeify.toml")
# the same bits on any x86-64 processor: torch's scalar kernels, MKL's reproducible path, one thread (docstring)
PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
          "MOEIFY_AUTOCAST": "off"}


def _convert_weight_only(src, out):
    moeify.convert(src["a"], out, experts=4, top_k=2, weight_only=True, format="mixtral", tune=False)


def _convert_calibrated(src, out):
    moeify.convert(src["a"], out, experts=4, top_k=2, shared=2, format="qwen2_moe", tune=False, **CALIB)


def _convert_preset_tuned(src, out):
    moeify.convert(src["a"], out, preset="active-50", tune=1024, **CALIB)


def _upcycle_full_width(src, out):
    moeify.upcycle(src["a"], out, copies=4, top_k=2, check_tokens=256)


def _upcycle_fine_grained(src, out):
    moeify.upcycle(src["a"], out, copies=2, granularity=2, top_k=2, shared_width=32, check_tokens=256)


def _merge(src, out):
    moeify.merge([src["a"], src["b"]], out, router_text=[CORPUS, SAMPLE], router_tokens=512, check_tokens=256)


def _tune(src, out):
    shutil.copytree(src["convert-calibrated"], out)
    moeify.tune(src["a"], out, tokens=1024, step_tokens=512)  # its own calibration text, half of it sampled


def _train(src, out):
    shutil.copytree(src["upcycle-full-width"], out)
    moeify.train(out, 1024, text=[CORPUS], step_tokens=512)


RUNS = {  # name -> the run writing OUT (the outputs' folder names: the cards name them)
    "convert-weight-only": _convert_weight_only,
    "convert-calibrated": _convert_calibrated,
    "convert-preset-tuned": _convert_preset_tuned,
    "upcycle-full-width": _upcycle_full_width,
    "upcycle-fine-grained": _upcycle_fine_grained,
    "merge": _merge,
    "tune": _tune,
    "train": _train,
}


class Outputs:
    """The sources ("a", "b": two dense Llamas of one tokenizer) and the runs' outputs, each built when first asked
    for (a run builds the outputs it starts from first)."""

    def __init__(self, root: Path, tokenizer_dir: Path):
        self.root, self.tokenizer_dir, self.built = root, tokenizer_dir, {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.built:
            path = self.root / name
            if name in ("a", "b"):
                build_dense(path, self.tokenizer_dir, seed=0 if name == "a" else 1)
            else:
                RUNS[name](self, path)
            self.built[name] = path
        return self.built[name]


def build_all(root: Path, tokenizer_dir: Path) -> None:
    """Every source and every run's output under root (what the pinned process runs: see __main__)."""
    torch.set_num_threads(1)
    outputs = Outputs(root, tokenizer_dir)
    for name in ("a", "b", *RUNS):
        outputs[name]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tokenizer_dir) -> Path:
    """The folder of every output, built once by a process with the kernels pinned (PINNED)."""
    def build(root: Path) -> None:
        done = subprocess.run([sys.executable, __file__, str(root), str(tokenizer_dir)], capture_output=True,
                              text=True, env={**os.environ, **PINNED})
        assert done.returncode == 0, f"the golden builds failed:\n{done.stderr[-4000:]}"

    return built_once(tmp_path_factory, "golden", build)


def tensors_digest(path: Path) -> str:
    """sha256 of a safetensors file's tensors: name, dtype, shape and bytes of each, in name order."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    h = hashlib.sha256()
    for name in sorted(header):
        t = header[name]
        start, end = t["data_offsets"]
        h.update(json.dumps([name, t["dtype"], t["shape"], end - start]).encode())
        h.update(data[8 + n + start:8 + n + end])
    return h.hexdigest()


def normalised(text: str) -> str:
    """README.md / moeify.toml without what changes between runs of the same code: the version, the seconds."""
    text = text.replace(f"moeify {__version__}", "moeify <version>")
    text = re.sub(r'^moeify_version = ".*"$', 'moeify_version = "<version>"', text, flags=re.M)
    return re.sub(r"^seconds = [0-9.e+-]+$", "seconds = <seconds>", text, flags=re.M)


def output_hashes(out: Path) -> dict[str, str]:
    hashes = {str(f.relative_to(out)): tensors_digest(f) for f in sorted(out.rglob("*.safetensors"))}
    for name in HASHED:
        raw = (out / name).read_text()
        hashes[name] = hashlib.sha256((raw if name == "config.json" else normalised(raw)).encode()).hexdigest()
    return hashes


def read_golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}


def write_golden(edit) -> None:
    """Read-modify-write the golden file under a lock (pytest-xdist workers may update it at once)."""
    import tempfile

    from filelock import FileLock

    with FileLock(Path(tempfile.gettempdir()) / "moeify-golden-hashes.lock"):
        golden = read_golden()
        edit(golden)
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=2, sort_keys=True) + "\n")


def mismatch(name: str, expected: dict, got: dict) -> str:
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    differ = sorted(f for f in set(expected) & set(got) if expected[f] != got[f])
    parts = [f"{label}: {', '.join(files)}" for label, files in
             (("differ", differ), ("missing", missing), ("not in the golden file", extra)) if files]
    return (f"output {name!r} changed ({'; '.join(parts)}); if intended, regenerate with MOEIFY_GOLDEN_UPDATE=1 "
            f"(tests/test_golden.py's docstring) and say why in the commit")


@pytest.mark.parametrize("name", RUNS)
def test_output_matches_its_golden_hashes(name, outputs):
    got = output_hashes(outputs / name)
    if UPDATE:
        write_golden(lambda golden: golden.update({name: got}))
        return
    expected = read_golden().get(name)
    assert expected is not None, f"output {name!r} is not in {GOLDEN.name}: run with MOEIFY_GOLDEN_UPDATE=1"
    assert got == expected, mismatch(name, expected, got)


def test_golden_file_holds_exactly_the_runs():
    """A run removed or renamed leaves no stale entry behind (an update drops it; the runs' tests add theirs)."""
    if UPDATE:
        write_golden(lambda golden: [golden.pop(k) for k in set(golden) - set(RUNS)])
        return
    assert sorted(read_golden()) == sorted(RUNS)


if __name__ == "__main__":  # python tests/test_golden.py ROOT TOKENIZER_DIR, run by the outputs fixture
    build_all(Path(sys.argv[1]), Path(sys.argv[2]))
