"""The end-of-run check follows the writer (moeify.formats.output.write_shards(follow=...), WrittenReader): each
tensor is read back from its file as soon as it is written, the rest still being written; a writer that fails wakes
the reader; the check's own failure stops the writer at its next write; O_DIRECT shards are read after their
close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moeify.formats.checkpoint import CheckpointReader, NotWritten, TensorInfo
from moeify.formats.output import write_shards
from moeify.formats.writer import ShardLayout

WAIT = 20.0  # seconds a test waits for the other thread before it fails


def _tensors(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(16 + i, 8, generator=g).to(torch.bfloat16) for i in range(n)}


def _layout(tensors: dict[str, torch.Tensor], shard_bytes: int) -> ShardLayout:
    return ShardLayout.plan([TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], shard_bytes)


def test_each_tensor_is_read_back_while_the_rest_is_being_written(tmp_path):
    tensors = _tensors()
    layout = _layout(tensors, 700)  # 3 shards
    assert len(layout.files) == 3
    read = {name: threading.Event() for name in tensors}

    def follow(reader):
        got = {}
        for name in tensors:
            got[name] = reader.get(name)
            read[name].set()
        return got

    def fill(writer):
        for name, t in tensors.items():
            writer.write(name, t)
            # the next tensor is written only once this one was read back: a reader that waited for the whole
            # output would leave this wait to time out
            assert read[name].wait(WAIT), f"{name} was not read back while the output was being written"

    _, got = write_shards(tmp_path, layout, fill, follow=follow)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    on_disk = CheckpointReader(tmp_path)
    assert all(torch.equal(on_disk.get(n), t) for n, t in tensors.items())


def test_a_writer_that_fails_wakes_the_reader_and_its_error_is_raised(tmp_path):
    tensors = _tensors()
    names = list(tensors)
    seen = {}

    def follow(reader):
        try:
            reader.prefetch([names[-1]])  # the read-ahead thread waits too
            return reader.get(names[-1])
        except NotWritten as exc:
            seen["error"] = str(exc)
            raise

    def fill(writer):
        for name in names[:2]:
            writer.write(name, tensors[name])
        raise ValueError("the disk is full")

    t0 = time.time()
    with pytest.raises(ValueError, match="the disk is full"):
        write_shards(tmp_path, _layout(tensors, 700), fill, follow=follow)
    assert time.time() - t0 < WAIT
    assert names[-1] in seen["error"] and "the writer stopped (ValueError)" in seen["error"]


def test_the_checks_failure_stops_the_writer(tmp_path):
    tensors = _tensors()
    names, written, failed = list(tensors), [], threading.Event()

    def follow(reader):
        reader.get(names[0])
        failed.set()
        raise RuntimeError("upcycle check failed: the copies' logits differ")

    def fill(writer):
        writer.write(names[0], tensors[names[0]])
        written.append(names[0])
        assert failed.wait(WAIT)
        for name in names[1:]:
            time.sleep(0.2)  # the check's failure reaches the writer meanwhile
            writer.write(name, tensors[name])
            written.append(name)

    with pytest.raises(RuntimeError, match="logits differ"):
        write_shards(tmp_path, _layout(tensors, 700), fill, follow=follow)
    assert len(written) < len(names)  # stopped at the next write, not at the end


def test_o_direct_shards_are_read_once_each_is_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_DIRECT_IO", "1")
    tensors = _tensors()
    layout = _layout(tensors, 700)
    _, got = write_shards(tmp_path, layout, lambda w: [w.write(n, t) for n, t in tensors.items()],
                          follow=lambda reader: {n: reader.get(n) for n in tensors})
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
