"""moeify.config: how flags and presets become a ConvertConfig."""

from __future__ import annotations

from pathlib import Path

from moeify.config import build_config


def test_text_paths_are_recorded_absolute_so_tune_finds_them_from_another_directory(tmp_path, monkeypatch):
    """convert run with a relative --calib path: OUT/moeify.toml records where the file is, not where convert ran."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text")
    monkeypatch.chdir(tmp_path)
    cfg = build_config(experts=4, top_k=2, calib=[Path("texts/a.txt")], tune_text=["texts/a.txt"])
    assert cfg.calib == (str(tmp_path / "texts" / "a.txt"),) and cfg.tune_text == cfg.calib
    assert build_config(experts=4, top_k=2, calib=["missing.txt"]).calib == ("missing.txt",)  # refused later, as given
