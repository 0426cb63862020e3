"""`moeify inspect`: the maths on hand-made cases, and on tiny converted models where the answer is known
(identical experts -> similarity 1; router rows = mean gate rows -> R² = 1; a zero W_gate -> no active neurons)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from conftest import build_dense, corpus_text
from moeify.evaluation.analysis import (capture_moe_inputs, cosine_matrix, expert_dynamics, linear_fit, live_neurons, lower_pairs,
                             neuron_mean, rank_counts, run_inspect, static_analysis)
from moeify.formats.checkpoint import CheckpointReader
from moeify.cli.app import app
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

# ----------------------------------------------------------------------------------------------------- pure maths


def test_cosine_matrix_known_values():
    v = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [0.0, 0.0]])
    c = cosine_matrix(v)
    assert c.dtype == torch.float64
    assert c[0, 1] == pytest.approx(1.0)  # scale invariant
    assert c[0, 2] == pytest.approx(0.0)
    assert c[0, 3] == pytest.approx(-1.0)
    assert torch.all(c[4] == 0) and torch.all(c[:, 4] == 0)  # a zero vector is similar to nothing
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.normalize(x.double(), dim=1) @ torch.nn.functional.normalize(x.double(), dim=1).T
    assert torch.allclose(cosine_matrix(x, chunk=7), expected, atol=1e-12)  # chunked accumulation


def test_neuron_mean_rows_for_up_gate_columns_for_down():
    w = torch.arange(6.0).reshape(2, 3)
    assert neuron_mean(w, "gate").tolist() == [1.5, 2.5, 3.5]
    assert neuron_mean(w, "up").tolist() == [1.5, 2.5, 3.5]
    assert neuron_mean(w, "down").tolist() == [1.0, 4.0]


def test_lower_pairs_each_pair_once():
    m = torch.arange(16.0).reshape(4, 4)
    assert lower_pairs(m).tolist() == [4.0, 8.0, 9.0, 12.0, 13.0, 14.0]


def test_linear_fit_known_cases():
    x = torch.tensor([0.1, 0.5, -0.3, 0.9])
    fit = linear_fit(x, 2 * x + 1)
    assert fit.r2 == pytest.approx(1.0) and fit.slope == pytest.approx(2.0) and fit.intercept == pytest.approx(1.0)
    assert linear_fit(x, -x).r == pytest.approx(-1.0)
    assert linear_fit(x, torch.full_like(x, 0.3)) is None  # constant y
    assert linear_fit(torch.ones(4), x) is None  # constant x
    assert linear_fit(x[:2], x[:2]) is None  # too few pairs (2 experts give 1 pair)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    r = np.corrcoef(a.numpy(), (a + b).numpy())[0, 1]
    assert linear_fit(a, a + b).r2 == pytest.approx(r * r, rel=1e-9)


def test_rank_counts_by_hand():
    norms = torch.tensor([[3.0, 1.0, 2.0], [1.0, 2.0, 3.0]])
    scores = torch.tensor([[0.5, 0.2, 0.3], [0.6, 0.3, 0.1]])
    # token 0: norm order 0,2,1 = score order -> diagonal; token 1: norm ranks (2,1,0), score ranks (0,1,2)
    counts = rank_counts(norms, scores)
    assert counts.tolist() == [[1, 0, 1], [0, 2, 0], [1, 0, 1]]
    assert counts.sum(1).tolist() == [2, 2, 2]


def test_live_neurons_skips_zero_padding():
    g, u, d = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    g[6:], u[6:], d[:, 6:] = 0, 0, 0
    assert live_neurons(g, u, d).tolist() == [True] * 6 + [False] * 2


# ------------------------------------------------------------------------------------------ on converted models


def _convert(src, out, **flags):
    flags.setdefault("method", "gate-cluster")
    run_conversion(plan_conversion(src, build_config(**flags)), out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("inspect")
    dense = build_dense(root / "dense", tokenizer_dir)
    mixtral = _convert(dense, root / "mixtral", experts=4, top_k=2, format="mixtral")
    qwen = _convert(dense, root / "qwen", experts=4, top_k=2, shared=2, dense_layers="1", format="qwen2_moe")
    text = root / "text.txt"
    text.write_text(corpus_text(4000))
    return {"root": root, "dense": dense, "mixtral": mixtral, "qwen": qwen, "text": text}


def _edit(src, dst, fn):
    """Copy a single-file checkpoint and rewrite some tensors: fn(tensors) mutates the dict."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


MIX = "model.layers.{L}.block_sparse_moe."


def test_identical_experts_have_similarity_one(models, tmp_path):
    def same(t):
        p = MIX.format(L=0)
        for e in range(1, 4):
            for w in ("w1", "w2", "w3"):
                t[f"{p}experts.{e}.{w}.weight"] = t[f"{p}experts.0.{w}.weight"].clone()

    out = _edit(models["mixtral"], tmp_path / "same", same)
    res = static_analysis(out)
    layer0, layer2 = res["layers"][0], res["layers"][2]
    for level in ("matrix", "neuron"):
        for kind in ("up", "gate", "down"):
            assert np.allclose(layer0[level][kind], 1.0, atol=1e-9), (level, kind)
            assert layer0["mean_expert_similarity"][level][kind] == pytest.approx(1.0)
    assert layer2["mean_expert_similarity"]["matrix"]["gate"] < 0.5  # untouched layers: distinct experts
    # identical experts give a constant Y: the router regression is undefined there, not a fake number
    assert layer0["router_fit"]["gate"] is None


def test_router_rows_equal_to_mean_gate_rows_give_r2_one(models, tmp_path):
    def mean_gate_router(t):
        for layer in range(3):
            p = MIX.format(L=layer)
            rows = [t[f"{p}experts.{e}.w1.weight"].float().mean(0) for e in range(4)]
            t[p + "gate.weight"] = torch.stack(rows) * 1e-3  # any positive scale: cosine is scale invariant

    out = _edit(models["mixtral"], tmp_path / "meangate", mean_gate_router)
    res = static_analysis(out)
    for entry in res["layers"]:
        fit = entry["router_fit"]["gate"]
        assert fit["r2"] == pytest.approx(1.0, abs=1e-9) and fit["slope"] == pytest.approx(1.0, abs=1e-6)
        assert np.allclose(entry["router"], entry["neuron"]["gate"], atol=1e-9)
    assert res["router_r2_avg"]["gate"] == pytest.approx(1.0, abs=1e-9)


def test_router_fit_matches_a_hand_computation(models):
    res = static_analysis(models["mixtral"], layers="1")
    entry = res["layers"][0]
    reader = CheckpointReader(models["mixtral"])
    p = MIX.format(L=1)
    router = reader.get(p + "gate.weight").double()
    means = torch.stack([reader.get(f"{p}experts.{e}.w1.weight").double().mean(0) for e in range(4)])
    x = torch.nn.functional.normalize(router, dim=1) @ torch.nn.functional.normalize(router, dim=1).T
    y = torch.nn.functional.normalize(means, dim=1) @ torch.nn.functional.normalize(means, dim=1).T
    i, j = np.tril_indices(4, -1)
    r = np.corrcoef(x.numpy()[i, j], y.numpy()[i, j])[0, 1]
    assert entry["router_fit"]["gate"]["r2"] == pytest.approx(r * r, rel=1e-9)


def test_dense_row(models, tmp_path):
    # one expert holding every neuron in order: the expert *is* the dense FFN, at matrix and neuron level
    whole = _convert(models["dense"], tmp_path / "whole", experts=1, top_k=1, method="contiguous", format="mixtral")
    res = static_analysis(whole, dense=models["dense"])
    for entry in res["layers"]:
        assert entry["matrix_labels"] == entry["neuron_labels"] == ["0", "F"]
        for level in ("matrix", "neuron"):
            for kind in ("up", "gate", "down"):
                assert np.allclose(entry[level][kind], 1.0, atol=1e-9), (level, kind)
    # four experts: flattened matrices cannot be compared with the wider dense FFN, averaged neurons can:
    # the dense average neuron is the mean of the experts' average neurons (equal widths)
    res = static_analysis(models["mixtral"], dense=models["dense"])
    reader = CheckpointReader(models["mixtral"])
    for entry in res["layers"]:
        p = MIX.format(L=entry["layer"])
        assert entry["matrix_labels"] == ["0", "1", "2", "3"] and entry["neuron_labels"][-1] == "F"
        assert entry["mean_dense_similarity"]["matrix"]["gate"] is None
        means = torch.stack([reader.get(f"{p}experts.{e}.w1.weight").double().mean(0) for e in range(4)])
        expected = torch.nn.functional.cosine_similarity(means.mean(0, keepdim=True), means, dim=1)
        assert np.allclose(entry["neuron"]["gate"][4][:4], expected.numpy(), atol=1e-9)


def test_qwen2_moe_skips_dense_layers_and_shared_expert(models):
    res = static_analysis(models["qwen"])
    assert res["format"] == "qwen2_moe" and res["moe_layers"] == [0, 2]
    assert [e["layer"] for e in res["layers"]] == [0, 2]
    assert all(len(e["matrix"]["gate"]) == 4 for e in res["layers"])  # routed experts only
    with pytest.raises(MoeifyError, match="not an MoE layer"):
        static_analysis(models["qwen"], layers="1")


@pytest.mark.parametrize("which", ["mixtral", "qwen"])
def test_recomputed_experts_match_the_model(models, which):
    """The analysis re-runs every expert on the captured block input; its routed sum must be what the block computed."""
    from transformers import AutoModelForCausalLM
    from transformers.activations import ACT2FN

    path = models[which]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layer = 0
    captured = {}
    mlp = model.model.layers[layer].mlp
    h1 = mlp.register_forward_hook(lambda m, a, o: captured.update(out=o[0] if isinstance(o, tuple) else o))
    h2 = mlp.gate.register_forward_hook(lambda m, a, o: captured.update(gate=o))
    ids = torch.randint(0, 384, (1, 20), generator=torch.Generator().manual_seed(0))
    x = capture_moe_inputs(model, (layer,), ids)[layer]
    h1.remove(), h2.remove()
    reader = CheckpointReader(path)
    if which == "mixtral":
        p = MIX.format(L=layer)
        experts = [tuple(reader.get(f"{p}experts.{e}.{w}.weight") for w in ("w1", "w3", "w2")) for e in range(4)]
    else:
        p = f"model.layers.{layer}.mlp."
        experts = [tuple(reader.get(f"{p}experts.{e}.{w}_proj.weight") for w in ("gate", "up", "down")) for e in range(4)]
    renorm = which == "mixtral" or model.config.norm_topk_prob  # moeify's qwen2_moe: false (as llama.cpp computes)
    dyn = expert_dynamics(x, reader.get(p + "gate.weight"), experts, 2, ACT2FN["silu"], renormalize=renorm)
    _, model_w, model_i = captured["gate"]
    assert torch.equal(dyn["top_k_index"], model_i)
    assert torch.allclose(dyn["top_k_weight"], model_w, atol=1e-6)
    routed = dyn["routed_output"]
    if which == "qwen":  # add the always-on shared expert, as the block does
        s = mlp.shared_expert(x) * torch.sigmoid(mlp.shared_expert_gate(x))
        routed = routed + s
    assert torch.allclose(routed, captured["out"].reshape(-1, x.shape[-1]), atol=1e-5)


def test_data_analyses(models, tmp_path):
    def silence_expert_0(t):
        t[MIX.format(L=0) + "experts.0.w1.weight"].zero_()  # act(0 · x) = silu(0) = 0 for every neuron

    out = _edit(models["mixtral"], tmp_path / "silent", silence_expert_0)
    res = run_inspect(out, data=models["text"], max_tokens=40, out_dir=tmp_path / "report", plots=False)
    data = res["data"]
    assert data["n_tokens"] == 40 and len(data["tokens"]) == 40
    for entry in data["layers"]:
        assert len(entry["top_k_index"]) == 40 and all(len(r) == 2 for r in entry["top_k_index"])
        counts = np.asarray(entry["norm_score_rank_counts"])
        assert counts.shape == (4, 4) and (counts.sum(1) == 40).all() and (counts.sum(0) == 40).all()
        assert sum(entry["selection_share"]) == pytest.approx(2.0)  # each token picks k = 2 experts
        assert all(np.allclose(sum(w), 1.0) for w in entry["top_k_weight"])
        assert 0 <= entry["top1_norm_is_top1_score"] <= 1 and 0 <= entry["topk_norm_overlap"] <= 1
    layer0 = data["layers"][0]
    assert layer0["active_share"][0] == 0.0  # the silenced expert
    assert min(layer0["active_share"][1:]) > 0.9  # SiLU: almost every neuron has |act| > 1e-3 (paper: 99.6%)
    assert layer0["output_norms_mean"][0] == 0.0
    saved = json.loads((tmp_path / "report" / "inspect.json").read_text())
    assert saved["data"]["layers"][0]["active_share"][0] == 0.0


def test_zero_padding_is_not_counted_as_inactive(models, tmp_path):
    # 96 neurons / 16 experts = 6 per expert, padded with 2 zero neurons to 8
    padded = _convert(models["dense"], tmp_path / "padded", experts=16, top_k=2, format="mixtral")
    assert json.loads((padded / "config.json").read_text())["intermediate_size"] == 8
    res = run_inspect(padded, data=models["text"], max_tokens=24, layers="0", out_dir=tmp_path / "r", plots=False)
    assert min(res["data"]["layers"][0]["active_share"]) > 0.9  # would be ≤ 0.75 if padding counted


def test_cli_writes_json_and_pngs(models, tmp_path):
    out_dir = tmp_path / "report"
    res = CliRunner().invoke(app, ["inspect", str(models["mixtral"]), "--dense", str(models["dense"]),
                                   "--data", str(models["text"]), "--max-tokens", "32", "-o", str(out_dir)])
    assert res.exit_code == 0, res.output
    assert "R²_avg" in res.output and "top-k overlap" in res.output
    saved = json.loads((out_dir / "inspect.json").read_text())
    assert [e["layer"] for e in saved["layers"]] == [0, 1, 2] and saved["dense"] == str(models["dense"])
    if HAVE_MPL:
        names = {p.name for p in out_dir.glob("*.png")}
        assert {"weights_layer000.png", "router_r2.png", "routing_layer002.png", "norm_vs_score.png",
                "active_share.png"} <= names
        assert all((out_dir / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    else:
        assert "no PNGs" in res.output


def test_default_output_dir_is_inside_the_checkpoint(models, tmp_path):
    ckpt = shutil.copytree(models["mixtral"], tmp_path / "ckpt")
    res = CliRunner().invoke(app, ["inspect", str(ckpt), "--no-plots", "--layers", "0,2"])
    assert res.exit_code == 0, res.output
    saved = json.loads((ckpt / "inspect" / "inspect.json").read_text())
    assert [e["layer"] for e in saved["layers"]] == [0, 2] and saved["plots"] == []
    res = CliRunner().invoke(app, ["inspect", str(ckpt), "--no-plots", "--layers", "0", "--json", "-"])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)  # --json -: the JSON alone on stdout, the tables on stderr
    assert [e["layer"] for e in printed["layers"]] == [0] and "R²_avg" in res.stderr


@pytest.mark.parametrize("args,message", [
    (["{dense}"], "cannot be inspected"),
    (["{mixtral}", "--layers", "7"], "--layers 7 is not an MoE layer"),
    (["{mixtral}", "--layers", "a,b"], "not a comma-separated list"),
    (["{mixtral}", "--data", "{root}/missing.txt"], "missing.txt not found"),
    (["{mixtral}", "--data", "{text}", "--max-tokens", "1"], "--max-tokens must be ≥ 2"),
    (["{mixtral}", "--dense", "{qwen}"], "already a Mixture-of-Experts"),
])
def test_cli_errors(models, tmp_path, args, message):
    args = [a.format(**models) for a in args]
    res = CliRunner().invoke(app, ["inspect", *args, "-o", str(tmp_path / "r"), "--no-plots"])
    assert res.exit_code == 2, res.output
    assert message in res.output
