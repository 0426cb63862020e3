"""Checkpoint writing: a streaming size-capped shard writer (and a background thread feeding it), and atomic
output directories.

The writer knows every tensor's name, dtype and shape up front (the conversion plan), so it can lay out the shards
and write each safetensors header before any data, then stream tensors one by one: the output is never held in
memory. OUT is written beside itself and renamed into place only when complete and checked.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import INDEX_NAME, PARTIAL_SUFFIX, TORCH_TO_ST, TensorInfo, is_inside
from ..errors import MoeifyError


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


def _direct_io_wanted() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get("MOEIFY_DIRECT_IO", "1") != "0"


class ShardWriter:
    """Streams tensors, in the planned order, into the planned shard files under `out_dir`."""

    def __init__(self, out_dir: Path, layout: ShardLayout, metadata: dict[str, str] | None = None):
        self.out_dir = out_dir
        self.metadata = metadata  # extra safetensors __metadata__ entries of every shard
        self.layout = layout
        self.names = layout.file_names()
        self.order = [t for f in layout.files for t in f]
        self._next = 0  # index into self.order
        self._file_idx = -1
        self._fh = None
        self._file_end = 0
        self._staging: memoryview | None = None  # aligned buffer for O_DIRECT writes (allocated on first use)

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
        self._next += 1

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
        """O_DIRECT where the platform and filesystem allow it (MOEIFY_DIRECT_IO=0 turns it off), else buffered."""
        if _direct_io_wanted():
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


# ----------------------------------------------------------------------------------------- atomic output
#
# OUT is written as the sibling OUT.moeify-partial and renamed into place only when complete and checked, so OUT
# either does not exist or is a finished checkpoint. The partial directory holds a lock file naming the writing
# process; a partial directory whose writer is gone is a leftover (kill -9, power loss) that --overwrite removes.

LOCK_NAME = ".moeify-writing"
OLD_SUFFIX = ".moeify-old"
FREE_SPACE_MARGIN = 64 * 2**20  # bytes, plus 1% of the output: metadata, tokenizer files, report.json


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _lock_info(tmp: Path) -> dict:
    try:
        info = json.loads((tmp / LOCK_NAME).read_text())
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_writer(tmp: Path) -> int | None:
    """The pid of a still-running moeify writing `tmp` on this machine, if any."""
    info = _lock_info(tmp)
    pid = info.get("pid")
    if isinstance(pid, int) and pid != os.getpid() and info.get("host") == socket.gethostname() and _pid_alive(pid):
        return pid
    return None


def describe_leftover(tmp: Path) -> str:
    info = _lock_info(tmp)
    parts = []
    if "pid" in info:
        parts.append(f"pid {info['pid']}")
    if isinstance(info.get("started"), (int, float)):
        parts.append("started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])))
    parts.append(f"{_human(_dir_bytes(tmp))} written")
    return ", ".join(parts)


def check_output_path(out: Path, overwrite: bool, src: Path | None = None) -> None:
    """Everything about OUT that can be checked before any work. Raises MoeifyError."""
    out = Path(out)
    tmp = partial_dir(out)
    if src is not None:
        if is_inside(out, src):
            raise MoeifyError(f"output {out} is inside the source checkpoint {src}", "write the output elsewhere")
        if is_inside(src, out):
            raise MoeifyError(f"the source checkpoint {src} is inside the output {out}", "write the output elsewhere")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise MoeifyError(f"output {out} already exists", "pass --overwrite to replace it, or choose another path")
        if out.is_symlink() or not out.is_dir():
            raise MoeifyError(f"output {out} exists and is not a directory; --overwrite only replaces a directory",
                              "remove it yourself or choose another path")
        if any(out.iterdir()) and not (out / "moeify.toml").is_file():
            raise MoeifyError(f"output {out} is a non-empty directory that moeify did not write (no moeify.toml); "
                              "--overwrite only replaces earlier moeify outputs", "remove it yourself or choose another path")
    if tmp.exists() or tmp.is_symlink():
        pid = _live_writer(tmp)
        if pid is not None:
            raise MoeifyError(f"another moeify (pid {pid}) is writing {out} right now, into {tmp}",
                              "wait for it to finish, or stop it first")
        if not overwrite:
            raise MoeifyError(f"{tmp} is left over from an interrupted conversion ({describe_leftover(tmp)})",
                              "pass --overwrite to remove it and start again, or delete it yourself")


def check_free_space(out: Path, need_bytes: int, overwrite: bool = False) -> None:
    """Refuse to start when OUT's filesystem cannot hold the estimated output (plus a margin)."""
    out = Path(out).absolute()
    probe = out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    tmp = partial_dir(out)
    if overwrite and tmp.is_dir() and not tmp.is_symlink():
        free += _dir_bytes(tmp)  # the leftover is removed first
    need = need_bytes + need_bytes // 100 + FREE_SPACE_MARGIN
    if free < need:
        raise MoeifyError(f"not enough free space for {out}: the output needs about {_human(need)} "
                          f"({_human(need_bytes)} of weights plus margin), {probe} has {_human(free)} free",
                          "free some space or write the output to another disk")


def prepare_output(out: Path, overwrite: bool, src: Path | None = None) -> Path:
    """Check OUT, remove a leftover partial directory (with --overwrite), create the temporary sibling; return it."""
    out = Path(out)
    check_output_path(out, overwrite, src)
    tmp = partial_dir(out)
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()
    elif tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    lock = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "output": str(out)}
    try:
        (tmp / LOCK_NAME).write_text(json.dumps(lock) + "\n")
    except BaseException:
        discard_output(tmp)
        raise
    return tmp


def discard_output(tmp: Path) -> None:
    """Remove the temporary directory after an error or interruption."""
    shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on directories
        pass
    finally:
        os.close(fd)


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


def commit_output(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory into place (replacing OUT when --overwrite).

    Everything is fsync'ed first, so after the rename OUT is complete on disk even across a power loss.
    """
    (tmp / LOCK_NAME).unlink(missing_ok=True)
    _fsync_tree(tmp)
    if out.exists():
        old = out.with_name(out.name + OLD_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            old.rename(out)  # the earlier output back in place
            raise
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    _fsync_dir(out.parent)


# ------------------------------------------------------------------------------- OS errors on the output side

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # raised by writes only, never by a read
OUTPUT_ERRORS = {  # errno: (what went wrong, what to do)
    errno.ENOSPC: ("no space left on the device", "free some space or write the output to another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free some space or write the output to another disk"),
    errno.EFBIG: ("a file grew larger than the file system allows",
                  "pass a smaller --max-shard-size, or write the output to another disk"),
    errno.EROFS: ("the file system is read-only", "write the output to another disk"),
    errno.EACCES: ("permission denied", "choose a folder you can write to, or get write permission on it"),
    errno.EPERM: ("permission denied", "choose a folder you can write to, or get write permission on it"),
}


@contextmanager
def output_errors(out: str | Path):
    """An OSError while OUT is prepared, written and committed becomes one MoeifyError naming the path and what to
    do; the caller inside has removed what it wrote by then. One of another path (a source file) passes through."""
    try:
        yield
    except OSError as exc:
        if not _on_output_side(Path(out), exc):
            raise
        raise output_error(Path(out), exc) from exc


def _on_output_side(out: Path, exc: OSError) -> bool:
    if exc.errno in WRITE_ERRNOS:
        return True
    out = Path(os.path.abspath(out))
    return any(_is_output_path(out, name) for name in (exc.filename, exc.filename2) if name is not None)


def _is_output_path(out: Path, name) -> bool:
    """OUT, a parent of it, or inside OUT or one of its siblings OUT.moeify-* (partial, old, tune)."""
    path = Path(os.path.abspath(os.fsdecode(name)))
    if path in out.parents:
        return True
    top = path.relative_to(out.parent).parts[:1] if path.is_relative_to(out.parent) else ()
    return bool(top) and (top[0] == out.name or top[0].startswith(out.name + ".moeify-"))


def output_error(out: Path, exc: OSError) -> MoeifyError:
    """The one-line error of an OSError on OUT's side: what failed, where, and what to do."""
    where = os.fsdecode(exc.filename) if exc.filename is not None else str(out)
    if exc.errno == errno.ENOTDIR:
        blocker = next((p for p in reversed(Path(os.path.abspath(out)).parents) if p.exists() and not p.is_dir()),
                       None)
        return MoeifyError(f"the output {out} cannot be created: {blocker or where} is a file, not a directory",
                           "choose an output path whose parent folders are directories")
    what, hint = OUTPUT_ERRORS.get(exc.errno, (exc.strerror or str(exc), "check the output path and its disk"))
    return MoeifyError(f"the output {out} could not be written: {what} ({where})", hint)
