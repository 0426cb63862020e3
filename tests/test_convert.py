"""Exactness (all experts active == dense), round trip, multi-shard I/O, determinism."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from conftest import build_dense, load, max_logit_diff, read_json
from moeify.formats.checkpoint import CheckpointReader
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.formats.experts import unpermute_ffn
from moeify.maths.partition import Partition

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
EXACT = 1e-4


def convert(src, out, **flags):
    flags.setdefault("gate_tolerance", 1e-6)  # all experts active: near-exact unit gates
    cfg = build_config(**flags)
    return run_conversion(plan_conversion(src, cfg), out)


CASES = {
    "llama-gqa-headdim-llama3rope": dict(head_dim=24, rope_parameters=LLAMA3_ROPE),
    "llama-tied": dict(tie_word_embeddings=True),
    "mistral-sliding": dict(family="mistral", sliding_window=4),
}
TARGETS = {
    "mixtral": dict(format="mixtral"),
    "qwen2_moe-shared-dense": dict(format="qwen2_moe", shared=2, dense_layers="1"),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_all_experts_active_reproduces_dense_logits(tmp_path, tokenizer_dir, case, target):
    src = build_dense(tmp_path / "dense", tokenizer_dir, **CASES[case])
    convert(src, tmp_path / "moe", experts=4, top_k=4, method="gate-cluster", **TARGETS[target])
    diff = max_logit_diff(src, tmp_path / "moe", seq=24)
    assert diff <= EXACT, f"{case} -> {target}: max |logit diff| {diff:.3g}"


def test_sliding_window_matters_and_is_kept(tmp_path):
    """A wrong sliding window would change logits at seq > window: the exactness test above is sensitive to it."""
    src = build_dense(tmp_path / "dense", family="mistral", sliding_window=4)
    convert(src, tmp_path / "moe", experts=4, top_k=4)
    cfg = read_json(tmp_path / "moe" / "config.json")
    assert cfg["sliding_window"] == 4
    cfg["sliding_window"] = None
    (tmp_path / "moe" / "config.json").write_text(json.dumps(cfg))
    assert max_logit_diff(src, tmp_path / "moe", seq=24) > 1e-3


def test_legacy_rope_keys_in_source_and_output(tmp_path):
    """A source config with only legacy rope_theta/rope_scaling keys converts exactly; output carries both styles."""
    src = build_dense(tmp_path / "dense", rope_parameters=LLAMA3_ROPE)
    raw = read_json(src / "config.json")
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    (src / "config.json").write_text(json.dumps(raw))
    convert(src, tmp_path / "moe", experts=2, top_k=2)
    out = read_json(tmp_path / "moe" / "config.json")
    assert out["rope_parameters"]["rope_type"] == "llama3" and out["rope_theta"] == 50000.0
    assert out["rope_scaling"]["rope_type"] == "llama3" and out["rope_scaling"]["factor"] == 8.0
    assert max_logit_diff(src, tmp_path / "moe") <= EXACT


def test_untied_lm_head_copy_is_exact(tmp_path):
    src = build_dense(tmp_path / "dense", tie_word_embeddings=True)
    convert(src, tmp_path / "moe", experts=4, top_k=4, untie_embeddings=True)
    assert read_json(tmp_path / "moe" / "config.json")["tie_word_embeddings"] is False
    assert "lm_head.weight" in CheckpointReader(tmp_path / "moe").tensors
    assert max_logit_diff(src, tmp_path / "moe") <= EXACT


# down_proj × k (mixtral: top_k = 2) or × N (qwen2_moe, not renormalised: 4 experts) is exact for a power of two
@pytest.mark.parametrize("fmt,shared,experts", [("mixtral", 0, 3), ("qwen2_moe", 2, 4)])
def test_round_trip_unpermute_is_bit_exact(tmp_path, fmt, shared, experts):
    src = build_dense(tmp_path / "dense", dtype=torch.bfloat16)
    report = convert(src, tmp_path / "moe", experts=experts, top_k=2, shared=shared, format=fmt, method="gate-cluster")
    cfg = build_config(experts=experts, top_k=2, shared=shared, format=fmt)
    dense, moe = CheckpointReader(src), CheckpointReader(tmp_path / "moe")
    width = 96 // (experts + shared)
    for layer in report["layers"]:
        i = layer["layer"]
        part = Partition(torch.tensor(layer["perm"]), layer["shared_neurons"], experts, width)
        tensors = {n: moe.get(n) for n in moe.tensors if n.startswith(f"model.layers.{i}.")}
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        g, u, d = unpermute_ffn(tensors, part, fmt, i, cfg)
        p = f"model.layers.{i}.mlp."
        assert torch.equal(g, dense.get(p + "gate_proj.weight"))
        assert torch.equal(u, dense.get(p + "up_proj.weight"))
        assert torch.equal(d, dense.get(p + "down_proj.weight"))


def test_multi_shard_input_and_output(tmp_path, tokenizer_dir):
    src = build_dense(tmp_path / "dense", tokenizer_dir, max_shard_size="60KB")
    assert (src / "model.safetensors.index.json").is_file()
    assert len(list(src.glob("model-*.safetensors"))) > 2
    convert(src, tmp_path / "moe", experts=4, top_k=4, max_shard_size="50KB")
    out = tmp_path / "moe"
    shards = sorted(out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and shards[0].name == f"model-00001-of-{n:05d}.safetensors"
    index = read_json(out / "model.safetensors.index.json")
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    for s in shards:  # every shard within the cap, unless it holds a single larger tensor
        with safe_open(str(s), "pt") as f:
            keys = list(f.keys())
        assert s.stat().st_size <= 50_000 + 4096 or len(keys) == 1
    assert (out / "tokenizer.json").is_file()
    assert max_logit_diff(src, out) <= EXACT


def test_same_seed_same_bytes_different_seed_different_partition(tmp_path):
    src = build_dense(tmp_path / "dense")
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        convert(src, tmp_path / name, experts=4, top_k=2, method="random", seed=seed)
    a, b, c = (tmp_path / n / "model.safetensors" for n in "abc")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_provenance_files(tmp_path, tokenizer_dir):
    src = build_dense(tmp_path / "dense", tokenizer_dir)
    convert(src, tmp_path / "moe", experts=4, top_k=2, shared=0)
    out = tmp_path / "moe"
    toml = (out / "moeify.toml").read_text()
    assert 'method = "gate-cluster"' in toml and "experts = 4" in toml
    report = read_json(out / "report.json")
    assert len(report["layers"]) == 3
    layer = report["layers"][0]
    assert layer["expert_sizes"] == [24] * 4 and len(layer["perm_sha256"]) == 16
    assert sorted(layer["perm"]) == list(range(96))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"


def test_sparse_model_loads_and_runs_with_expected_config(tmp_path):
    src = build_dense(tmp_path / "dense", dtype=torch.bfloat16)
    convert(src, tmp_path / "moe", experts=4, top_k=2, gate_tolerance=1e-3)
    cfg = read_json(tmp_path / "moe" / "config.json")
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["intermediate_size"] == 24 and cfg["dtype"] == "bfloat16"
    model, info = load(tmp_path / "moe", dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    out = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(out).all()


def test_unaligned_expert_width_is_padded_exactly(tmp_path):
    """96 neurons / 16 experts = 6 per expert: padded with zero neurons to 8 so transformers' default
    grouped_mm kernel (16-byte rows) runs; zero neurons add nothing, so logits stay exact."""
    src = build_dense(tmp_path / "dense", dtype=torch.bfloat16)
    report = convert(src, tmp_path / "moe", experts=16, top_k=16)
    cfg = read_json(tmp_path / "moe" / "config.json")
    assert cfg["intermediate_size"] == 8 and report["expert_width"] == 6 and report["padded_expert_width"] == 8
    moe = CheckpointReader(tmp_path / "moe")
    w1 = moe.get("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    assert w1.shape == (8, 64) and torch.equal(w1[6:], torch.zeros(2, 64, dtype=torch.bfloat16))
    dense, sparse = load(src, dtype=torch.bfloat16)[0], load(tmp_path / "moe", dtype=torch.bfloat16)[0]
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # runs on the default experts implementation
        assert (dense(ids).logits.float() - sparse(ids).logits.float()).abs().max() < 0.1
    layer = report["layers"][1]
    part = Partition(torch.tensor(layer["perm"]), 0, 16, 6)
    tensors = {n: moe.get(n) for n in moe.tensors if n.startswith("model.layers.1.")}
    g, u, d = unpermute_ffn(tensors, part, "mixtral", 1, build_config(experts=16, top_k=16))
    assert torch.equal(d, CheckpointReader(src).get("model.layers.1.mlp.down_proj.weight"))
    assert torch.equal(g, CheckpointReader(src).get("model.layers.1.mlp.gate_proj.weight"))
    assert max_logit_diff(src, tmp_path / "moe") < 0.05  # bf16 weights upcast: k=16 scaling is exact


@pytest.mark.parametrize("target", TARGETS)
def test_all_experts_active_with_default_flags_is_exact(tmp_path, target):
    """top_k == experts: the router order does not matter, so moeify writes a zero router (every gate exactly 1/N)
    and the default --gate-tolerance (1e-3, which bounds the gates of sparse conversions) costs no exactness."""
    from moeify.evaluation.verify import verify_checkpoint

    src = build_dense(tmp_path / "dense")
    flags = dict(experts=4, top_k=4, **TARGETS[target])
    report = run_conversion(plan_conversion(src, build_config(**flags)), tmp_path / "moe")
    assert build_config(**flags).gate_tolerance == 1e-3
    moe = CheckpointReader(tmp_path / "moe")
    routers = [n for n in moe.tensors if n.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight"))]
    assert routers and all(moe.get(n).count_nonzero() == 0 for n in routers)
    assert all(layer["router_scale"] == 0.0 for layer in report["layers"] if not layer["dense"])
    assert max_logit_diff(src, tmp_path / "moe") <= 1e-5
    result = verify_checkpoint(tmp_path / "moe", src)
    assert not result.problems and result.max_logit_diff <= 1e-5


def test_sparse_conversion_keeps_a_scaled_router(tmp_path):
    """top_k < experts: the router is the carved router times the unit-gate scale (not zero)."""
    src = build_dense(tmp_path / "dense")
    report = run_conversion(plan_conversion(src, build_config(experts=4, top_k=2)), tmp_path / "moe")
    assert all(0 < layer["router_scale"] < 1 for layer in report["layers"])
    moe = CheckpointReader(tmp_path / "moe")
    assert moe.get("model.layers.0.block_sparse_moe.gate.weight").count_nonzero() > 0


@pytest.mark.parametrize("fmt,shared", [("mixtral", 0), ("qwen2_moe", 1)])
def test_pad_experts_to_128_is_exact_and_verifies(tmp_path, fmt, shared):
    """--pad-experts-to 128: 96 / 4 = 24 neurons per expert stored as 128 (zero gate/up rows, zero down columns);
    loads with no missing/unexpected keys, reproduces the dense logits at k = N, and `moeify verify` accepts it."""
    from moeify.evaluation.verify import verify_checkpoint

    src = build_dense(tmp_path / "dense")
    flags = dict(experts=3 if shared else 4, top_k=3 if shared else 4, shared=shared, format=fmt, pad_experts_to=128)
    report = run_conversion(plan_conversion(src, build_config(**flags)), tmp_path / "moe")
    cfg = read_json(tmp_path / "moe" / "config.json")
    assert cfg["intermediate_size" if fmt == "mixtral" else "moe_intermediate_size"] == 128
    assert report["expert_width"] == 24 and report["padded_expert_width"] == 128
    moe = CheckpointReader(tmp_path / "moe")
    name = ("model.layers.0.block_sparse_moe.experts.1.w{}.weight" if fmt == "mixtral"
            else "model.layers.0.mlp.experts.1.{}_proj.weight")
    gate, down = (moe.get(name.format(n)) for n in (("1", "2") if fmt == "mixtral" else ("gate", "down")))
    assert gate.shape == (128, 64) and down.shape == (64, 128)
    assert gate[24:].count_nonzero() == 0 and down[:, 24:].count_nonzero() == 0 and gate[:24].count_nonzero() > 0
    if shared:  # the shared expert is not padded
        assert moe.get("model.layers.0.mlp.shared_expert.up_proj.weight").shape == (24, 64)
    assert max_logit_diff(src, tmp_path / "moe") <= 1e-5  # also: no missing/unexpected keys
    result = verify_checkpoint(tmp_path / "moe", src)
    assert not result.problems, result.problems
    toml = (tmp_path / "moe" / "moeify.toml").read_text()
    assert "pad_experts_to = 128" in toml and build_config(tmp_path / "moe" / "moeify.toml").pad_experts_to == 128


def test_pad_experts_to_must_be_a_multiple_of_8():
    from moeify.errors import MoeifyError

    for bad in (0, 100, -8):
        with pytest.raises(MoeifyError, match=f"--pad-experts-to must be a positive multiple of 8, got {bad}"):
            build_config(pad_experts_to=bad)


def test_qwen2_moe_output_means_the_same_to_llamacpp(tmp_path, monkeypatch):
    """llama.cpp's qwen2moe graph (every version through the one in llama-cpp-python 0.3.36) never renormalises the
    top-k weights, whatever norm_topk_prob says, and computes the shared-expert gate's sigmoid as silu(z)/z, which is
    NaN at z = 0. The Qwen2-MoE output must give the same logits under those semantics as under transformers' (it
    gave NaN, and with top_k < N every routed expert scaled by k/N, when it wrote norm_topk_prob true and a zero gate)."""
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    from moeify.maths.router import SHARED_GATE_MIN

    src = build_dense(tmp_path / "dense")
    report = convert(src, tmp_path / "moe", experts=4, top_k=2, shared=2, format="qwen2_moe", gate_tolerance=1e-3)
    assert read_json(tmp_path / "moe" / "config.json")["norm_topk_prob"] is False
    gate = CheckpointReader(tmp_path / "moe").get("model.layers.0.mlp.shared_expert_gate.weight")
    c = report["layers"][0]["shared_gate"]
    assert torch.equal(gate, torch.full_like(gate, c)) and c >= SHARED_GATE_MIN and math.log2(c).is_integer()
    assert torch.tensor(c, dtype=torch.float16).item() == c  # survives a float16 GGUF
    model = load(tmp_path / "moe")[0]
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        for module in model.modules():  # llama.cpp: no renormalisation, sigmoid(z) = silu(z) / z
            if hasattr(module, "norm_topk_prob"):
                module.norm_topk_prob = False
        monkeypatch.setattr(modeling_qwen2_moe.F, "sigmoid", lambda z: torch.nn.functional.silu(z) / z)
        got = model(ids).logits
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
