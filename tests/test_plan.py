"""`moeify plan`: hand-computed numbers for Llama-3-8B, agreement with `convert --dry-run`, flag errors, CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import build_dense
from moeify.cli.app import app
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion
from moeify.errors import MoeifyError
from moeify.evaluation.planning import non_ffn_params, plan_from_path, plan_moe, read_source_config

# meta-llama/Meta-Llama-3-8B config.json (as published)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}

# Hand arithmetic, h = 4096, d_ff = 14336, 32 layers, 32 heads × 128, 8 kv heads × 128, vocab 128256, untied.
EMBED = 128256 * 4096  # 525_336_576, once for embed_tokens and once for lm_head
ATTN = 4096 * 4096 + 2 * (4096 * 1024) + 4096 * 4096  # q, k, v, o = 41_943_040
NORMS = 2 * 4096  # input + post-attention RMSNorm
OTHER = 2 * EMBED + 32 * (ATTN + NORMS) + 4096  # + final norm = 2_393_116_672
FFN = 3 * 4096 * 14336  # gate, up, down = 176_160_768 per layer
DENSE = OTHER + 32 * FFN  # 8_030_261_248 (the published "8.03B")
DENSE_FLOPS = 2 * 32 * FFN  # 11_274_289_152
ROUTER = 8 * 4096  # 32_768 per layer


def expert(width: int) -> int:
    return 3 * 4096 * width


# (name, width, total, active) for --experts 8 --top-k 2; the upcycles as `moeify upcycle` builds them, whatever the
# carve's counts: E8 top-2 (8 experts of d_ff), E8 G4 top-4 (32 experts of d_ff / 4, one copy's worth a token)
EXPECTED = [
    ("max capacity", 14336, OTHER + 32 * (8 * expert(14336) + ROUTER), OTHER + 32 * (2 * expert(14336) + ROUTER)),
    ("constant compute", 3584, OTHER + 32 * (32 * expert(3584) + 4 * ROUTER),
     OTHER + 32 * (4 * expert(3584) + 4 * ROUTER)),
    ("inference saving", 1792, OTHER + 32 * (8 * expert(1792) + ROUTER), OTHER + 32 * (2 * expert(1792) + ROUTER)),
    ("custom", 4096, OTHER + 32 * (8 * expert(4096) + ROUTER), OTHER + 32 * (2 * expert(4096) + ROUTER)),
]


@pytest.fixture
def llama3_config(tmp_path):
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_hand_arithmetic_is_what_it_says():
    assert OTHER == 2_393_116_672 and DENSE == 8_030_261_248 and DENSE_FLOPS == 11_274_289_152
    assert EXPECTED[0][2] == 47_491_321_856 and EXPECTED[0][3] == 13_668_454_400
    assert EXPECTED[2][2] == 8_031_309_824 and EXPECTED[2][3] == 3_803_451_392


def test_llama3_8b_numbers(llama3_config):
    plan = plan_from_path(llama3_config, experts=8, top_k=2, expert_width=4096)
    assert non_ffn_params(plan.src) == OTHER == plan.other_params
    assert plan.dense_params == DENSE and plan.dense_ffn_flops == DENSE_FLOPS
    assert [r.name for r in plan.regimes] == [e[0] for e in EXPECTED]
    for r, (name, width, total, active) in zip(plan.regimes, EXPECTED):
        b = r.budget
        assert (r.expert_width, b.total_params, b.active_params) == (width, total, active), name
        k, n = (4, 32) if name == "constant compute" else (2, 8)
        assert b.ffn_flops == 2 * 32 * (k * expert(width) + n * 4096), name  # FLOPs = 2 × active FFN weights
        assert b.total_ratio == total / DENSE and b.active_ratio == active / DENSE
        assert b.flops_ratio == b.ffn_flops / DENSE_FLOPS
    caps, const, carve, _ = (r.budget for r in plan.regimes)
    # the seed's heuristics, up to the router's share (2·32·8·4096 / DENSE_FLOPS ≈ 1.9e-4)
    assert caps.flops_ratio == pytest.approx(2.0, abs=2e-4)  # max capacity: k × dense compute
    assert const.flops_ratio == pytest.approx(1.0, abs=8e-4)  # constant compute (32 routers: 7.4e-4)
    assert carve.flops_ratio == pytest.approx(2 / 8, abs=2e-4)  # inference saving: k/N
    assert carve.total_ratio == pytest.approx(1.0, abs=2e-4)  # carving keeps the size


def test_shared_expert_widths(llama3_config):
    # 14 routed + 2 shared: carve width 14336 / 16 = 896, shared 1792; the upcycles are upcycle's defaults, unshared
    plan = plan_from_path(llama3_config, experts=14, top_k=3, shared=2)
    caps, const, carve = plan.regimes
    assert (carve.expert_width, carve.shared_width, carve.exact) == (896, 1792, True)
    assert carve.budget.total_params == OTHER + 32 * (14 * expert(896) + expert(1792) + 14 * 4096)
    assert carve.budget.active_params == OTHER + 32 * (3 * expert(896) + expert(1792) + 14 * 4096)
    assert [(r.layout, r.expert_width, r.shared_width) for r in (caps, const)] == [
        ("E8 top-2", 14336, 0), ("E8 G4 top-4", 3584, 0)]


def test_directory_and_renamed_config_file(tmp_path, llama3_config):
    renamed = tmp_path / "llama3-8b.json"
    renamed.write_text(llama3_config.read_text())
    for path in (llama3_config, llama3_config.parent, renamed):
        assert plan_from_path(path, experts=8, top_k=2).dense_params == DENSE
    assert read_source_config(renamed).path == renamed


@pytest.mark.parametrize("tied,experts,shared", [(False, 4, 0), (True, 4, 0), (False, 5, 1)])
def test_carve_regime_equals_convert_dry_run(tmp_path, tied, experts, shared):
    src = build_dense(tmp_path / "dense", head_dim=24, tie_word_embeddings=tied)  # d_ff 96
    cfg = build_config(experts=experts, top_k=2, shared=shared)
    dry = plan_conversion(src, cfg).budget
    carve = plan_moe(read_source_config(src), experts=experts, top_k=2, shared=shared).regimes[2]
    assert carve.name == "inference saving"
    assert carve.budget == dry


@pytest.mark.parametrize("kwargs,message", [
    (dict(experts=3, top_k=2), "does not divide intermediate_size 14336"),
    (dict(experts=8, top_k=9), "--top-k must be between 1 and --experts (8)"),
    (dict(experts=8, top_k=0), "--top-k must be between 1"),
    (dict(experts=0, top_k=1), "--experts must be ≥ 1"),
    (dict(experts=8, top_k=2, shared=-1), "--shared must be ≥ 0"),
    (dict(experts=8, top_k=2, expert_width=0), "--expert-width must be a positive integer"),
])
def test_bad_flags(llama3_config, kwargs, message):
    with pytest.raises(MoeifyError) as err:
        plan_from_path(llama3_config, **kwargs)
    assert message in str(err.value)


def test_divisibility_error_lists_valid_counts(llama3_config):
    with pytest.raises(MoeifyError) as err:
        plan_from_path(llama3_config, experts=3, top_k=2)
    assert "valid --experts" in str(err.value) and " 7, 8," in str(err.value)


def test_bad_config_names_the_real_file(tmp_path):
    bad = tmp_path / "mixtral.json"
    bad.write_text(json.dumps({**LLAMA3_8B, "model_type": "mixtral", "num_local_experts": 8}))
    with pytest.raises(MoeifyError) as err:
        plan_from_path(bad, experts=8, top_k=2)
    assert str(bad) in str(err.value) and "already a Mixture-of-Experts" in str(err.value)
    with pytest.raises(MoeifyError, match="does not exist"):
        plan_from_path(tmp_path / "nope", experts=8, top_k=2)


def test_cli_table_and_json(llama3_config):
    runner = CliRunner()
    res = runner.invoke(app, ["plan", str(llama3_config), "--experts", "8", "--top-k", "2", "--expert-width", "4096"])
    assert res.exit_code == 0, res.output
    for text in ("max capacity", "constant compute", "inference saving", "custom", "47.49B", "13.67B", "5.914",
                 "0.250", "8.03B"):
        assert text in res.output, text
    res = runner.invoke(app, ["plan", str(llama3_config), "-n", "8", "-k", "2", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # stdout is the JSON alone; the tables went to stderr
    assert data["dense_params"] == DENSE and data["regimes"][2]["total_params"] == EXPECTED[2][2]
    assert "inference saving" in res.stderr


def test_cli_bad_flag_exits_2(llama3_config):
    res = CliRunner().invoke(app, ["plan", str(llama3_config), "--experts", "3", "--top-k", "2"])
    assert res.exit_code == 2
    assert "does not divide intermediate_size" in res.output


# ------------------------------------------------------------------------- serving fit and 80 columns


def rendered(print_fn, *args) -> list[str]:
    import io

    from rich.console import Console

    buf = io.StringIO()
    print_fn(Console(file=buf, width=80, color_system=None), *args)
    return buf.getvalue().splitlines()


def test_serving_fit_of_expert_widths():
    from moeify.evaluation.planning import friendly_expert_counts, serving_fit

    fit = {w: [tp for _, tp in serving_fit(w)] for w in (224, 192, 256, 1792, 3584, 128)}
    # llama.cpp Q8_0 (x32) and K-quants (x256, no TP), vLLM FP8 block and int4 Marlin (x128 per GPU: largest TP of
    # 1, 2, 4, 8)
    assert fit == {224: [1, 0, 0, 0], 192: [1, 0, 0, 0], 256: [1, 1, 2, 2], 1792: [1, 1, 2, 2], 3584: [1, 1, 4, 4],
                   128: [1, 0, 1, 1]}
    assert [tp for _, tp in serving_fit(24)] == [0, 0, 0, 0]  # SmolLM2's d_ff / 64
    assert friendly_expert_counts(1536, 0, 128) == [2, 3, 4, 6, 12]  # SmolLM2: 1536 / 8 = 192 fits nothing
    assert friendly_expert_counts(14336, 0, 256) == [2, 4, 7, 8, 14, 28, 56]
    assert friendly_expert_counts(1536, 1, 128) == [2, 3, 5, 11]  # with a shared expert: d_ff / (N + 1)


def test_plan_names_serving_formats_and_fits_80_columns(llama3_config, tmp_path):
    """64 experts of Llama-3-8B are 224 wide: no K-quants, no FP8 block, no Marlin; padding or other counts fix it."""
    from moeify.cli.report import print_moe_plan

    lines = rendered(print_moe_plan, plan_from_path(llama3_config, experts=64, top_k=8))
    advice = [ln for ln in lines if ln.startswith("  ×")]
    assert all(len(ln) <= 80 for ln in lines if ln not in advice), "\n".join(lines)
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.split() and ln.split()[0].isdigit()}
    assert rows["224"] == ["yes", "no", "no", "no"] and rows["3584"] == ["yes", "yes", "TP", "≤", "4", "TP", "≤", "4"]
    assert rows["14336"] == ["yes", "yes", "TP", "≤", "8", "TP", "≤", "8"]
    assert any(ln.startswith("inference saving") and ln.split()[2] == "224" for ln in lines)
    assert advice == ["  ×128: --pad-experts-to 128 (+14% weights, zeros) or --experts 16, 28, 56, 112",
                      "  ×256: --pad-experts-to 256 (+14% weights, zeros) or --experts 8, 14, 28, 56"]
    res = CliRunner().invoke(app, ["plan", str(llama3_config), "-n", "64", "-k", "8", "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0 and f"wrote {tmp_path / 'p.json'}" in " ".join(res.stderr.split())
    regimes = json.loads((tmp_path / "p.json").read_text())["regimes"]
    assert regimes[2]["expert_width"] == 224
    assert regimes[2]["serving"] == {"llama.cpp Q8_0": 1, "llama.cpp K-quants": 0, "vLLM FP8 block": 0, "vLLM int4 Marlin": 0}


def test_dry_run_serving_fit_padding_and_json(tmp_path):
    """A SmolLM2-like d_ff of 1536 in 8 experts (192 wide) suits no quantized format; --pad-experts-to 256 stores
    256-wide experts that suit all three. The dry-run plan fits 80 columns; --json - prints the plan alone."""
    from moeify.cli.report import print_plan

    src = build_dense(tmp_path / "dense", intermediate_size=1536)
    plan = plan_conversion(src, build_config(experts=8, top_k=2))
    lines = [" ".join(ln.split()) for ln in rendered(print_plan, plan, tmp_path / "out")]
    assert all(len(ln) <= 80 for ln in rendered(print_plan, plan, tmp_path / "out")[1:-2])  # not the paths / advice
    assert "expert width 192 neurons (d_ff / 8)" in lines
    assert "llama.cpp K-quants no: 192 is not a multiple of 256" in lines
    assert "vLLM FP8 block no: 192 is not a multiple of 128" in lines
    assert "×256: --pad-experts-to 256 (+33% weights, zeros) or --experts 2, 3, 6" in lines
    padded = plan_conversion(src, build_config(experts=8, top_k=2, pad_experts_to=256))
    lines = [" ".join(ln.split()) for ln in rendered(print_plan, padded, tmp_path / "out")]
    assert "expert width 192 neurons (d_ff / 8), zero-padded to 256" in lines
    assert "llama.cpp K-quants yes (256 = 1 × 256)" in lines
    assert "vLLM int4 Marlin yes, TP ≤ 2 (width / TP a multiple of 128)" in lines and not any("×256:" in ln for ln in lines)
    assert padded.budget.total_params - plan.budget.total_params == 3 * 8 * 3 * 64 * 64  # layers × experts × 3 × h × 64
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "-n", "8", "-k", "2", "--pad-experts-to",
                                   "256", "--dry-run", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["expert_width"] == 192 and data["padded_expert_width"] == 256 and data["settings"]["pad_experts_to"] == 256
    assert data["serving"] == {"llama.cpp Q8_0": 1, "llama.cpp K-quants": 1, "vLLM FP8 block": 2, "vLLM int4 Marlin": 2}
    assert data["output_bytes"] == padded.output_bytes and "nothing written" in res.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- engine guard rails


def test_engine_notes_name_what_fails_and_the_fix():
    from moeify.formats.engines import engine_notes

    notes = engine_notes("mixtral", 32, 64, 0, 24, True, 0, 64, 576, 9)
    fail = [n for n in notes if n.fails]
    assert [n.engine for n in fail] == ["llama.cpp"] and "top-k 32" in fail[0].what
    assert "--top-k ≤ 16" in fail[0].fix and "--experts 32 --top-k 16" in fail[0].fix
    slow = [n for n in notes if not n.fails]
    assert len(slow) == 1 and "not a multiple of 32" in slow[0].what and "--pad-experts-to 32" in slow[0].fix
    assert engine_notes("mixtral", 16, 64, 0, 32, True, 0, 64, 576, 9) == []  # top-16, width 32: clean
    qwen = engine_notes("qwen2_moe", 8, 48, 0, 32, True, 1, 128, 576, 9)
    assert {(n.engine, n.fails) for n in qwen} == {("llama.cpp", True), ("vllm", True)}
    assert {n.fix for n in qwen} >= {"pass --untie-embeddings", "leave out --dense-layers", "use --format mixtral"}
    # vLLM 0.32 refuses a Qwen2-MoE checkpoint without a shared expert (its empty shared_expert tensors)
    assert any(n.engine == "vllm" and "empty shared_expert" in n.what and "--shared S" in n.fix for n in qwen)
    # a shared-expert layout (the 50% preset: 16 shared slices + 48 routed top-16) on a source whose head_dim is not
    # hidden / heads: the fix names the Mixtral layout with the same share active and a top-k llama.cpp runs
    shared = engine_notes("qwen2_moe", 16, 48, 16 * 24, 24, False, 0, 128, 576, 9)
    assert [(n.engine, n.fails) for n in shared if n.fails] == [("vllm", True)]
    assert "--format mixtral --shared 0 --experts 32 --top-k 16 (the same 50% active)" in shared[0].fix


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer_dir):
    return build_dense(tmp_path_factory.mktemp("src") / "dense", tokenizer_dir)  # d_ff 96, 3 layers


def test_convert_refuses_a_layout_a_target_cannot_run(tmp_path, source):
    """d_ff 96: 48 experts of width 2, top-24 overflows llama.cpp's graph; refused for --target llama.cpp (not for
    the others), planned with --force; the dry run prints the verdict and its JSON carries it."""
    cfg = build_config(experts=48, top_k=24, targets="llama.cpp,transformers")
    with pytest.raises(MoeifyError, match=r"--target llama.cpp: llama.cpp cannot run this layout: top-k 24.*--force"):
        plan_conversion(source, cfg)
    plan = plan_conversion(source, cfg, force=True)
    assert any(n.fails and n.engine == "llama.cpp" for n in plan.engine_notes)
    plan_conversion(source, build_config(experts=48, top_k=24, targets=("vllm", "transformers")))  # no refusal
    with pytest.raises(MoeifyError, match="--target 'sglang' is not one of"):
        build_config(targets=("sglang",))
    runner = CliRunner()
    res = runner.invoke(app, ["convert", str(source), str(tmp_path / "o"), "--experts", "48", "--top-k", "24",
                              "--weight-only", "--target", "llama.cpp", "--dry-run"])
    assert res.exit_code == 2 and "--force" in res.output and not (tmp_path / "o").exists()
    res = runner.invoke(app, ["convert", str(source), str(tmp_path / "o"), "--experts", "48", "--top-k", "24",
                              "--weight-only", "--dry-run", "--json", "-"])
    assert res.exit_code == 0
    engines = json.loads(res.stdout)["engines"]
    assert any(e["engine"] == "llama.cpp" and e["fails"] and "top-k 24" in e["what"] for e in engines)
    res = runner.invoke(app, ["plan", str(source), "--experts", "48", "--top-k", "24"])
    assert res.exit_code == 0 and "llama.cpp: fails: top-k 24" in " ".join(res.output.split())


def test_presets_name_every_engine_and_every_engine_runs_them(tmp_path, tokenizer_dir):
    """Each shipped preset targets every engine, and its plan for a tied-embedding Llama (the hard case: llama.cpp's
    qwen2moe has no tied output) has no engine that fails: the preset itself carries what the engines need."""
    from pathlib import Path

    from moeify.formats.config import load_preset
    from moeify.formats.engines import ENGINES, LLAMACPP_MAX_TOPK

    src = build_dense(tmp_path / "dense", tokenizer_dir, intermediate_size=128, tie_word_embeddings=True)
    presets = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
    assert len(presets) >= 2
    for preset in presets:
        data = load_preset(preset)
        assert set(data["targets"]) == set(ENGINES), preset
        assert data["layout"].max_top_k <= LLAMACPP_MAX_TOPK, preset  # counts resolved per model (test_layout.py)
        assert data["tune_tokens"] == (0 if preset.stem == "active-75" else 262144), preset  # 75%: training-free
        res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--preset", str(preset),
                                       "--dry-run", "--json", "-"])
        assert res.exit_code == 0, res.output
        plan = json.loads(res.stdout)
        assert plan["settings"]["top_k"] <= LLAMACPP_MAX_TOPK
        assert not [e for e in plan["engines"] if e["fails"]], (preset, plan["engines"])
        assert not (tmp_path / "out").exists()


def test_active_share_is_one_number_in_plan_convert_and_card(tmp_path):
    """The bundled tiny model's 50% preset: 15 shared + top-15 of 45 experts of 12 neurons, stored zero-padded to 16.
    plan, convert's plan and the card all say 50.0% of the neurons, and the padding's 60.4% of the FLOPs apart."""
    from pathlib import Path

    from moeify.api import convert, plan

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
    said = "50.0% of the dense FFN's neurons; experts of 12 neurons are stored zero-padded to 16 (exact), so a token " \
           "computes 60.4% of the dense FFN's FLOPs, routers included"
    carved = plan(tiny, preset="active-50").carved_share()
    assert carved["active_share"] == pytest.approx(0.5) and (carved["expert_width"], carved["stored_width"]) == (12, 16)
    planned = CliRunner().invoke(app, ["plan", str(tiny), "--preset", "active-50"])
    converted = CliRunner().invoke(app, ["convert", str(tiny), str(tmp_path / "x"), "--preset", "active-50", "--dry-run"])
    for res in (planned, converted):
        assert res.exit_code == 0 and said in " ".join(res.output.replace("│", " ").split()), res.output
    convert(tiny, tmp_path / "moe", preset="active-50", weight_only=True)
    assert f"| FFN active per token | {said} |" in (tmp_path / "moe" / "README.md").read_text()
    assert "pypi.org" not in (tmp_path / "moe" / "README.md").read_text()  # no link to an index page that is not there


def test_dry_run_says_each_presets_tune():
    """active-50 and active-25 tune on 262,144 tokens with the bundled prose; active-75 is training-free and says
    how to tune it anyway."""
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
    said = {}
    for preset in ("active-25", "active-50", "active-75"):
        res = CliRunner().invoke(app, ["convert", str(tiny), "/nonexistent/out", "--preset", preset, "--dry-run"])
        assert res.exit_code == 0, res.output
        said[preset] = " ".join(res.output.replace("│", " ").split())
    for preset in ("active-25", "active-50"):
        assert ("tuning distil experts + routers to the dense model on 262,144 tokens (50% self-generated + the "
                "bundled prose); --tune-tokens 0: off") in said[preset], said[preset]
    assert ("tuning none: training-free (--tune-tokens N distils it to the dense model on N tokens)"
            in said["active-75"]), said["active-75"]


# ------------------------------------------------------------------ the upcycles as upcycle builds them, and training

# Qwen/Qwen2.5-1.5B config.json (as published; q/k/v biases, tied embeddings)
QWEN25_15B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
    "intermediate_size": 8960, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_a_preset_plan_prices_the_upcycles_as_upcycle_builds_them(tmp_path):
    """With --preset active-25 a Qwen2.5-1.5B carve has many small experts; max capacity and constant compute are
    still E8 top-2 and E8 G4 top-4 (they showed 61 experts top-9, 81.31B, 52.7× dense: a row no one would build)."""
    from moeify.evaluation.planning import plan_preset

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN25_15B))
    plan = plan_preset(read_source_config(cfg), "active-25")
    caps, const = plan.regimes[:2]
    other = 151936 * 1536 + 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 2 * 1536 + 1536 + 2 * 256) + 1536
    ffn = 3 * 1536 * 8960
    assert plan.dense_params == other + 28 * ffn == 1_543_714_304
    assert (caps.layout, caps.experts, caps.top_k, caps.expert_width) == ("E8 top-2", 8, 2, 8960)
    assert caps.budget.total_params == other + 28 * (8 * ffn + 8 * 1536)  # 9.64B, 6.24× dense
    assert caps.budget.total_ratio == pytest.approx(6.24, abs=0.01) and caps.budget.flops_ratio == pytest.approx(2, abs=1e-3)
    assert (const.layout, const.experts, const.top_k, const.expert_width) == ("E8 G4 top-4", 32, 4, 2240)
    assert const.budget.flops_ratio == pytest.approx(1.0, abs=2e-3)
    assert plan.experts > 8 and plan.regimes[2].name == "inference saving"  # the carve keeps the preset's counts


def test_training_memory_of_llama3_8b_e8_per_process(llama3_config):
    """Llama-3-8B as E8 top-2: 47.49B parameters. Training it in bf16 across 8 GPUs: the float32 weights and AdamW
    (16 B a trained parameter, 4 B a frozen one) / 8, two gathered layers in bf16 and a layer's float32 gradients,
    one window's activations and logits; offloaded, the 16 B a parameter go to host memory."""
    from moeify.evaluation.planning import plan_from_path

    plan = plan_from_path(llama3_config, experts=8, top_k=2)
    rows = {r["layout"]: r for r in plan.training_memory(8, 80e9)}
    e8 = rows["E8 top-2"]
    assert e8["total_params"] == pytest.approx(47.49e9, rel=1e-3)
    trained = 32 * (8 * expert(14336) + ROUTER)  # routers and experts
    state = (4 * e8["total_params"] + 12 * trained) / 8  # 91.4 GB a process
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 2 * 4096 + 8 * expert(14336) + ROUTER
    gathered = 2 * (2 * layer + 2 * EMBED + 4096) + 4 * trained / 32
    act = 512 * 32 * (2 * (4 * 14336 + 3 * 4096) + 10 * 4096 + 16) * 2 + 512 * 4096 * 8
    logits = 512 * 128256 * 14
    assert e8["peak"] == pytest.approx(state + gathered + act + logits, rel=1e-6)
    assert e8["peak"] == pytest.approx(111.8e9, rel=2e-3)
    assert e8["offload_host"] == pytest.approx(state, rel=1e-6) and e8["offload_peak"] == pytest.approx(20.4e9, rel=3e-3)
    assert e8["gpus_needed"] == {"plain": 16, "offload": 4}  # 80 GB GPUs; offloaded: ≤ 240 GB host a GPU
    fine = rows["E8 G4 top-4"]
    assert fine["total_params"] == pytest.approx(47.49e9, rel=1e-3) and fine["peak"] < e8["peak"]
    h200 = {r["layout"]: r for r in plan.training_memory(8, 141e9)}
    assert h200["E8 top-2"]["gpus_needed"]["plain"] == 8  # eight H200s hold it without offload


def test_training_memory_of_a_70b_upcycle_and_the_cli_rows(tmp_path):
    c = tmp_path / "config.json"
    c.write_text(json.dumps({**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                             "num_attention_heads": 64}))
    from moeify.evaluation.planning import plan_from_path

    rows = {r["layout"]: r for r in plan_from_path(c, experts=8, top_k=2).training_memory(64, 80e9)}
    e8 = rows["E8 top-2"]
    assert e8["total_params"] == pytest.approx(465.2e9, rel=1e-3)
    # on 80 GB GPUs no count fits: two gathered 5.8B-parameter layers in bf16 with one layer's float32 gradients
    # (49.9 GB) and one window's activations (29.6 GB) exceed it at any sharding; 141 GB GPUs (H200) do
    assert e8["parts"]["gathered"] == pytest.approx(49.9e9, rel=1e-3)
    assert e8["parts"]["activations"] == pytest.approx(29.56e9, rel=1e-3)
    assert e8["gpus_needed"] == {"plain": None, "offload": None}
    h200 = {r["layout"]: r for r in plan_from_path(c, experts=8, top_k=2).training_memory(64, 141e9)}
    assert h200["E8 top-2"]["gpus_needed"] == {"plain": 128, "offload": 32}
    res = CliRunner().invoke(app, ["plan", str(c), "-n", "8", "-k", "2", "--gpus", "64", "--json", "-"],
                             terminal_width=80)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["layout"] for r in data["training_memory"]] == ["E8 top-2", "E8 G4 top-4"]
    assert data["training_memory"][0]["processes"] == 64
    assert "training an upcycle" in res.stderr and "465.16B" in res.stderr
    assert max(len(ln) for ln in res.stderr.splitlines()) <= 80


def test_upcycle_dry_run_says_the_training_memory_and_gpus(llama3_config):
    res = CliRunner().invoke(app, ["upcycle", str(llama3_config.parent), "/nonexistent/out", "--dry-run"],
                             terminal_width=120)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "47.49B total" in text and "111.8 GB each on 8" in text and "80 GB GPUs: 16, 4 offloaded" in text
