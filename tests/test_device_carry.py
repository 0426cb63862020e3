"""scripts/device_carry.py: a model cut into pieces for the device tool's 64 MiB calls arrives byte for byte."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import device_carry  # noqa: E402


def _model(tmp_path: Path) -> Path:
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(10_000))
    (src / "config.json").write_text('{"hidden_size": 8}')
    (src / "empty.txt").write_bytes(b"")
    return src


def test_split_then_join_gives_the_same_bytes_in_pieces_no_larger_than_asked(tmp_path):
    src = _model(tmp_path)
    folders = device_carry.split(src, tmp_path / "carry", 3_000)
    assert len(folders) == 4  # 10,030 bytes in pieces of 3,000
    assert all(sum(p.stat().st_size for p in f.iterdir() if p.name != "manifest.json") <= 3_000 for f in folders)
    flat = tmp_path / "there"  # as on the device: every piece copied into one folder
    flat.mkdir()
    for f in folders:
        for p in f.iterdir():
            shutil.copy(p, flat / p.name)
    device_carry.join(flat, tmp_path / "joined")
    for f in src.iterdir():
        assert (tmp_path / "joined" / f.name).read_bytes() == f.read_bytes()


def test_join_refuses_a_missing_or_damaged_piece(tmp_path):
    src = _model(tmp_path)
    folders = device_carry.split(src, tmp_path / "carry", 3_000)
    shutil.rmtree(folders[2])
    with pytest.raises(SystemExit, match="part\\(s\\) missing.*carry every piece"):
        device_carry.join(tmp_path / "carry", tmp_path / "joined")
    folders = device_carry.split(src, tmp_path / "carry", 3_000)
    part = next(p for p in folders[1].iterdir())
    part.write_bytes(b"x" * part.stat().st_size)
    with pytest.raises(SystemExit, match="SHA-256 does not match"):
        device_carry.join(tmp_path / "carry", tmp_path / "joined")
