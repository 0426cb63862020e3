"""Checkpoint writing: a streaming size-capped shard writer (and a background thread feeding it); the output
directory it writes into is moeify.formats.output's.

The writer knows every tensor's name, dtype and shape up front (the conversion plan), so it can lay out the shards
and write each safetensors header before any data, then stream tensors one by one: the output is never held in
memory. OUT is written beside itself and renamed into place only when complete and checked.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import INDEX_NAME, TORCH_TO_ST, CheckpointReader, NotWritten, TensorInfo


# ----------------------------------------------------------------------------------------------- writing


WRITE_AHEAD_BYTES = 512 << 20  # output bytes queued for the writer thread while the next layer is made


@dataclass
class ShardLayout:
    """Which tensor goes to which output file, decided before any data is written."""

    files: list[list[TensorInfo]]

    @classmethod
    def plan(cls, tensors: list[TensorInfo], max_shard_bytes: int) -> "ShardLayout":
        files: list[list[TensorInfo]] = [[]]
        size = 0
        for t in tensors:
            if files[-1] and size + t.nbytes > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(t)
            size += t.nbytes
        return cls(files)

    def file_names(self) -> list[str]:
        n = len(self.files)
        if n == 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def total_bytes(self) -> int:
        return sum(t.nbytes for f in self.files for t in f)


def _header_bytes(tensors: list[TensorInfo], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw


WRITE_CHUNK = 64 << 20  # bytes per write() call
DIRECT_ALIGN = 4096  # O_DIRECT needs block-aligned buffers, offsets and lengths


class _DirectFile:
    """Write-only file opened with O_DIRECT: bytes are gathered in an aligned staging buffer and written in whole
    blocks straight to the disk, bypassing the page cache (no kernel copy into freshly allocated cache pages and
    no dirty-page writeback of the whole output). flush() writes the zero-padded last block and truncates the
    file to its true length; after it only fileno() and close() may be used."""

    def __init__(self, path: Path, staging: memoryview):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        self._buf, self._fill, self._size = staging, 0, 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, len(self._buf) - self._fill)
            self._buf[self._fill:self._fill + take] = data[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == len(self._buf):
                self._write_block(self._fill)

    def _write_block(self, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            try:
                done += os.write(self._fd, self._buf[done:nbytes])
            except OSError as exc:  # a filesystem that accepted O_DIRECT at open but not for writes
                import fcntl

                if exc.errno != errno.EINVAL or not fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_DIRECT:
                    raise
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._size += self._fill
        self._fill = 0

    def flush(self) -> None:
        if self._fd < 0 or self._buf is None:
            return
        size = self._size + self._fill
        if self._fill:
            padded = -(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN
            self._buf[self._fill:padded] = bytes(padded - self._fill)
            self._write_block(padded)
        os.ftruncate(self._fd, size)
        self._size, self._buf = size, None

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _available_memory() -> int | None:
    """The memory the kernel can give without swapping (MemAvailable: free pages plus the reclaimable cache), else
    this machine's RAM; None when neither is known."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _direct_io_wanted(total_bytes: int) -> bool:
    """Whether the shards go to the disk with O_DIRECT: for an output larger than half the memory available (a
    7B-70B one on most machines: no kernel copy into fresh cache pages, no writeback of the whole output to wait for
    at the end), not for a smaller one, which stays in the page cache for the end-of-run check to read back
    (commit_output fsyncs it to the disk either way). MOEIFY_DIRECT_IO=1 or 0 forces either."""
    forced = os.environ.get("MOEIFY_DIRECT_IO")
    if not hasattr(os, "O_DIRECT") or forced == "0":
        return False
    if forced == "1":
        return True
    available = _available_memory()
    return available is None or 2 * total_bytes > available


class ShardWriter:
    """Streams tensors, in the planned order, into the planned shard files under `out_dir`."""

    def __init__(self, out_dir: Path, layout: ShardLayout, metadata: dict[str, str] | None = None):
        self.out_dir = out_dir
        self.on_readable = None  # called with n: the first n planned tensors can be read back from the files
        self.metadata = metadata  # extra safetensors __metadata__ entries of every shard
        self.layout = layout
        self.names = layout.file_names()
        self.order = [t for f in layout.files for t in f]
        self._next = 0  # index into self.order
        self._file_idx = -1
        self._fh = None
        self._file_end = 0
        self._staging: memoryview | None = None  # aligned buffer for O_DIRECT writes (allocated on first use)
        self._direct = _direct_io_wanted(layout.total_bytes())  # decided once: every shard of an output alike

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self._next]
        if name != expected.name or tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
            raise RuntimeError(
                f"writer got {name} {tuple(tensor.shape)} {tensor.dtype}, plan expects "
                f"{expected.name} {expected.shape} {expected.dtype}"
            )
        with self._naming_the_shard():
            if self._fh is None or self._next >= self._file_end:
                self._start_next_file()
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():  # the tensor's own buffer, no bytes copy; chunks keep each write() call bounded
                buf = memoryview(data.view(torch.uint8).numpy())
                for start in range(0, len(buf), WRITE_CHUNK):
                    self._fh.write(buf[start:start + WRITE_CHUNK])
            followed = self.on_readable is not None and not isinstance(self._fh, _DirectFile)  # O_DIRECT: at close
            if followed:
                self._fh.flush()  # out of Python's buffer: a reader of the file sees it
        self._next += 1
        if followed:
            self.on_readable(self._next)

    @contextmanager
    def _naming_the_shard(self):
        """An OSError of a write to an open file (ENOSPC, EIO) names no file: give it the shard's path."""
        try:
            yield
        except OSError as exc:
            if exc.filename is None and self._file_idx >= 0:
                exc.filename = str(self.out_dir / self.names[self._file_idx])
            raise

    def _start_next_file(self) -> None:
        self._close_file()
        self._file_idx += 1
        tensors = self.layout.files[self._file_idx]
        self._file_end = self._next + len(tensors)
        self._fh = self._open(self.out_dir / self.names[self._file_idx])
        self._fh.write(_header_bytes(tensors, self.metadata))

    def _open(self, path: Path):
        """O_DIRECT for a large output where the platform and filesystem allow it (_direct_io_wanted), else
        buffered."""
        if self._direct:
            if self._staging is None:
                raw = np.empty(WRITE_CHUNK + DIRECT_ALIGN, dtype=np.uint8)
                start = -raw.ctypes.data % DIRECT_ALIGN
                self._staging = memoryview(raw[start:start + WRITE_CHUNK])
            try:
                return _DirectFile(path, self._staging)
            except OSError:
                pass  # e.g. tmpfs: EINVAL
        return open(path, "wb")

    def finish(self) -> None:
        if self._next != len(self.order):
            raise RuntimeError(f"writer finished after {self._next} of {len(self.order)} planned tensors")
        with self._naming_the_shard():
            self._close_file()
        if len(self.names) > 1:
            weight_map = {t.name: self.names[i] for i, f in enumerate(self.layout.files) for t in f}
            index = {"metadata": {"total_size": self.layout.total_bytes()}, "weight_map": weight_map}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def _close_file(self) -> None:
        """Flush and fsync the current shard before closing it, so a committed output is on disk."""
        if self._fh is not None:
            self._fh.flush()
            if self.on_readable is not None and isinstance(self._fh, _DirectFile):
                self.on_readable(self._next)
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class BackgroundWriter:
    """A ShardWriter driven by a thread, so the caller carves the next layer while the disk writes this one.

    write() hands the tensor over and returns; at most `max_pending` bytes wait in the queue (the caller blocks
    beyond that, so memory stays bounded). The tensors must not be modified after write(). A failure on the
    thread is raised by the next write(), finish() or abort().
    """

    def __init__(self, writer: ShardWriter, max_pending: int = 1 << 30):
        import queue
        import threading

        self.writer, self.max_pending = writer, max_pending
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moeify-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, tensor, nbytes = item
            try:
                if self._error is None:
                    self.writer.write(name, tensor)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = exc
            del tensor, item
            with self._cond:
                self._pending -= nbytes
                self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def fail(self, exc: BaseException) -> None:
        """Stop from another thread (the check following the writer failed): what is queued is skipped and the
        caller's next write() raises exc."""
        with self._cond:
            self._error = self._error or exc
            self._cond.notify_all()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._raise()
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0 or self._pending + nbytes <= self.max_pending
                                or self._error is not None)
            self._pending += nbytes
        self._queue.put((name, tensor, nbytes))

    def _drain(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def finish(self) -> None:
        self._drain()
        self._raise()
        self.writer.finish()

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")  # the thread skips what is still queued
        self._drain()
        self.writer.abort()


class WrittenReader(CheckpointReader):
    """The output a ShardWriter is writing, read as it is written: the shards' layout is the writer's plan, and
    get() (and the read-ahead thread) wait until the writer has made a tensor's bytes readable from its file, so
    that the end-of-run check follows the writer a layer behind instead of starting when the last shard is closed.
    A writer that fails or is stopped (fail()) wakes every wait with NotWritten."""

    def __init__(self, writer: ShardWriter):
        self.root, self.allow_nonfinite, self.scan_nonfinite = writer.out_dir, False, False  # its sources were scanned
        self.nonfinite, self.pickled = {}, False
        self.tensors, self.file_of, self._span, self._position = {}, {}, {}, {}
        for name, tensors in zip(writer.names, writer.layout.files):
            offset = len(_header_bytes(tensors, writer.metadata))
            for t in tensors:
                self.tensors[t.name], self.file_of[t.name] = t, writer.out_dir / name
                self._span[t.name] = (offset, offset + t.nbytes)
                self._position[t.name] = len(self._position)
                offset += t.nbytes
        self._init_reads()
        self._cond = threading.Condition()
        self._readable, self._failed = 0, None
        writer.on_readable = self.readable

    def readable(self, n: int) -> None:
        """The writer's call: its first n planned tensors are in their files."""
        with self._cond:
            self._readable = n
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """The writer stopped: what it has not written will never be (every wait ends with NotWritten)."""
        with self._cond:
            self._failed = why
            self._cond.notify_all()

    def _wait(self, name: str) -> None:
        pos = self._position[name]
        with self._cond:
            self._cond.wait_for(lambda: self._readable > pos or self._failed is not None)
            if self._readable <= pos:
                raise NotWritten(f"{name} was not written to {self.file_of[name]}: {self._failed}")

    def close(self) -> None:
        self.fail("the reader was closed")  # a read-ahead still waiting ends now
        super().close()


def write_attention(writer, reader, src, fmt: str, layer_idx: int, dtype: torch.dtype,
                    tuned: dict[str, torch.Tensor] | None = None) -> None:
    """Layer layer_idx's attention and norm weights (the source's, or `tuned` ones by name without `.weight`) and the
    target format's q/k/v biases (a Qwen2 source's own, zeros for a Llama's), in the order the plans list them."""
    from .families import attention_extras

    p = f"model.layers.{layer_idx}."
    for name in (n + ".weight" for n in src.attention_tensors):
        t = (tuned or {}).get(name.removesuffix(".weight"))
        writer.write(p + name, (reader.get(p + name) if t is None else t).to(dtype))
    for name, shape in attention_extras(fmt, src, layer_idx):
        writer.write(name, reader.get(name).to(dtype) if src.qkv_bias else torch.zeros(shape, dtype=dtype))


def write_head(writer, reader, src, tied_out: bool, dtype: torch.dtype) -> None:
    """The final norm, and lm_head unless the output keeps the embeddings tied (a tied source's copy otherwise)."""
    writer.write("model.norm.weight", reader.get("model.norm.weight").to(dtype))
    if not tied_out:
        name = "lm_head.weight" if "lm_head.weight" in reader.tensors and not src.tied else "model.embed_tokens.weight"
        writer.write("lm_head.weight", reader.get(name).to(dtype))


def check_written(out_dir: Path, tensors: list[TensorInfo]) -> None:
    """Cheap check of what was written: every planned tensor in the shard headers with its shape and dtype, and
    nothing else."""
    from .checkpoint import CheckpointReader

    written = CheckpointReader(out_dir).tensors
    for t in tensors:
        got = written.get(t.name)
        if got is None or got.shape != t.shape or got.dtype != t.dtype:
            raise RuntimeError(f"output check failed for {t.name}: planned {t.shape} {t.dtype}, wrote {got}")
    if len(written) != len(tensors):
        raise RuntimeError(f"output check failed: {len(written)} tensors written, {len(tensors)} planned")
