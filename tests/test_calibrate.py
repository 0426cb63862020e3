"""Layer-sequential calibration equals the full model; statistics against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from conftest import build_dense, load
from moeify.calibrate import LayerwiseModel, ffn_activations, neuron_stats
from moeify.checkpoint import CheckpointReader
from moeify.families import load_source


@pytest.mark.parametrize("kw", [dict(head_dim=24, rope_parameters={"rope_type": "llama3", "rope_theta": 5e4, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
                                dict(family="mistral", sliding_window=5)])
def test_layerwise_hidden_states_equal_full_model(tmp_path, kw):
    src_path = build_dense(tmp_path / "dense", **kw)
    src = load_source(src_path)
    tokens = torch.randint(0, 384, (5, 20), generator=torch.Generator().manual_seed(0))
    model, _ = load(src_path)
    with torch.no_grad():
        ref = model(tokens, output_hidden_states=True).hidden_states
    lw = LayerwiseModel(src, CheckpointReader(src_path), tokens, batch_size=2)
    assert torch.allclose(lw.hidden, ref[0], atol=1e-6)
    for i in range(src.n_layers):
        layer = lw.load_layer(i)
        h_mid, x = lw.attention(layer)
        with torch.no_grad():
            lw.advance(h_mid, layer.mlp(x))
        if i < src.n_layers - 1:  # the last entry of hidden_states is after the final norm
            assert torch.allclose(lw.hidden, ref[i + 1], atol=1e-5), i


def test_neuron_stats_hand_computed():
    act = torch.tensor([[3.0, -1.0, 0.5, 0.0],
                        [0.1, 2.0, -4.0, 1.0],
                        [1.0, 1.5, 0.0, -0.2]])
    s = neuron_stats(act, active_frac=0.5, n_sample=3)  # K_a = 2 of 4 neurons per token
    # token 0: {0,1}; token 1: {2,1}; token 2: {1,0}
    assert torch.allclose(s.rate, torch.tensor([2 / 3, 1.0, 1 / 3, 0.0]))
    assert torch.allclose(s.mean_abs, torch.tensor([4.1 / 3, 4.5 / 3, 4.5 / 3, 1.2 / 3]))
    assert s.pattern.shape == (4, 3) and s.pattern.sum().item() == 6
    assert torch.allclose(s.profile.sum(1), s.mean_abs * 3, rtol=1e-3)  # profiles are stored as float16


def test_ffn_activations_match_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=12, num_attention_heads=2, num_key_value_heads=2))
    x = torch.randn(5, 8)
    with torch.no_grad():
        act = ffn_activations(x, mlp.gate_proj.weight, mlp.up_proj.weight)
        assert torch.allclose(act @ mlp.down_proj.weight.T, mlp(x), atol=1e-6)
