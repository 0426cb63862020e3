"""`moeify upcycle`: exact at initialisation in each class under its own top-k routing, the symmetry breaking said and
measured, refusals before any work, nothing half-written, and `verify --against` knowing the layout."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_dense, load, max_logit_diff, read_json, rewrite
from typer.testing import CliRunner

import moeify
from moeify.cli.app import app
from moeify.errors import MoeifyError
from moeify.upcycling.upcycle import UpcycleSettings, plan_upcycle, run_upcycle
from moeify.evaluation.verify import verify_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
EXACT = 1e-4

CASES = {  # source -> layout: every class, full width and fine-grained, with and without a shared expert
    "llama-llama3rope-tied-E4k2": (dict(head_dim=24, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
                                   dict(copies=4, top_k=2)),
    "llama-E2G4k4-permute": (dict(), dict(copies=2, granularity=4, top_k=4, symmetry="permute")),
    "llama-shared-qwen2moe": (dict(), dict(copies=4, granularity=2, top_k=2, shared_width=32)),
    "mistral-sliding-E3k2": (dict(family="mistral", sliding_window=5), dict(copies=3, top_k=2)),
    "qwen2-biases-E4k2": (dict(family="qwen2"), dict(copies=4, top_k=2)),
    "qwen3-qknorm-E4G2k4": (dict(family="qwen3"), dict(copies=4, granularity=2, top_k=4, symmetry="permute")),
}


def upcycle(src, out, **kw):
    kw.setdefault("symmetry", "none")
    return run_upcycle(plan_upcycle(src, UpcycleSettings(**kw)), out)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("case", CASES)
def test_upcycle_reproduces_dense_logits_under_the_class_routing(tmp_path, case):
    source_kw, layout = CASES[case]
    src = build_dense(tmp_path / "dense", **source_kw)
    report = upcycle(src, tmp_path / "moe", **layout)
    cfg = read_json(tmp_path / "moe" / "config.json")
    assert cfg["num_experts_per_tok"] == layout["top_k"] < (cfg.get("num_local_experts") or cfg["num_experts"])
    assert cfg.get("norm_topk_prob", True) is True  # renormalised top-k: whole copies sum to the FFN
    diff = max_logit_diff(src, tmp_path / "moe", seq=24)  # transformers, its own top-k routing (not all experts)
    assert diff <= EXACT, f"{case}: max |logit diff| {diff:.3g}"
    # exact as written: its KL measured on random tokens is float32's rounding (|KL| < 1e-6; printed "< 1e-8")
    assert report["check"]["max_logit_diff"] <= EXACT and abs(report["check"]["kl_to_source"]) < 1e-6
    assert report["check"]["tokens_from"] == "random"
    result = verify_checkpoint(tmp_path / "moe", src)
    assert result.ok and result.max_logit_diff <= EXACT, result.problems


def test_a_bfloat16_output_of_a_float32_source_is_checked_against_the_source_as_bfloat16_holds_it(tmp_path):
    src = build_dense(tmp_path / "dense")
    report = upcycle(src, tmp_path / "moe", copies=4, granularity=2, top_k=4, dtype="bfloat16")
    assert report["output_dtype"] == "bfloat16" and report["check"]["max_logit_diff"] <= EXACT
    result = verify_checkpoint(tmp_path / "moe", src)
    assert result.ok and result.max_logit_diff <= EXACT, result.problems


def test_the_check_and_verify_see_a_lost_rope_setting(tmp_path):
    """The streamed check builds each model from its own config: a lost rope scaling shows as a logit difference."""
    src = build_dense(tmp_path / "dense", rope_parameters=LLAMA3_ROPE)
    upcycle(src, tmp_path / "moe", copies=2, top_k=1)
    cfg = read_json(tmp_path / "moe" / "config.json")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    cfg["rope_scaling"] = None
    (tmp_path / "moe" / "config.json").write_text(json.dumps(cfg))
    result = verify_checkpoint(tmp_path / "moe", src)
    assert not result.ok and "logits with the routing as written differ" in result.problems[-1]


def test_drop_upcycling_breaks_exactness_on_purpose_and_says_by_how_much(tmp_path, tokenizer_dir):
    src = build_dense(tmp_path / "dense", tokenizer_dir)
    report = moeify.upcycle(src, tmp_path / "moe", copies=4, top_k=2, symmetry="drop", drop_share=0.5)
    check = report["check"]
    assert check["exact_model"] == "the copies before symmetry breaking" and check["max_logit_diff"] <= EXACT
    assert check["kl_to_source"] > 1e-3 and check["kl_text_tokens"] >= 64  # on the bundled sample
    drawn = [n for layer in report["layers"] for n in layer["reinitialised_neurons"]]
    assert drawn == [48] * 12  # half of each of the 4 experts' 96 neurons, in every layer
    assert max_logit_diff(src, tmp_path / "moe", seq=24) > 1e-2
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "Drop-Upcycling: 50% of each expert's neurons" in card and f"{check['kl_to_source']:.4g} nats" in card
    assert "learning rate reset to the source's pretraining peak" in card
    result = verify_checkpoint(tmp_path / "moe", src)
    assert result.ok, result.problems
    assert any("made to differ on purpose" in s for s in result.skipped)
    again = moeify.upcycle(src, tmp_path / "again", copies=4, top_k=2, symmetry="drop")  # deterministic in the seed
    assert again["check"]["kl_to_source"] == check["kl_to_source"]


def test_the_check_is_one_pass_over_the_text_and_a_copy_of_the_source_needs_one_stack(tmp_path, tokenizer_dir,
                                                                                      monkeypatch):
    """The end-of-run check streams the source, the model as written and (when the two differ) the exact construction
    side by side, a decoder layer of each at a time, once, on the same tokens: the KL and the exactness come from one
    pass. A merge of the base with itself is the exact construction as written: one MoE stack, on random tokens (its
    KL is bounded by its logit difference)."""
    import moeify.upcycling.check as check_module

    passes, real = [], check_module.stream_hidden

    def counted(stacks, ids, progress=None):
        passes.append((len(stacks), tuple(ids.shape)))
        return real(stacks, ids, progress)

    monkeypatch.setattr(check_module, "stream_hidden", counted)
    src = build_dense(tmp_path / "dense", tokenizer_dir)
    check = moeify.upcycle(src, tmp_path / "moe", copies=4, top_k=2, symmetry="drop")["check"]
    assert len(passes) == 1 and passes[0][0] == 3 and passes[0][1][0] * passes[0][1][1] == check["kl_text_tokens"]
    assert check["exact_model"] == "the copies before symmetry breaking" and check["max_logit_diff"] <= EXACT
    assert check["tokens"] == check["kl_text_tokens"] and "exact_tokens" not in check
    passes.clear()
    merged = moeify.merge([src, src, src], tmp_path / "merged", top_k=2)["check"]
    assert [n for n, _ in passes] == [2] and merged["exact_model"] == "as written: every expert the base's FFN"
    assert merged["max_logit_diff"] <= EXACT and abs(merged["kl_to_source"]) < 1e-6  # float32 rounding
    # exact as written: 64 random tokens show both numbers (no tokenizer loaded), the KL measured on them
    assert merged["tokens_from"] == "random" and merged["tokens"] == 64 < check["tokens"]
    assert "kl_text_tokens" not in merged


def test_a_large_output_is_checked_from_regenerated_experts_with_the_same_result(tmp_path, monkeypatch):
    src = build_dense(tmp_path / "dense")
    read = upcycle(src, tmp_path / "read", copies=4, top_k=2, symmetry="noise")["check"]
    monkeypatch.setattr("moeify.upcycling.check.READ_BACK_BYTES", 0)
    regen = upcycle(src, tmp_path / "regen", copies=4, top_k=2, symmetry="noise")["check"]
    assert read["experts_read_back"] and not regen["experts_read_back"]
    assert regen["kl_to_source"] == pytest.approx(read["kl_to_source"], rel=1e-5)


def test_the_check_holds_two_experts_at_a_time_and_upcasts_equal_copies_once(tmp_path, monkeypatch):
    """The streamed check builds a layer without its experts and reads each from the files when tokens reach it,
    freed once the next one is read (compared with it: an equal copy reuses its float32 weights): two experts'
    tensors alive at a time, not the layer's (the peak at the Llama-3-8B widths, E8: BENCHMARKS "Speed and
    memory"), and one upcast a layer for identical copies."""
    import moeify.evaluation.layerwise as layerwise
    import weakref

    from moeify.formats.checkpoint import CheckpointReader
    from moeify.evaluation.layerwise import moe_stack, stream_hidden

    src = build_dense(tmp_path / "dense")
    upcycle(src, tmp_path / "moe", copies=4, top_k=2)
    reader = CheckpointReader(tmp_path / "moe")
    stack, live, names, most = moe_stack(tmp_path / "moe", reader), [], [], [0]
    get = reader.get

    def counted(name):
        t = get(name)
        if ".experts." in name:
            live.append(weakref.ref(t))
            names.append(name)
            most[0] = max(most[0], sum(r() is not None for r in live))
        return t

    reader.get = counted
    upcasts, fused = [], layerwise._fused
    monkeypatch.setattr(layerwise, "_fused", lambda *a: upcasts.append(1) or fused(*a))
    layer = stack.layer(0)
    assert live == [] and layer.mlp.experts.gate_up_proj.is_meta  # built without its experts
    stream_hidden([stack], torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert most[0] == 6  # gate, up and down of two experts at a time
    assert len(set(names)) == len(names) >= 3 * 2 * 3  # each expert reached read once: 2+ of 4 a layer, 3 layers
    assert len(upcasts) == 3  # the copies are equal (no symmetry breaking): upcast once a layer
    reader.close()
    upcycle(src, tmp_path / "noisy", copies=4, top_k=2, symmetry="noise")
    upcasts.clear()
    noisy = CheckpointReader(tmp_path / "noisy")
    stream_hidden([moe_stack(tmp_path / "noisy", noisy)], torch.randint(0, 384, (2, 16)))
    assert len(upcasts) >= 3 * 2  # copies that differ: each reached one upcast
    noisy.close()


def test_a_construction_that_is_not_exact_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    src = build_dense(tmp_path / "dense")
    import moeify.upcycling.layer as up

    real = up.copy_expert
    monkeypatch.setattr(up, "copy_expert", lambda g, u, d, idx, factor: real(g, u, d, idx, 1.5))
    with pytest.raises(RuntimeError, match="upcycle check failed"):
        upcycle(src, tmp_path / "moe", copies=2, top_k=2, granularity=2)
    assert not (tmp_path / "moe").exists() and not list(tmp_path.glob("moe.*"))


def test_an_interrupted_upcycle_leaves_nothing_behind(tmp_path, monkeypatch):
    src = build_dense(tmp_path / "dense")
    import moeify.upcycling.upcycle as up

    real, seen = up.layer_experts, []

    def stop_at_layer_2(plan, i, *a, **kw):
        seen.append(i)
        if i == 2:
            raise KeyboardInterrupt
        return real(plan, i, *a, **kw)
    monkeypatch.setattr(up, "layer_experts", stop_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        upcycle(src, tmp_path / "moe", copies=2, top_k=2)
    assert seen == [0, 1, 2] and not (tmp_path / "moe").exists() and not list(tmp_path.glob("moe.*"))


@pytest.mark.parametrize("source_kw,args,message", [
    (dict(), ["--copies", "4", "--granularity", "2", "--top-k", "3"], "--top-k 3 is not a multiple of --granularity 2"),
    (dict(), ["--granularity", "5"], "--granularity 5 does not divide the 96 routed neurons"),
    (dict(), ["--symmetry", "permute"], "--symmetry permute does nothing at --granularity 1"),
    (dict(), ["--symmetry", "shuffle"], "--symmetry 'shuffle' is not one of none, drop, permute, noise"),
    (dict(family="qwen3"), ["--shared-width", "32"], "Qwen3-MoE, the one stock class with its q/k norms, has no shared"),
    (dict(family="qwen2"), ["--format", "mixtral"], "--format mixtral cannot hold the q/k/v biases"),
    (dict(), ["--shared-width", "32", "--target", "llama.cpp"], "llama.cpp cannot run this layout: its qwen2moe "
                                                                 "never renormalises"),
    (dict(), ["--check-text", "SHORT"], "--check-text has"),
    (dict(family="qwen2"), ["--target", "vllm"], "refuses the checkpoint's empty shared_expert tensors — "
                                                 "--shared-width W"),
])
def test_bad_inputs_get_one_line_exit_2_and_leave_nothing(tmp_path, tokenizer_dir, source_kw, args, message):
    src = build_dense(tmp_path / "dense", tokenizer_dir, **source_kw)
    (tmp_path / "SHORT").write_text("Too short.")
    args = [a.replace("SHORT", str(tmp_path / "SHORT")) for a in args]
    result = cli("upcycle", src, tmp_path / "moe", *args)
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "moe").exists() and not list(tmp_path.glob("moe.*"))


def test_an_existing_output_is_refused_before_the_plan(tmp_path):
    src = build_dense(tmp_path / "dense")
    (tmp_path / "moe").mkdir()
    result = cli("upcycle", src, tmp_path / "moe")
    assert result.exit_code == 2 and "already exists" in result.stderr and "upcycle" not in result.stdout


def test_dry_run_prices_the_layout_from_config_alone_and_writes_nothing(tmp_path):
    build_dense(tmp_path / "dense")
    src = tmp_path / "config-only"
    src.mkdir()
    (src / "config.json").write_bytes((tmp_path / "dense" / "config.json").read_bytes())  # no weights: a Hub id's plan
    result = cli("upcycle", src, tmp_path / "moe", "--copies", "8", "--granularity", "2", "--top-k", "2", "--dry-run",
                 "--json", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    plan = read_json(tmp_path / "plan.json")
    assert plan["experts"] == 16 and plan["expert_width"] == 48 and plan["ffn_params_ratio"] == 8
    assert plan["ffn_flops_ratio"] == 1 and not plan["exact"]  # the default symmetry: drop
    assert plan["training_state_bytes"] == 16 * plan["total_params"] and plan["output_bytes"] == 4 * plan["total_params"]
    assert "x8.00 dense" in result.stdout and not (tmp_path / "moe").exists()
    table = [line for line in result.stdout.splitlines() if line[:1] in "┌│└"]
    assert len(table) >= 9 and all(len(line) <= 80 for line in table)


def test_verify_finds_a_copy_that_is_not_the_source_and_a_split_virtual_group(tmp_path):
    src = build_dense(tmp_path / "dense")
    upcycle(src, tmp_path / "moe", copies=2, granularity=2, top_k=2)

    def damage(t):
        t["model.layers.1.block_sparse_moe.experts.3.w1.weight"][0, 0] += 1.0
        t["model.layers.2.block_sparse_moe.gate.weight"][1] += 1.0  # copy 0's two slices no longer share a row
    rewrite(tmp_path / "moe" / "model.safetensors", damage)
    problems = verify_checkpoint(tmp_path / "moe", src, logits=False).problems
    assert any("copy 1's gate rows are not the source's" in p and "layers.1." in p for p in problems), problems
    assert any("gate.weight: the router rows of a copy's 2 slices are not equal" in p for p in problems), problems


def test_the_output_loads_with_no_missing_keys_and_trains(tmp_path):
    """A training step on the upcycled model moves the router: the output is a starting point for MoE training."""
    src = build_dense(tmp_path / "dense")
    moeify.upcycle(src, tmp_path / "moe", copies=4, top_k=2, symmetry="drop")
    model, info = load(tmp_path / "moe")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model.train()
    model.config.output_router_logits = True  # the load-balancing loss, weighted by the written coefficient
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    assert model.config.router_aux_loss_coef == 0.01 and out.aux_loss > 0
    loss = out.loss
    loss.backward()
    router = model.model.layers[0].mlp.gate.weight
    assert torch.isfinite(loss) and router.grad is not None and router.grad.abs().max() > 1e-6


def test_the_python_api_refuses_unknown_settings():
    with pytest.raises(MoeifyError, match="unknown setting"):
        moeify.upcycle("src", "out", experts=8)
