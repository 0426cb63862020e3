"""OS errors on the output side of `convert`, `upcycle` and `merge`, injected: an output whose parent is a file, no
permission to create or rename into place, the disk filling in the middle of a shard. Each is one `error:` line
naming the path and what to do, exit code 2, and nothing left behind (neither OUT nor OUT.moeify-partial; with
--overwrite the earlier OUT as it was). Permission is injected by monkeypatching the call (the tests run as root,
where chmod takes nothing away)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_dense, tree_hash
from moeify.formats.checkpoint import PARTIAL_SUFFIX
from moeify.cli.app import app
from moeify.errors import MoeifyError
from moeify.formats.output import output_errors
from moeify.formats.writer import ShardWriter
from test_reliability import assert_refused


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is faster than two on a busy machine, and every run here is a few of them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sources")
    return build_dense(root / "a", tokenizer_dir), build_dense(root / "b", tokenizer_dir, seed=1)


COMMANDS = {  # the command line that writes `out` from the sources (a, b)
    "convert": lambda out, a, b: ["convert", a, out, "-n", "4", "-k", "2", "--weight-only"],
    "upcycle": lambda out, a, b: ["upcycle", a, out, "--copies", "2", "--top-k", "2", "--check-tokens", "128"],
    "merge": lambda out, a, b: ["merge", out, a, b],
}


def run(command: str, out: Path, sources, *extra):
    return CliRunner().invoke(app, [str(a) for a in (*COMMANDS[command](out, *sources), *extra)])


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refuse_for_partial(monkeypatch, method: str) -> None:
    """Path.<method> (mkdir, rename) on OUT.moeify-partial raises PermissionError, as a parent without write
    permission does for a user who is not root; on any other path it does what it does."""
    real = getattr(Path, method)

    def refused(self, *args, **kwargs):
        if self.name.endswith(PARTIAL_SUFFIX):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self), *map(str, args[:1]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, method, refused)


class FullDisk:
    """A shard file on a disk with `room` bytes left: a write stores what fits, then raises ENOSPC."""

    def __init__(self, fh, room: int):
        self.fh, self.room = fh, room

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        fits = min(len(data), self.room)
        self.fh.write(data[:fits])
        self.room -= fits
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.fh, name)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_under_a_file(command, tmp_path, sources):
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / "out"
    line = assert_refused(run(command, out, sources), str(out), f"{tmp_path / 'file'} is a file, not a directory",
                          "choose an output path")
    assert "Errno" not in line
    assert listing(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_permission_to_create_the_output(command, tmp_path, sources, monkeypatch):
    refuse_for_partial(monkeypatch, "mkdir")
    out = tmp_path / "out"
    assert_refused(run(command, out, sources), str(out), "permission denied", str(out) + PARTIAL_SUFFIX,
                   "choose a folder you can write to")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_no_permission_to_rename_the_output_into_place(command, tmp_path, sources, monkeypatch):
    refuse_for_partial(monkeypatch, "rename")
    out = tmp_path / "out"
    assert_refused(run(command, out, sources), str(out), "permission denied", "choose a folder you can write to")
    assert listing(tmp_path) == []


def test_a_failed_rename_over_an_earlier_output_puts_it_back(tmp_path, sources, monkeypatch):
    out = tmp_path / "out"
    assert run("convert", out, sources).exit_code == 0
    before, names = tree_hash(out), listing(tmp_path)
    refuse_for_partial(monkeypatch, "rename")
    assert_refused(run("convert", out, sources, "-n", "2", "--overwrite"), str(out), "permission denied")
    assert tree_hash(out) == before and listing(tmp_path) == names  # no OUT.moeify-old, no OUT.moeify-partial


@pytest.mark.parametrize("command", COMMANDS)
def test_the_disk_filling_mid_shard(command, tmp_path, sources, monkeypatch):
    real, written = ShardWriter._open, []

    def nearly_full(self, path):
        written.append(path)
        return FullDisk(real(self, path), room=20_000)  # the header and a few tensors: the shard is larger

    monkeypatch.setattr(ShardWriter, "_open", nearly_full)
    out = tmp_path / "out"
    shard = out.with_name(out.name + PARTIAL_SUFFIX) / "model.safetensors"  # where the disk filled, named
    assert_refused(run(command, out, sources), str(out), "no space left on the device", str(shard),
                   "free some space or write the output to another disk")
    assert written and listing(tmp_path) == []


def test_an_os_error_of_another_path_is_not_the_outputs(tmp_path):
    """A source's read error inside the output's write passes through as it is (not blamed on the output), as does
    one of a sibling whose name only begins like OUT's; OUT's parent, OUT and OUT.moeify-* are the output's."""
    out = tmp_path / "out"
    for other in (tmp_path / "src" / "model.safetensors", tmp_path / "out2" / "x", tmp_path / "outer.moeify-partial"):
        error = OSError(errno.EIO, os.strerror(errno.EIO), str(other))
        with pytest.raises(OSError) as raised, output_errors(out):
            raise error
        assert raised.value is error
    for own in (tmp_path, out / "config.json", tmp_path / "out.moeify-old" / "x", tmp_path / "out.moeify-tune"):
        with pytest.raises(MoeifyError, match="could not be written: Input/output error"), output_errors(out):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(own))


@pytest.fixture(scope="module")
def tunable(tmp_path_factory, tokenizer_dir, sources) -> dict[str, Path]:
    """A carve of source a (its dense model beside it) and an upcycle of it, each for `tune` to rewrite in place."""
    from conftest import corpus_text
    from moeify.formats.config import build_config
    from moeify.carving.conversion import plan_conversion, run_conversion
    from moeify.upcycling.upcycle import UpcycleSettings, plan_upcycle, run_upcycle
    from tuning_fixtures import CARVE

    root = tmp_path_factory.mktemp("tunable")
    run_conversion(plan_conversion(sources[0], build_config(**CARVE)), root / "carve")
    run_upcycle(plan_upcycle(sources[0], UpcycleSettings(copies=2, top_k=2, symmetry="drop")), root / "upcycle")
    (root / "train.txt").write_text(corpus_text(6000))
    return {"dense": sources[0], "carve": root / "carve", "upcycle": root / "upcycle", "text": root / "train.txt"}


TUNES = {  # the command line that tunes `out` in place
    "tune": lambda out, t: ["tune", t["dense"], out, "--tokens", "1024", "--tune-generated", "0"],
    "tune --tune-text": lambda out, t: ["tune", out, "--tune-text", t["text"], "--tokens", "64"],
}


@pytest.mark.parametrize("where", ["output", "state"])
@pytest.mark.parametrize("command", TUNES)
def test_the_disk_filling_while_tune_writes_leaves_the_output_as_it_was(command, where, tmp_path, tunable,
                                                                         monkeypatch):
    """tune rewrites OUT in place, and saves its state in OUT.moeify-tune as it goes: the disk filling in a shard of
    either is one line naming OUT and the file, and OUT stays as it was, with no OUT.moeify-partial beside it."""
    import shutil

    out = Path(shutil.copytree(tunable["carve" if command == "tune" else "upcycle"], tmp_path / "out"))
    before = tree_hash(out)
    real, filled = ShardWriter._open, []
    marker = PARTIAL_SUFFIX if where == "output" else ".moeify-tune"

    def nearly_full(self, path):
        if marker not in str(path):
            return real(self, path)
        filled.append(path)
        return FullDisk(real(self, path), room=20_000)

    monkeypatch.setattr(ShardWriter, "_open", nearly_full)
    res = CliRunner().invoke(app, [str(a) for a in TUNES[command](out, tunable)])
    assert_refused(res, str(out), "no space left on the device", marker,
                   "free some space or write the output to another disk")
    assert filled and tree_hash(out) == before
    assert not out.with_name(out.name + PARTIAL_SUFFIX).exists()
