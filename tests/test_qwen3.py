"""Qwen3 dense checkpoints as sources: carved into Qwen3-MoE (q/k norms, head_dim of its own, no shared expert) at
k = experts reproducing the dense log-probs; shared-expert layouts refused with the layout that Qwen3-MoE holds."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_dense
from moeify.formats.checkpoint import CheckpointReader
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.formats.engines import same_share_layout
from test_calibrate import CALIB
from test_qwen2 import EXACT_LOGPROB, altered_logprob_diff, assert_round_trip, max_logprob_diff
from test_reliability import assert_refused, cli

# head_dim 24 while hidden / heads = 16: Qwen3's head_dim is its own (128 at every released size)
QWEN3 = dict(family="qwen3", head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
LAYOUTS = {"routed": dict(experts=4), "routed+dense layer": dict(experts=4, dense_layers="1")}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_experts_active_reproduce_a_qwen3_models_log_probs(tmp_path, tokenizer_dir, tied, layout):
    src = build_dense(tmp_path / "dense", tokenizer_dir, tie_word_embeddings=tied, **QWEN3)  # GQA: 4 heads / 2 kv
    flags = LAYOUTS[layout]
    report = run_conversion(plan_conversion(src, build_config(top_k=flags["experts"], method="gate-cluster",
                                                              gate_tolerance=1e-6, **flags)), tmp_path / "moe")
    assert report["format"] == "qwen3_moe"  # auto: the only format with q/k norms
    out = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert out["architectures"] == ["Qwen3MoeForCausalLM"] and out["head_dim"] == 24
    assert out["num_experts"] == 4 and "num_local_experts" not in out  # as released Qwen3-MoE configs say it
    assert out["norm_topk_prob"] is True and out["tie_word_embeddings"] is tied
    assert out["rope_parameters"]["rope_theta"] == 1e6 and out["use_sliding_window"] is False
    assert out["mlp_only_layers"] == ([1] if "dense" in layout else [])
    q_norm = CheckpointReader(src).get("model.layers.2.self_attn.q_norm.weight")
    assert (q_norm - 1).abs().max() > 0.1  # non-trivial: a q/k norm left at ones would not reproduce the logits
    assert torch.equal(CheckpointReader(tmp_path / "moe").get("model.layers.2.self_attn.q_norm.weight"), q_norm)
    diff = max_logprob_diff(src, tmp_path / "moe")
    assert diff <= EXACT_LOGPROB, f"{layout}, tied={tied}: max |log-prob diff| {diff:.3g}"


def test_q_k_norms_left_at_ones_would_break_exactness(tmp_path, tokenizer_dir):
    """The exactness test sees the q/k norms: the same output with them reset to ones is far from dense."""
    src = build_dense(tmp_path / "dense", tokenizer_dir, **QWEN3)
    assert altered_logprob_diff(tmp_path, src, ("q_norm.weight", "k_norm.weight"), 1.0) > 1e-2


def test_qwen3_round_trip_unpermute_is_bit_exact(tmp_path):
    src = build_dense(tmp_path / "dense", dtype=torch.bfloat16, **QWEN3)
    assert_round_trip(src, tmp_path / "moe", "qwen3_moe", experts=6, top_k=2, method="gate-cluster")
    assert not any("shared_expert" in n for n in CheckpointReader(tmp_path / "moe").tensors)


def test_a_calibrated_and_tuned_qwen3_carve_verifies_inspects_and_loads(tmp_path, tokenizer_dir):
    """The whole pipeline on a Qwen3 source: calibration runs Qwen3's own decoder layers, tuning distils towards the
    Qwen3 teacher, `verify --against` finds every non-FFN tensor (q/k norms included) equal to the source's and the
    all-experts logits of a training-free carve equal, and `inspect` reads the output."""
    from moeify.tuning import TuneOptions, tune_output
    from moeify.evaluation.verify import verify_checkpoint
    from conftest import load

    src = build_dense(tmp_path / "dense", tokenizer_dir, initializer_range=0.3, **QWEN3)
    plain = verify_checkpoint(_convert(src, tmp_path / "plain", method="gate-cluster"), against=src)
    assert plain.problems == [] and plain.max_logit_diff is not None and plain.max_logit_diff < 1e-4
    run_conversion(plan_conversion(src, build_config(experts=4, top_k=2, **CALIB)), tmp_path / "moe")
    assert verify_checkpoint(tmp_path / "moe", against=src).problems == []
    report = tune_output(src, tmp_path / "moe", TuneOptions(tokens=4096, generated=0.25, lr=0.02))
    run = report["tuning"]["runs"][0]
    assert run["holdout_kl_after"] < run["holdout_kl_before"]
    model, info = load(tmp_path / "moe")
    assert not info["missing_keys"] and type(model).__name__ == "Qwen3MoeForCausalLM"
    result = cli("inspect", tmp_path / "moe", "--dense", src, "--data", CALIB["calib"][0], "--max-tokens", "64",
                 "--no-plots", "--json", tmp_path / "i.json")
    assert result.exit_code == 0, result.stderr
    inspected = json.loads((tmp_path / "i.json").read_text())
    assert len(inspected["layers"]) == 3, inspected.keys()


def _convert(src, out, **flags):
    run_conversion(plan_conversion(src, build_config(experts=4, top_k=2, **flags)), out)
    return out


def test_qwen3_refusals(tmp_path, tokenizer_dir):
    src = build_dense(tmp_path / "dense", tokenizer_dir, **QWEN3)
    for fmt in ("mixtral", "qwen2_moe"):
        assert_refused(cli("convert", src, tmp_path / "o", "-n", "4", "-k", "2", "--format", fmt),
                       f"--format {fmt} cannot hold the q/k norms", "--format qwen3_moe")
    # a shared expert: the one-line reason and a layout with the same share active that Qwen3-MoE holds
    line = assert_refused(cli("convert", src, tmp_path / "o", "-n", "4", "-k", "2", "--shared", "2"),
                          "Qwen3-MoE", "has no shared expert", "--format qwen3_moe --shared 0")
    assert "67% active" in line  # (2 + 2) / (4 + 2)
    assert_refused(cli("convert", src, tmp_path / "o", "-n", "4", "-k", "2", "--shared", "2", "--format",
                       "qwen3_moe"), "--format qwen3_moe cannot hold shared experts")
    # llama.cpp's qwen3moe has experts in every layer: a dense layer is refused for that target, kept for the others
    assert_refused(cli("convert", src, tmp_path / "o", "-n", "4", "-k", "2", "--dense-layers", "1", "--target",
                       "llama.cpp"), "its qwen3moe has no dense", "--dense-layers")
    llama = build_dense(tmp_path / "llama", tokenizer_dir)
    assert_refused(cli("convert", llama, tmp_path / "o", "-n", "4", "-k", "2", "--format", "qwen3_moe"),
                   "--format qwen3_moe needs a Qwen3 source")
    sliding = build_dense(tmp_path / "sliding", tokenizer_dir, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1, **QWEN3)
    assert_refused(cli("convert", sliding, tmp_path / "o", "-n", "4", "-k", "2"), "use_sliding_window = true",
                   "Qwen3-MoE")
    assert not (tmp_path / "o").exists()


def test_a_preset_resolves_for_qwen3_without_a_shared_expert_and_says_so(tmp_path, tokenizer_dir):
    """The presets name a shared-expert Qwen2-MoE layout; a Qwen3 source gets the same active share without one
    (Qwen3-MoE has none), in Qwen3-MoE, with a note; --shared given keeps the refusal above."""
    src = build_dense(tmp_path / "dense", tokenizer_dir, **QWEN3)  # d_ff 96
    for preset, k, n in (("active-50", 16, 32), ("active-25", 12, 48)):  # 96 = 32 x 3 = 48 x 2
        result = cli("convert", src, tmp_path / preset, "--preset", preset, "--weight-only", "--json",
                     tmp_path / f"{preset}.json")
        assert result.exit_code == 0, result.output
        said = " ".join(result.output.split())
        assert (f"note: Qwen3-MoE (the one stock class with Qwen3's q/k norms) holds no shared expert: the preset's "
                f"{preset[-2:]}% active resolves without one, to top-{k} of {n} routed experts") in said
        config = json.loads((tmp_path / preset / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe" and config["num_experts"] == n
        assert config["num_experts_per_tok"] == k and not config.get("shared_expert_intermediate_size")


def test_the_same_share_layout_takes_a_quantizable_width():
    # Qwen3-8B's d_ff 12,288 at 50% and 25%: 32 experts of 384 (a multiple of 128), 64 of 192 (of 32)
    assert same_share_layout(12288, 0.5) == (32, 16)
    assert same_share_layout(12288, 0.25) == (64, 16)
    # a share no divisor reaches within 2 points still gives the nearest count
    n, k = same_share_layout(96, 0.5)
    assert k == 16 and 96 % n == 0


def test_the_tuning_students_block_computes_what_the_exported_qwen3_moe_block_computes(tmp_path, tokenizer_dir):
    """Qwen3-MoE renormalises its top-k weights (norm_topk_prob true): the student's MaskedMoE must too, or tuning
    would start from another model than the output it tunes. Top-2 of 4 with gate weights far from 1/k."""
    from test_tune import _masked_moe_from_output

    src = build_dense(tmp_path / "dense", tokenizer_dir, initializer_range=0.3, **QWEN3)
    student, moe = _masked_moe_from_output(tmp_path, src, "qwen3_moe")
    x = moe.model.layers[1].post_attention_layernorm(torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        got, ref = student(x), moe.model.layers[1].mlp(x)
    assert (got - ref).abs().max().item() <= 2e-3 * ref.abs().max().item(), (got - ref).abs().max()
