"""An upcycle continued in Hugging Face Trainer (scripts/check_trainer_fsdp.py), as users continue it at scale: the
stock transformers class (MixtralForCausalLM), its load-balancing loss, 2 CPU processes under torchrun, saved back
with the checkpoint's own tensor names.

FSDP is asked for (fsdp="full_shard", fsdp_config version 2) but accelerate 1.15 turns it on only on accelerators
(accelerate/state.py: DistributedType.FSDP is set in the MULTI_GPU / NPU / XPU ... branch; a CPU run is MULTI_CPU),
so on the CPU Trainer trains the model data-parallel; the test says so, and fails the day accelerate shards on the
CPU, so that docs/upcycling.md is brought up to date. FSDP2 of the same class on the CPU is what `moeify tune`
itself runs (tests/test_train_processes.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import CORPUS, build_dense
from moeify.formats.checkpoint import CheckpointReader

ROOT = Path(__file__).resolve().parents[1]


def test_an_upcycle_trains_in_trainer_across_2_processes_and_saves_its_own_names(tmp_path, tokenizer_dir):
    from moeify.upcycling.upcycle import UpcycleSettings, plan_upcycle, run_upcycle

    dense = build_dense(tmp_path / "dense", tokenizer_dir)
    out = tmp_path / "moe"
    run_upcycle(plan_upcycle(dense, UpcycleSettings(copies=4, top_k=2, symmetry="noise", dtype="float32")), out)
    save = tmp_path / "trained"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEIFY_", "ACCELERATE_"))}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "scripts" / "check_trainer_fsdp.py"), str(out), str(CORPUS), str(save),
                          "--fsdp"], env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith('{"')))
    assert got["processes"] == 2 and len(got["losses"]) == 3 and all(math.isfinite(x) for x in got["losses"])
    assert got["distributed_type"] == "DistributedType.MULTI_CPU" and not got["sharded"]  # see the docstring
    before, after = CheckpointReader(out), CheckpointReader(save)
    try:
        assert {n: t.shape for n, t in after.tensors.items()} == {n: t.shape for n, t in before.tensors.items()}
        expert = next(n for n in before.tensors if ".experts.0.w1." in n)
        router = next(n for n in before.tensors if n.endswith("block_sparse_moe.gate.weight"))
        assert not torch.equal(before.get(expert), after.get(expert))
        assert not torch.equal(before.get(router), after.get(router))
    finally:
        before.close()
        after.close()
