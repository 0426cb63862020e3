"""moeify.formats.config: how flags and presets become a ConvertConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeify.formats.config import build_config
from moeify.errors import MoeifyError


def test_text_paths_are_recorded_absolute_so_tune_finds_them_from_another_directory(tmp_path, monkeypatch):
    """convert run with a relative --calib path: OUT/moeify.toml records where the file is, not where convert ran."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text")
    monkeypatch.chdir(tmp_path)
    cfg = build_config(experts=4, top_k=2, calib=[Path("texts/a.txt")], tune_text=["texts/a.txt"])
    assert cfg.calib == (str(tmp_path / "texts" / "a.txt"),) and cfg.tune_text == cfg.calib
    assert build_config(experts=4, top_k=2, calib=["missing.txt"]).calib == ("missing.txt",)  # refused later, as given


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", ["active-25.toml", "active-50.toml"])
def test_weight_only_carves_a_presets_layout_from_the_weights_alone(preset):
    """`convert --preset P --weight-only`: the preset's layout, its calibrated settings replaced (each noted)."""
    path = REPO / "configs" / preset
    calibrated = build_config(path, default_calib=True, source=4864)
    notes: list[str] = []
    cfg = build_config(path, default_calib=False, source=4864, weight_only=True, notes=notes)
    assert (cfg.experts, cfg.shared, cfg.top_k, cfg.format) == (calibrated.experts, calibrated.shared,
                                                                 calibrated.top_k, calibrated.format)
    assert (cfg.method, cfg.router, cfg.compensate, cfg.tune_tokens, cfg.calib) == ("gate-cluster", "representative",
                                                                                    False, 0, ())
    assert not cfg.needs_calibration and calibrated.needs_calibration
    assert [n.split(" = ")[0] for n in notes] == [f"--weight-only: the preset's {k}" for k in
                                                  ("method", "router", "compensate", "tune_tokens")]
    assert 'method = "activation" becomes "gate-cluster"' in notes[0]


def test_weight_only_refuses_a_flag_that_needs_text():
    with pytest.raises(MoeifyError, match=r"--weight-only and --method activation contradict"):
        build_config(REPO / "configs" / "active-25.toml", source=4864, weight_only=True, method="activation")
    with pytest.raises(MoeifyError, match=r"--weight-only and --tune-tokens 1024 contradict"):
        build_config(experts=4, top_k=2, weight_only=True, tune_tokens=1024)
    cfg = build_config(experts=4, top_k=2, weight_only=True, method="contiguous")  # a weight-only flag is kept
    assert cfg.method == "contiguous" and not cfg.needs_calibration


def test_convert_with_a_preset_and_weight_only_says_what_it_replaced(tmp_path):
    from typer.testing import CliRunner

    from moeify.cli.app import app

    res = CliRunner().invoke(app, ["convert", str(REPO / "examples" / "tiny-llama"), str(tmp_path / "out"),
                                   "--preset", str(REPO / "configs" / "active-25.toml"), "--weight-only"])
    assert res.exit_code == 0, res.output
    assert "note: --weight-only: the preset's method" in " ".join(res.output.split())
    toml = (tmp_path / "out" / "moeify.toml").read_text()
    assert 'method = "gate-cluster"' in toml and "tune_tokens = 0" in toml and "shared = 8" in toml


def test_the_recipe_names_files_portably_and_still_works_as_a_preset(tmp_path, monkeypatch, tokenizer_dir):
    """OUT/moeify.toml and the card name the bundled sample as bundled:NAME, the user's files and the source by name
    alone (no folder of this machine); used again as a preset it finds the files (here, or where report.json says
    they were: `moeify tune OUT` runs from any directory)."""
    from conftest import build_dense, corpus_text

    from moeify.api import convert
    from moeify.formats.config import BUNDLED_CALIB, load_preset

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "mine.txt").write_text(corpus_text(4000))
    src = build_dense(tmp_path / "dense", tokenizer_dir)
    monkeypatch.chdir(tmp_path)
    for name, calib in (("own", [Path("texts/mine.txt")]), ("bundled", None)):
        convert(src, tmp_path / name, experts=4, top_k=2, calib=calib, calib_tokens=256, calib_seq_len=64, tune=False)
    own, bundled = ((tmp_path / n / "moeify.toml").read_text() for n in ("own", "bundled"))
    assert 'calib = ["mine.txt"]' in own and 'calib = ["bundled:calib_sample.txt"]' in bundled
    assert 'source = "dense"' in own
    for out in ("own", "bundled"):
        for f in ("moeify.toml", "README.md"):
            assert str(tmp_path) not in (tmp_path / out / f).read_text(), (out, f)
    monkeypatch.chdir(tmp_path / "texts")  # elsewhere: the name is found here, or from report.json
    assert build_config(tmp_path / "own" / "moeify.toml").calib == (str(tmp_path / "texts" / "mine.txt"),)
    monkeypatch.chdir(tmp_path / "dense")
    assert build_config(tmp_path / "own" / "moeify.toml").calib == (str(tmp_path / "texts" / "mine.txt"),)
    assert build_config(tmp_path / "bundled" / "moeify.toml").calib == (str(BUNDLED_CALIB),)
    copy = tmp_path / "recipe.toml"  # a recipe without its output beside it: names as written
    copy.write_text(own)
    assert load_preset(copy)["calib"] == ["mine.txt"]
    with pytest.raises(MoeifyError, match="bundled:nope.txt: moeify ships no such text"):
        build_config(experts=4, top_k=2, calib=["bundled:nope.txt"])


def test_the_presets_tune_on_the_bundled_prose_unless_given_text(tmp_path):
    """The presets' tune_text is the prose moeify ships (moeify/data/README.md: the file it describes, to the hash);
    the recipe names it bundled:tune_prose.txt; --tune-text puts the user's text in its place."""
    import hashlib

    from moeify.formats.config import BUNDLED_PROSE, config_to_toml

    text = BUNDLED_PROSE.read_text()
    readme = " ".join((BUNDLED_PROSE.parent / "README.md").read_text().split())  # wrapped anywhere
    assert f"{len(text):,} characters, sha256 prefix `{hashlib.sha256(text.encode()).hexdigest()[:16]}`" in readme
    calib_sample = (BUNDLED_PROSE.parent / "calib_sample.txt").read_text()
    assert calib_sample[:2000] not in text and calib_sample[-2000:] not in text  # the sample's text is not read twice
    mine = tmp_path / "mine.txt"
    mine.write_text("my own prose")
    for preset, tokens in (("active-25.toml", 262144), ("active-50.toml", 262144), ("active-75.toml", 0)):
        cfg = build_config(REPO / "configs" / preset, default_calib=True, source=4864)  # active-75: training-free,
        assert cfg.tune_text == (str(BUNDLED_PROSE),) and cfg.tune_tokens == tokens, preset  # the mix if tuned
        assert 'tune_text = ["bundled:tune_prose.txt"]' in config_to_toml(cfg)
        own = build_config(REPO / "configs" / preset, default_calib=True, source=4864, tune_text=[mine])
        assert own.tune_text == (str(mine),)
    assert build_config(experts=4, top_k=2, calib=[str(mine)], tune_tokens=1024).tune_text == ()  # no preset: none
