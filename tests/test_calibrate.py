"""Layer-sequential calibration equals the full model; statistics against hand-computed values."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_dense, load
from moeify.carving.calibrate import LayerwiseModel, ffn_activations, neuron_stats
from moeify.formats.checkpoint import CheckpointReader
from moeify.formats.families import load_source


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


# ------------------------------------------------------------------------------ calibrated carving maths

from conftest import CORPUS, max_logit_diff  # noqa: E402
from moeify.carving.calibrate import NeuronStats  # noqa: E402
from moeify.carving.compensate import refit_down, routing_mask  # noqa: E402
from moeify.formats.config import build_config  # noqa: E402
from moeify.carving.conversion import plan_conversion, run_conversion  # noqa: E402
from moeify.errors import MoeifyError  # noqa: E402
from moeify.maths.partition import Partition, partition_from_stats  # noqa: E402
from moeify.maths.router import fit_router, topk_agreement  # noqa: E402


def test_partition_from_stats_shared_are_most_active_and_groups_coactive():
    # 12 neurons; neurons 0,1 always active (shared); the rest in 5 co-active pairs over 10 sample tokens
    pattern = torch.zeros(12, 10)
    pattern[0:2] = 1
    for pair in range(5):
        pattern[2 + 2 * pair: 4 + 2 * pair, 2 * pair: 2 * pair + 2] = 1
    stats = NeuronStats(rate=pattern.mean(1), mean_abs=pattern.mean(1), pattern=pattern, profile=pattern)
    for method in ("activation", "coactivation"):
        part = partition_from_stats(method, stats, n_experts=5, n_shared=2, seed=0)
        assert part.shared_neurons.tolist() == [0, 1]
        assert sorted(part.perm.tolist()) == list(range(12))
        groups = sorted(tuple(part.expert_neurons(e).tolist()) for e in range(5))
        assert groups == [(2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]


def test_shared_by_contribution_takes_the_largest_activation_times_down_norm():
    """shared_by = "contribution": the shared neurons are those with the largest mean |activation| x ||W_down[:, i]||,
    not the most often active: here neurons 0 and 1 fire always but write almost nothing, 6 and 9 carry the output."""
    pattern = torch.zeros(12, 10)
    pattern[0:2] = 1
    for pair in range(5):
        pattern[2 + 2 * pair: 4 + 2 * pair, 2 * pair: 2 * pair + 2] = 1
    stats = NeuronStats(rate=pattern.mean(1), mean_abs=pattern.mean(1), pattern=pattern, profile=pattern)
    norms = torch.ones(12)
    norms[0:2], norms[6], norms[9] = 0.01, 8.0, 9.0
    part = partition_from_stats("activation", stats, n_experts=5, n_shared=2, seed=0, down_norms=norms)
    assert part.shared_neurons.tolist() == [6, 9] and sorted(part.perm.tolist()) == list(range(12))
    assert partition_from_stats("activation", stats, n_experts=5, n_shared=2, seed=0).shared_neurons.tolist() == [0, 1]


def test_shared_by_contribution_all_experts_active_is_exact(tmp_path, calib_model):
    cfg = build_config(experts=3, top_k=3, shared=1, shared_by="contribution", gate_tolerance=1e-6, **CALIB)
    run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    assert max_logit_diff(calib_model, tmp_path / "moe") <= 1e-4
    assert 'shared_by = "contribution"' in (tmp_path / "moe" / "moeify.toml").read_text()  # the recipe repeats it
    with pytest.raises(MoeifyError, match="shared-by 'often' is not one of: rate, contribution"):
        build_config(experts=3, top_k=1, shared_by="often", **CALIB)


def test_fit_router_recovers_linear_norm_ranking():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 16, generator=gen)
    w = torch.randn(6, 16, generator=gen)
    norms = (x @ w.T).exp()  # ranking = ranking of a linear function of x
    router, info = fit_router(x, norms, k=2)
    assert router.shape == (6, 16)
    assert info["holdout_agreement"] > 0.9
    assert topk_agreement(x @ router.T, norms, 2) > 0.9
    assert topk_agreement(torch.randn(2000, 6, generator=gen), norms, 2) < 0.5  # chance is 1/3


def test_refit_down_exact_when_all_active_and_better_when_sparse():
    gen = torch.Generator().manual_seed(0)
    act = torch.randn(800, 12, generator=gen)
    down = torch.randn(5, 12, generator=gen)
    full = torch.ones_like(act, dtype=torch.bool)
    new, info = refit_down(act, full, down)
    assert torch.allclose(new, down, atol=1e-5)
    part = Partition(torch.arange(12), 0, 4, 3)
    mask = routing_mask(torch.randn(800, 4, generator=gen), part, k=2)
    assert mask.sum(1).eq(6).all()
    new, info = refit_down(act, mask, down)
    assert info["holdout_rel_error_after"] <= info["holdout_rel_error_before"]  # never worse on held-back tokens
    # correlated neurons (rank-3 activations): the kept neurons can stand in for the dropped ones
    low_rank = torch.randn(800, 3, generator=gen) @ torch.randn(3, 12, generator=gen)
    _, info = refit_down(low_rank, mask, down)
    assert info["holdout_rel_error_before"] > 0.1 and info["holdout_rel_error_after"] < 1e-3
    # matches a direct least-squares solution at small ridge (full-rank, correlated activations)
    act2 = low_rank + 0.1 * torch.randn(800, 12, generator=gen)
    z, y = act2 * mask, act2 @ down.T
    direct = torch.linalg.lstsq(z.double(), y.double()).solution.T.float()
    tiny, info = refit_down(act2, mask, down, strengths=(1e-9,))
    assert info["ridge"] == 1e-9
    assert torch.allclose(tiny, direct, atol=1e-3)


def test_routing_mask_shared_always_on():
    part = Partition(torch.tensor([5, 0, 1, 2, 3, 4]), n_shared=2, n_experts=2, expert_width=2)
    mask = routing_mask(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), part, k=1)
    # shared = perm[:2] = {5, 0}; expert 0 = {1, 2}; expert 1 = {3, 4}
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 2, 5]
    assert mask[1].nonzero().flatten().tolist() == [0, 3, 4, 5]


@pytest.fixture()
def calib_model(tmp_path, tokenizer_dir):
    return build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=4)


CALIB = dict(calib=[str(CORPUS)], calib_tokens=2048, calib_seq_len=64)


def test_calibrated_all_experts_active_is_exact(tmp_path, calib_model):
    """The calibrated default (with compensation) must leave the exactness guarantee intact: with every expert
    active there is nothing to compensate, so no down_proj is refit."""
    cfg = build_config(experts=3, top_k=3, shared=1, dense_layers="auto:1", gate_tolerance=1e-6, **CALIB)
    assert cfg.method == "activation" and cfg.router == "fitted" and cfg.compensate
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    assert sum(lay["dense"] for lay in report["layers"]) == 1
    assert not any(lay["compensated"] for lay in report["layers"] if not lay["dense"])
    assert max_logit_diff(calib_model, tmp_path / "moe") <= 1e-4


def test_calibrated_padded_all_experts_active_is_exact_at_default_tolerance(tmp_path, calib_model):
    """Calibrated carving (refit down_proj, fitted router) with experts zero-padded to 128 and default flags:
    k = N reproduces the dense logits (zero router) and verify accepts the padding."""
    from moeify.evaluation.verify import verify_checkpoint

    cfg = build_config(experts=4, top_k=4, shared=0, pad_experts_to=128, **CALIB)
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    assert report["padded_expert_width"] == 128 and all(lay["router_scale"] == 0.0 for lay in report["layers"])
    assert max_logit_diff(calib_model, tmp_path / "moe") <= 1e-5
    assert not verify_checkpoint(tmp_path / "moe", calib_model).problems


def test_stats_reuse_gives_identical_output(tmp_path, calib_model):
    cfg = build_config(experts=4, top_k=2, method="activation", **CALIB)
    run_conversion(plan_conversion(calib_model, cfg), tmp_path / "a")
    stats = tmp_path / "a" / "calibration" / "stats.safetensors"
    assert stats.is_file()
    cfg2 = build_config(experts=4, top_k=2, method="activation", stats=str(stats), **CALIB)
    run_conversion(plan_conversion(calib_model, cfg2), tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_calibration_keeps_one_layer_resident(tmp_path, calib_model, monkeypatch):
    """Memory does not grow with the number of layers: each decoder layer is freed before the next loads."""
    import gc
    import weakref

    alive = []
    original = LayerwiseModel.load_layer

    def tracking(self, idx):
        gc.collect()
        assert sum(r() is not None for r in alive) == 0, f"a previous layer is still resident when loading {idx}"
        layer = original(self, idx)
        alive.append(weakref.ref(layer))
        return layer

    monkeypatch.setattr(LayerwiseModel, "load_layer", tracking)
    cfg = build_config(experts=4, top_k=2, **CALIB)
    run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    assert len(alive) == 4


def test_calibrated_errors(tmp_path, calib_model):
    from moeify.errors import MoeifyError

    with pytest.raises(MoeifyError, match="--router fitted needs calibration data"):
        build_config(router="fitted")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(MoeifyError, match="empty"):
        run_conversion(plan_conversion(calib_model, build_config(calib=[str(empty)])), tmp_path / "o1")
    with pytest.raises(MoeifyError, match="fewer than --calib-tokens"):
        cfg = build_config(calib=[str(CORPUS)], calib_tokens=10_000_000, calib_seq_len=64)
        run_conversion(plan_conversion(calib_model, cfg), tmp_path / "o2")
    short = tmp_path / "short.txt"
    short.write_text("Only a few words of text.")
    with pytest.raises(MoeifyError) as info:  # shorter than one window: the hint must not say "at most 0"
        run_conversion(plan_conversion(calib_model, build_config(calib=[str(short)], calib_seq_len=64)), tmp_path / "o3")
    assert "shorter than one window of --calib-seq-len 64" in str(info.value) and "at most 0" not in str(info.value)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    assert not list(tmp_path.glob("*.moeify-partial"))


def _text_tokens(model_dir, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False, verbose=False)["input_ids"])


def test_default_calib_tokens_use_all_the_text_and_say_so(tmp_path, calib_model):
    """No --calib-tokens: every whole window of a text shorter than the 65,536 cap is used (not an error), the
    CLI and report.json say how many, and OUT/moeify.toml (calib_tokens = 0) is a preset that gives the same config."""
    import json

    from typer.testing import CliRunner

    from moeify.cli.app import app
    from moeify.formats.config import build_config, load_preset

    text = tmp_path / "calib.txt"
    text.write_text(CORPUS.read_text()[:6000])
    n_text = _text_tokens(calib_model, text.read_text())
    used = n_text // 64 * 64
    assert 64 < n_text < 65536 and used < n_text
    args = ["convert", str(calib_model), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2", "--calib", str(text),
            "--calib-seq-len", "64"]
    dry = CliRunner().invoke(app, args + ["--dry-run"])
    assert dry.exit_code == 0 and "all tokens, up to 65,536 of 1 file(s), windows of 64" in dry.output, dry.output
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (f"calibrated on {used:,} of the text's {n_text:,} tokens ({used // 64} windows of 64; "
            "default: all, up to 65,536)") in " ".join(result.output.split())
    calib = json.loads((tmp_path / "moe" / "report.json").read_text())["calibration"]
    assert calib["tokens"] == used and calib["text_tokens"] == n_text and calib["requested_tokens"] is None
    preset = tmp_path / "moe" / "moeify.toml"
    assert load_preset(preset)["calib_tokens"] == 0 and f"calib_tokens_used = {used}" in preset.read_text()
    assert build_config(preset) == build_config(experts=4, top_k=2, calib=[str(text)], calib_seq_len=64)


def test_default_calib_tokens_are_capped(tmp_path, calib_model, monkeypatch):
    """The default takes at most CALIB_TOKENS_CAP tokens (65,536; lowered here); an explicit count is honoured."""
    import moeify.formats.text as text
    import moeify.formats.config

    monkeypatch.setattr(moeify.formats.config, "CALIB_TOKENS_CAP", 1000)
    windows, n_text = text.calibration_tokens(calib_model, [CORPUS], 0, 64)
    assert windows.shape == (15, 64) and n_text > 1000
    windows, _ = text.calibration_tokens(calib_model, [CORPUS], 2048, 64)
    assert windows.shape == (32, 64)


def test_fewer_calibration_windows_than_the_text_are_spread_over_all_of_it(tmp_path, calib_model):
    """--calib-tokens below the text's length takes whole windows evenly spaced over the whole text (both files of
    a two-file --calib), not its head; all of them in order when the count is the text's."""
    from moeify.formats.text import calibration_tokens, encode_text, load_tokenizer, read_texts

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(CORPUS.read_text()[:6000])
    second.write_text(CORPUS.read_text()[-6000:])
    ids = torch.tensor(encode_text(load_tokenizer(calib_model), read_texts([first, second]), add_special_tokens=False))
    whole = ids[: len(ids) // 64 * 64].view(-1, 64)
    n_first = len(encode_text(load_tokenizer(calib_model), read_texts([first]), add_special_tokens=False)) // 64
    assert whole.shape[0] >= 8 and 2 <= n_first < whole.shape[0] - 2
    windows, n_text = calibration_tokens(calib_model, [first, second], 4 * 64, 64)
    picked = [int(i) for i in torch.arange(4) * whole.shape[0] // 4]
    assert n_text == len(ids) and torch.equal(windows, whole[picked])
    assert picked[0] == 0 and max(picked) > n_first  # the second file is read, not the first's head alone
    assert torch.equal(calibration_tokens(calib_model, [first, second], 0, 64)[0], whole)


def test_no_too_long_sequence_warning_when_tokenizing_long_text(tmp_path, calib_model):
    """transformers warns when a text is longer than the tokenizer's model_max_length; calibration and eval cut
    long texts into windows on purpose, so they silence that warning (and only that one)."""
    import json
    import logging

    from transformers import AutoTokenizer

    from moeify.formats.text import calibration_tokens
    from moeify.formats.text import load_tokenizer, tokenize

    cfg_file = calib_model / "tokenizer_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "model_max_length": 128}))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf = logging.getLogger("transformers")
    hf.addHandler(handler)
    try:
        AutoTokenizer.from_pretrained(calib_model)(CORPUS.read_text()[:4000])
        assert any(m.startswith("Token indices sequence length is longer") for m in seen), seen  # the test sees it
        seen.clear()
        windows, n_text = calibration_tokens(calib_model, [CORPUS], 0, 64)
        ids = tokenize(load_tokenizer(calib_model), CORPUS.read_text()[:4000])
        logging.getLogger("transformers.tokenization_utils_base").warning("another tokenizer warning")
    finally:
        hf.removeHandler(handler)
    assert n_text > 128 and len(ids) > 128
    assert seen == ["another tokenizer warning"]


def test_cli_calibrates_on_the_bundled_sample_by_default(tmp_path, calib_model):
    """Without --calib the command line carves calibrated (the best default) on the bundled sample and says so;
    --weight-only opts out; the two cannot be combined."""
    from typer.testing import CliRunner

    from moeify.cli.app import app
    from moeify.formats.config import BUNDLED_CALIB

    args = ["convert", str(calib_model), str(tmp_path / "moe"), "-n", "4", "-k", "2", "--calib-tokens", "1024",
            "--calib-seq-len", "64"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "of the bundled sample (--calib TEXT: your own; --weight-only: none)" in " ".join(result.output.split())
    report = json.loads((tmp_path / "moe" / "report.json").read_text())
    assert report["settings"]["calib"] == [str(BUNDLED_CALIB)] and report["settings"]["method"] == "activation"
    assert report["calibration"]["tokens"] == 1024 and all(lay["compensated"] for lay in report["layers"])
    weights = CliRunner().invoke(app, ["convert", str(calib_model), str(tmp_path / "w"), "-n", "4", "-k", "2",
                                       "--weight-only"])
    assert weights.exit_code == 0, weights.output
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    assert report["settings"]["calib"] == [] and report["settings"]["method"] == "gate-cluster"
    both = CliRunner().invoke(app, args[:3] + ["--weight-only", "--calib", str(BUNDLED_CALIB)])
    assert both.exit_code == 2 and "--weight-only and --calib contradict each other" in both.stderr


def test_calibration_without_tokenizer_files_names_them_and_offers_weight_only(tmp_path):
    """A checkpoint with weights and config but no tokenizer: the CLI's calibrated default fails with one line
    that says what is missing and offers --weight-only; --weight-only then converts."""
    from typer.testing import CliRunner

    from moeify.cli.app import app

    src = build_dense(tmp_path / "bare", None)  # no tokenizer files
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "o"), "--experts", "4", "--top-k", "2"])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "calibration needs the checkpoint's tokenizer files" in text and "--weight-only" in text
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("*.moeify-partial"))
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "o"), "--experts", "4", "--top-k", "2",
                                   "--weight-only"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("fmt,shared,experts", [("mixtral", 0, 8), ("qwen2_moe", 1, 7)])
def test_engines_ranking_probabilities_or_logits_pick_the_same_experts(tmp_path, calib_model, fmt, shared,
                                                                      experts):
    """transformers and llama.cpp rank experts by their float32 softmax probabilities, vLLM's CPU router and
    moeify's tuning by the router logits: where the logits of the k-th and (k+1)-th expert are closer than float32
    resolves in the probabilities they tie and torch.topk takes the lower index. The calibrated router scale is set
    from the logit spread on the calibration tokens (not the worst case over any input, which left real spreads
    ~1e-5 and a tenth of the token-layers tied on SmolLM2), so on fresh text both orders agree and every gate stays
    within the tolerance on the calibration tokens' spread."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "moe"
    cfg = build_config(experts=experts, top_k=2, format=fmt, shared=shared, **CALIB)
    run_conversion(plan_conversion(calib_model, cfg), out)
    report = json.loads((out / "report.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    logits: dict[int, list] = {}

    def keep(i):  # the router's logits from its input (its output is probabilities in some versions)
        return lambda mod, inp: logits.setdefault(i, []).append(
            (inp[0].reshape(-1, inp[0].shape[-1]) @ mod.weight.T).detach())

    hooks = [mod.register_forward_pre_hook(keep(int(name.split(".")[2]))) for name, mod in model.named_modules()
             if name.endswith(("mlp.gate", "block_sparse_moe.gate"))]
    ids = AutoTokenizer.from_pretrained(out)(CORPUS.read_text()[30000:50000], return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        for s in range(0, ids.shape[1], 64):  # fresh text: past the calibration tokens
            model(ids[:, s:s + 64])
    for h in hooks:
        h.remove()
    assert len(logits) >= 3
    for layer, chunks in logits.items():
        lg = torch.cat(chunks).float()
        by_logit = torch.zeros_like(lg, dtype=torch.bool).scatter_(1, lg.topk(2, 1).indices, True)
        by_prob = torch.zeros_like(lg, dtype=torch.bool).scatter_(1, lg.softmax(-1).topk(2, 1).indices, True)
        assert (by_logit != by_prob).any(1).float().mean().item() <= 0.01, layer  # (before: 1-2 in 10 tied)
        spread = (lg.max(1).values - lg.min(1).values)
        assert spread.median().item() >= 1e-4  # well above float32's resolution of a probability (~1e-7)
        assert spread.max().item() <= 3 * 1e-3  # fresh text: near the tolerance's spread (1e-3), not far past it
        entry = report["layers"][layer]  # calibration tokens: the widest spread is the tolerance, ties rare
        assert entry["router_spread"] == pytest.approx(cfg.gate_tolerance, rel=1e-5) and entry["routing_ties"] <= 0.005
