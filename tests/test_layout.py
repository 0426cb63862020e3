"""Presets stated as shares of d_ff (moeify/formats/layout.py), resolved per model into counts whose expert widths the
quantized kernels take: the shapes users carve, explicit flags winning, errors, moeify.toml round trip, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import build_dense
from moeify.cli.app import app
from moeify.formats.config import build_config, config_to_toml, load_preset
from moeify.errors import MoeifyError
from moeify.formats.layout import Layout, resolve_layout

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
# d_ff of the shapes people carve: Llama-3.2-1B/3B and SmolLM2-1.7B; Llama-2-7B; Llama-2-13B; Llama-3-8B, Mistral-7B,
# Mistral-Nemo; Llama-3-70B
USER_SHAPES = (8192, 11008, 13824, 14336, 28672)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_presets_resolve_to_quantizable_widths_at_users_shapes(preset):
    """Every preset, at d_ff 8,192 / 11,008 / 14,336 / 28,672 (and 13,824), has expert widths that are multiples of
    128 without padding (experts of 128 where d_ff has them: issue 54), top-k ≤ 16 and the stated active share ± 2
    points; `--serve k-quants` gives multiples of 256 there; SmolLM2's 1,536 resolves to 48 slices of 32 (Q8_0)."""
    from moeify.formats.layout import serve_quanta

    layout = load_preset(preset)["layout"]
    assert layout.width == 128
    for lay, quantum in ((layout, 128), (layout.for_serving(serve_quanta("k-quants")), 256)):
        for d_ff in USER_SHAPES:
            c = resolve_layout(lay, d_ff).chosen
            assert c.width * c.slices == d_ff and c.width % quantum == 0, (d_ff, c)
            assert 1 <= c.top_k <= 16 and c.experts + c.shared == c.slices
            assert abs(c.active - layout.active) <= 0.02 + 1e-9, (d_ff, c)
            assert abs(c.shared / c.slices - layout.shared) <= 0.5 / c.slices + 1e-9
            assert 32 <= c.slices <= 128
            if quantum == 128 and d_ff * 2 // 128 <= 128 and c.width != 128:  # 128 reachable: only top-k > 16 stops it
                assert layout.active * d_ff / 128 - layout.shared * d_ff / 128 > 16, (d_ff, c)
        c = resolve_layout(lay, 1536).chosen
        assert (c.slices, c.width, c.active) == (48, 32, layout.active)


def test_resolution_rules_by_hand():
    half = Layout(active=0.5, shared=0.25)
    # 14,336 = 2^11 * 7: 56 x 256 (the 256-wide count nearest 64; 64 x 224 fits no quantized kernel)
    r = resolve_layout(half, 14336)
    assert r.counts() == {"experts": 42, "shared": 14, "top_k": 14} and r.chosen.width == 256
    assert "14,336 = 56 × 256" in r.why and "multiple of 256" in r.why
    # 8,192: 32 x 256 beats the nearer 64 x 128 (a quantum before granularity, within x2 of 64)
    assert resolve_layout(half, 8192).counts() == {"experts": 24, "shared": 8, "top_k": 8}
    # 11,008 = 43 x 256: an odd count; 22 of 43 slices active = 51.2%, within the 2-point tolerance
    r = resolve_layout(half, 11008)
    assert r.chosen.slices == 43 and r.chosen.top_k + r.chosen.shared == 22
    # 86 x 128 would need top-22 > 16: never chosen; a preset asking for top-k <= 8 gets coarser slices
    assert resolve_layout(Layout(0.5, 0.25, max_top_k=8), 14336).chosen.top_k <= 8
    # a d_ff no count near 64 divides into multiples of 32: the nearest count to 64 still, and the reason says so
    r = resolve_layout(half, 128)
    assert r.chosen.slices == 64 and r.chosen.quantum == 0 and "no slice count near 64" in r.why


def test_a_preferred_width_wins_where_d_ff_has_it_and_a_k_quant_serving_format_drops_it():
    quarter = Layout(active=0.25, shared=0.125, width=128)
    shapes = {8192: (64, 8, 8), 8960: (70, 9, 9), 14336: (112, 14, 14), 4864: (38, 5, 5), 1536: (48, 6, 6)}
    for d_ff, (slices, shared, top_k) in shapes.items():
        c = resolve_layout(quarter, d_ff).chosen
        assert (c.slices, c.shared, c.top_k) == (slices, shared, top_k), (d_ff, c)
    assert "preferred width 128" in resolve_layout(quarter, 8192).why
    assert "not reachable" not in resolve_layout(quarter, 8192).why
    # half at 14,336: 112 x 128 would need top-28 > 16: the 256-wide 56 slices, as without a preferred width
    assert resolve_layout(Layout(active=0.5, shared=0.25, width=128), 14336).chosen.width == 256
    kq, q8 = quarter.for_serving((256, 128, 32)), quarter.for_serving((32,))
    assert kq.width == 0 and resolve_layout(kq, 8192).chosen.width == 256
    assert q8.width == 128 and resolve_layout(q8, 8192).chosen.width == 128
    with pytest.raises(MoeifyError, match="width must be a non-negative integer"):
        Layout(active=0.25, width=-1).validate()


def test_explicit_counts_win():
    half = Layout(active=0.5, shared=0.25)
    r = resolve_layout(half, 14336, experts=48, shared=16, top_k=16)  # today's 64-slice layout, pinned
    assert r.counts() == {"experts": 48, "shared": 16, "top_k": 16} and r.chosen.width == 224
    assert "given" in r.why
    r = resolve_layout(half, 14336, top_k=8)  # only top-k given: the share decides the rest
    assert r.chosen.top_k == 8 and abs(r.chosen.active - 0.5) < 1e-9
    with pytest.raises(MoeifyError, match="no expert layout gives 50% active"):
        resolve_layout(half, 14336, experts=5, shared=4)  # 9 slices do not divide 14,336


def test_preset_without_source_and_bad_layout_tables(tmp_path):
    with pytest.raises(MoeifyError, match=r"states its layout as shares of d_ff") as exc:
        build_config(PRESETS[0])
    assert "--experts, --shared and --top-k" in exc.value.hint
    assert build_config(PRESETS[0], experts=48, shared=16, top_k=16, calib=["x.txt"]).experts == 48  # no source needed
    bad = tmp_path / "bad.toml"
    for table, message in (("active = 1.5", "active must be a share in"), ("active = 0.5\nshared = 0.6", "shared must be"),
                           ("active = 0.5\nslice = 64", "unknown key\\(s\\): slice"), ("shared = 0.2", "needs active"),
                           ("active = 0.5\nquanta = []", "quanta must be")):
        bad.write_text(f"top_k = 2\n[layout]\n{table}\n")
        with pytest.raises(MoeifyError, match=message) as exc:
            load_preset(bad)
        assert str(bad) in exc.value.what


def test_resolved_counts_and_reason_round_trip_through_moeify_toml(tmp_path):
    """OUT/moeify.toml records the resolved counts and the [layout] with the reason; used again as a preset it gives
    the same settings without resolving (the counts in it win), whatever model it is applied to."""
    cfg = build_config(PRESETS[0], source=14336, calib=["x.txt"])  # active-25: 112 x 128
    assert cfg.layout.resolved.startswith("d_ff 14,336 = 112 × 128") and "preferred width 128" in cfg.layout.resolved
    toml = tmp_path / "moeify.toml"
    toml.write_text(config_to_toml(cfg, {"source": "somewhere"}))
    assert "[layout]" in toml.read_text() and "resolved = " in toml.read_text()
    again = build_config(toml)
    assert again == cfg and again.experts + again.shared == 112


def test_convert_dry_run_and_plan_print_the_resolution(tmp_path, tokenizer_dir):
    src = build_dense(tmp_path / "dense", tokenizer_dir, intermediate_size=1536)
    preset = str(next(p for p in PRESETS if p.stem == "active-25"))
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--preset", preset, "--dry-run",
                                   "--json", "-"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    s = plan["settings"]
    assert (s["experts"], s["shared"], s["top_k"], plan["expert_width"]) == (42, 6, 6, 32)
    assert s["layout"]["resolved"].startswith("d_ff 1,536 = 48 × 32")
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--preset", preset, "--dry-run",
                                   "--experts", "56", "--shared", "8", "--top-k", "8"])
    assert res.exit_code == 0 and "56 routed, top-8" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["plan", str(src / "config.json"), "--preset", preset, "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "resolved: d_ff 1,536 = 48 × 32: shared 6 + top-6 of 42 routed = 25.0% active" in text
    data = json.loads((tmp_path / "p.json").read_text())
    assert (data["experts"], data["shared"], data["top_k"]) == (42, 6, 6) and data["layout"]["active"] == 0.25
    assert not (tmp_path / "out").exists()


def test_converting_page_layout_table_is_what_plan_says():
    """docs/converting.md's table of the presets at common shapes is generated from `moeify plan --preset`
    (scripts/preset_layouts.py); a change to the presets or the resolution that is not regenerated fails here."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("preset_layouts", root / "scripts" / "preset_layouts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.plan_rows()
    table = mod.markdown(rows)
    assert mod.PAGE == root / "docs" / "converting.md"
    assert mod.page_table(mod.PAGE.read_text()) == table
    eight_b = [r for r in rows if r["model"] == "Llama-3/3.1-8B"]
    assert {r["preset"]: (r["shared"], r["top_k"], r["experts"], r["width"]) for r in eight_b} == \
        {"active-75": (28, 14, 28, 256), "active-50": (14, 14, 42, 256),
         "active-25": (14, 14, 98, 128)}  # 25%: 112 x 128 (top-28 stops it at 50%)
    # every large d_ff that has a multiple of 256 for a width gets one with --serve k-quants; Qwen2.5-0.5B (4,864 =
    # 128 x 38) and -72B (29,568 = 128 x 231) have none, and get multiples of 128 (vLLM's FP8 block and Marlin)
    assert all(int(r["serve"]["k-quants"].split("×")[1]) % 256 == 0 for r in rows
               if r["d_ff"] >= 8192 and r["d_ff"] % 256 == 0)
    assert all(r["width"] % 128 == 0 for r in rows if r["d_ff"] >= 4096)
    assert all(r["width"] % 128 == 0 for r in rows if r["model"] in ("Qwen2.5-0.5B", "Qwen2.5-72B"))
    # plan's budget: half the FFN (5.64B) plus everything else (2.39B) of 8.03B is active at 50%; 3/4 at 75%
    active = {r["preset"]: r["active_params"] for r in eight_b}
    assert 0.64 < active["active-50"] < 0.66 and 0.81 < active["active-75"] < 0.83


def test_serve_resolves_the_preset_for_the_widths_a_serving_format_takes(tmp_path, tokenizer_dir):
    """--serve picks the preset's layout for a serving format's widths: the presets prefer experts of 128 (issue 54),
    which FP8, Q8_0 and bf16 take and llama.cpp's K-quants do not: at the 0.5B Qwen's d_ff 4,864 every format gives
    38 x 128 (256 divides no slice count near 64); at d_ff 8,192 the 25% preset is 64 x 128, and 32 x 256 with
    --serve k-quants; at SmolLM2's 1,536 (no 128 near 64 slices) 48 x 32, 64 x 24 for bf16 (any width: exactly 64).
    plan and convert --dry-run print the four side by side and what the others measured; an unknown format is
    refused with the list."""
    from moeify.formats.config import resolve_preset

    layout = load_preset("active-25")

    def counts(d_ff):
        got = {fmt: resolve_preset(dict(layout), d_ff, serve=fmt) for fmt in (None, "k-quants", "fp8", "q8_0", "bf16")}
        return {f: (v["experts"] + v["shared"], v["shared"], v["top_k"]) for f, v in got.items()}, got

    assert counts(4864)[0] == dict.fromkeys((None, "k-quants", "fp8", "q8_0", "bf16"), (38, 5, 5))
    assert counts(1536)[0] == {None: (48, 6, 6), "k-quants": (48, 6, 6), "fp8": (48, 6, 6), "q8_0": (48, 6, 6),
                               "bf16": (64, 8, 8)}
    at_1b, got = counts(8192)
    assert at_1b == {None: (64, 8, 8), "k-quants": (32, 4, 4), "fp8": (64, 8, 8), "q8_0": (64, 8, 8),
                     "bf16": (64, 8, 8)}
    assert got["k-quants"]["layout"].resolved.startswith("--serve k-quants (llama.cpp's K-quants need widths of 256 "
                                                         "(else 128, 32)): d_ff 8,192 = 32 × 256")
    src = build_dense(tmp_path / "dense", tokenizer_dir, intermediate_size=8192, hidden_size=32,
                      num_hidden_layers=1)
    res = CliRunner().invoke(app, ["plan", str(src), "--preset", "active-25", "--serve", "k-quants", "--json", "-"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert (plan["experts"], plan["shared"], plan["top_k"]) == (28, 4, 4)
    assert [(a["serve"], a["experts"] + a["shared"], a["width"]) for a in plan["alternatives"]] == [
        ("k-quants", 32, 256), ("fp8", 64, 128), ("q8_0", 64, 128), ("bf16", 64, 128)]
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--preset", "active-25",
                                   "--weight-only", "--dry-run"])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "the preset's layout by serving format (--serve)" in said and "32 × 256 4 + top-4 of 28 25.0%" in said
    assert "d_ff 8,192 = 64 × 128" in said and "preferred width 128" in said
    from moeify.evaluation.planning import measured_tradeoff  # what the other layouts measured, under the --serve table

    measured = measured_tradeoff(0.25)
    assert {m["model"] for m in measured} >= {"Qwen2.5-Coder-0.5B", "SmolLM2-135M"} and measured_tradeoff(0.4) == []
    assert "measured on real models: other layouts against the preset's own" in said
    coarse = next(m for m in measured if m["model"] == "Qwen2.5-Coder-0.5B" and m["width"] == 256)
    assert (coarse["slices"], coarse["serve"], coarse["base"]["slices"], coarse["base"]["width"]) == (19, [], 38, 128)
    assert coarse["trainingfree"][0] > 0  # the 256-wide experts were further from dense on every text
    assert f"19 × 256 {coarse['trainingfree'][0] * 100:+.0f}…{coarse['trainingfree'][1] * 100:+.0f}%" in said
    kq = next(m for m in measured if m["d_ff"] == 8192 and m["preset"] == 25)
    assert kq["serve"] == ["k-quants"] and (kq["slices"], kq["base"]["slices"]) == (32, 64)
