"""Qwen2 / Qwen2.5 dense checkpoints as sources: carved into Qwen2-MoE with their q/k/v biases carried over exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import build_dense, load
from moeify.formats.checkpoint import CheckpointReader
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.formats.experts import unpermute_ffn
from moeify.maths.partition import Partition
from test_calibrate import CALIB
from test_reliability import assert_refused, cli

EXACT_LOGPROB = 1e-5  # max |log-prob difference|, float32, every expert active
QWEN = dict(family="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def max_logprob_diff(a: Path, b: Path, seq: int = 24) -> float:
    dense, _ = load(a)
    moe, info = load(b)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, dense.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (dense(ids).logits.log_softmax(-1) - moe(ids).logits.log_softmax(-1)).abs().max().item()


LAYOUTS = {"routed": dict(experts=4), "shared+dense layer": dict(experts=4, shared=2, dense_layers="1")}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_experts_active_reproduce_a_qwen2_models_log_probs(tmp_path, tokenizer_dir, tied, layout):
    src = build_dense(tmp_path / "dense", tokenizer_dir, tie_word_embeddings=tied, **QWEN)  # GQA: 4 heads / 2 kv
    flags = LAYOUTS[layout]
    report = run_conversion(plan_conversion(src, build_config(top_k=flags["experts"], method="gate-cluster",
                                                              gate_tolerance=1e-6, **flags)), tmp_path / "moe")
    assert report["format"] == "qwen2_moe"  # auto: the only format with q/k/v biases
    out = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert out["rope_parameters"]["rope_theta"] == 1e6 and out["tie_word_embeddings"] is tied
    assert out["use_sliding_window"] is False
    dense_bias = CheckpointReader(src).get("model.layers.2.self_attn.k_proj.bias")
    assert dense_bias.abs().max() > 0.1  # the biases matter: a zero bias would not reproduce the logits
    assert torch.equal(CheckpointReader(tmp_path / "moe").get("model.layers.2.self_attn.k_proj.bias"), dense_bias)
    diff = max_logprob_diff(src, tmp_path / "moe")
    assert diff <= EXACT_LOGPROB, f"{layout}, tied={tied}: max |log-prob diff| {diff:.3g}"


def altered_logprob_diff(tmp_path, src: Path, suffixes: tuple[str, ...], fill: float) -> float:
    """Max |log-prob diff| against the dense source of an all-experts carve whose tensors ending in `suffixes` are
    overwritten with `fill`: shows that the exactness test sees those tensors."""
    from safetensors.torch import load_file, save_file

    run_conversion(plan_conversion(src, build_config(experts=4, top_k=4, gate_tolerance=1e-6)), tmp_path / "moe")
    f = tmp_path / "moe" / "model.safetensors"
    tensors = load_file(str(f))
    save_file({k: torch.full_like(v, fill) if k.endswith(suffixes) else v for k, v in tensors.items()}, str(f),
              metadata={"format": "pt"})
    return max_logprob_diff(src, tmp_path / "moe")


def test_zeroed_biases_would_break_exactness(tmp_path, tokenizer_dir):
    """The exactness test above sees the biases: the same output with its biases zeroed is far from dense."""
    src = build_dense(tmp_path / "dense", tokenizer_dir, **QWEN)
    assert altered_logprob_diff(tmp_path, src, ("_proj.bias",), 0.0) > 1e-2


def assert_round_trip(src: Path, out: Path, fmt: str, **flags) -> None:
    """A bf16 source carved with `flags`: every layer's experts un-permuted give back its FFN bit for bit."""
    report = run_conversion(plan_conversion(src, build_config(**flags)), out)
    dense, moe = CheckpointReader(src), CheckpointReader(out)
    assert report["format"] == fmt
    units = flags["experts"] + flags.get("shared", 0)
    for layer in report["layers"]:
        i = layer["layer"]
        part = Partition(torch.tensor(layer["perm"]), layer["shared_neurons"], flags["experts"], 96 // units)
        tensors = {n: moe.get(n) for n in moe.tensors if n.startswith(f"model.layers.{i}.")}
        g, u, d = unpermute_ffn(tensors, part, fmt, i, build_config(**flags))
        p = f"model.layers.{i}.mlp."
        assert torch.equal(g, dense.get(p + "gate_proj.weight")) and torch.equal(u, dense.get(p + "up_proj.weight"))
        assert torch.equal(d, dense.get(p + "down_proj.weight"))


def test_qwen2_round_trip_unpermute_is_bit_exact(tmp_path):
    src = build_dense(tmp_path / "dense", dtype=torch.bfloat16, **QWEN)
    assert_round_trip(src, tmp_path / "moe", "qwen2_moe", experts=4, top_k=2, shared=2, method="gate-cluster")


def test_a_calibrated_and_tuned_qwen2_carve_verifies_against_its_source(tmp_path, tokenizer_dir):
    """The whole pipeline on a Qwen2 source: calibration runs Qwen2's own decoder layers, tuning distils towards the
    Qwen2 teacher, and `verify --against` finds every non-FFN tensor (biases included) equal to the source's."""
    from moeify.tuning import TuneOptions, tune_output
    from moeify.evaluation.verify import verify_checkpoint

    src = build_dense(tmp_path / "dense", tokenizer_dir, initializer_range=0.3, **QWEN)
    run_conversion(plan_conversion(src, build_config(experts=4, top_k=2, shared=2, **CALIB)), tmp_path / "moe")
    assert verify_checkpoint(tmp_path / "moe", against=src).problems == []
    report = tune_output(src, tmp_path / "moe", TuneOptions(tokens=4096, generated=0.25, lr=0.02))
    run = report["tuning"]["runs"][0]
    assert run["holdout_kl_after"] < run["holdout_kl_before"]
    model, info = load(tmp_path / "moe")
    assert not info["missing_keys"] and type(model).__name__ == "Qwen2MoeForCausalLM"


def test_qwen2_refusals(tmp_path, tokenizer_dir):
    src = build_dense(tmp_path / "dense", tokenizer_dir, **QWEN)
    assert_refused(cli("convert", src, tmp_path / "o", "-n", "4", "-k", "2", "--format", "mixtral"),
                   "--format mixtral cannot hold the q/k/v biases", "--format qwen2_moe")
    assert not (tmp_path / "o").exists()
    sliding = build_dense(tmp_path / "sliding", tokenizer_dir, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1, **QWEN)
    assert_refused(cli("convert", sliding, tmp_path / "o", "-n", "4", "-k", "2"), "use_sliding_window = true",
                   "not supported")
