"""The output directory: OUT written beside itself as OUT.moeify-partial (a lock file naming its writer), its free
space and path checked first, fsync'ed and renamed into place when complete and checked; an OS error on the output
side made one line; and the pipeline every stage writes an output through (`staged_output`, `write_shards`,
`write_metadata`), so that the order, the atomicity and the error handling exist once.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from .card import copy_licence, write as write_card
from .checkpoint import PARTIAL_SUFFIX, is_inside
from .families import TOKENIZER_FILES
from .writer import WRITE_AHEAD_BYTES, BackgroundWriter, ShardLayout, ShardWriter, WrittenReader, check_written
from ..errors import MoeifyError


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


# ------------------------------------------------------------------------------------------------ the pipeline
#
# Every stage writes its output the same way: the path and the disk checked, OUT.moeify-partial prepared
# (`staged_output`), the tensors streamed into shards and their headers checked (`write_shards`), the metadata
# (config, tokenizer, moeify.toml, report.json, licence, card: `write_metadata`), the stage's own checks, and
# `commit_output`. An OS error on the output side anywhere in it is one MoeifyError naming OUT, and nothing is left.


@contextmanager
def staged_output(out: Path, overwrite: bool, src: Path | None = None, need_bytes: int | None = None):
    """OUT.moeify-partial, after OUT's path (and, given `need_bytes`, its disk's free space) are checked; removed
    if the block raises. The block writes it and commits it (commit_output) or moves it where it belongs."""
    out = Path(out)
    check_output_path(out, overwrite, src)
    if need_bytes is not None:
        check_free_space(out, need_bytes, overwrite)
    with output_errors(out):
        tmp = prepare_output(out, overwrite, src)
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def write_shards(tmp: Path, layout: ShardLayout, fill, *, background: bool = True, follow=None):
    """The planned shards of `layout` written into `tmp` by `fill(writer)` (which writes every planned tensor in
    order, through a background thread unless `background` is False), and their headers checked against the plan;
    returns what `fill` returns. A failure aborts the writer (its thread stopped, its files closed) and raises.

    follow(reader): run on a thread of its own while the shards are written, on a WrittenReader of them (each tensor
    readable once written: the end-of-run check, a layer behind the writer); then the return value is
    (fill's, follow's). follow's exception stops a background writer (fill's next write raises it), else it is
    raised once the writer has finished."""
    writer = ShardWriter(tmp, layout)
    reader = WrittenReader(writer) if follow is not None else None
    if background:
        writer = BackgroundWriter(writer, max_pending=WRITE_AHEAD_BYTES)
    followed = None if follow is None else _Following(follow, reader, writer.fail if background else None)
    try:
        result = fill(writer)
        writer.finish()
    except BaseException as exc:
        writer.abort()
        if followed is not None:
            followed.stop(f"the writer stopped ({type(exc).__name__})")
        raise
    try:
        check_written(tmp, [t for f in layout.files for t in f])
    except BaseException:
        if followed is not None:
            followed.stop("the output's headers failed their check")
        raise
    return result if followed is None else (result, followed.result())


class _Following:
    """follow(reader) on a thread (write_shards), its result or exception kept for the writer's side to take."""

    def __init__(self, follow, reader, on_error=None):
        import threading

        self.reader, self.on_error, self._value, self._error = reader, on_error, None, None
        self._thread = threading.Thread(target=self._run, args=(follow,), name="moeify-check", daemon=True)
        self._thread.start()

    def _run(self, follow) -> None:
        try:
            self._value = follow(self.reader)
        except BaseException as exc:  # noqa: BLE001 - raised on the writer's side by result()
            self._error = exc
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self.reader.close()

    def stop(self, why: str) -> None:
        self.reader.fail(why)
        self._thread.join()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def write_metadata(tmp: Path, src: Path, *, report: dict, toml: str, config_json: dict | None = None) -> None:
    """Everything but the weights: config.json (unless written already), the tokenizer files of `src`,
    moeify.toml, report.json, `src`'s licence files, and the model card drawn from them (written last)."""
    if config_json is not None:
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        f = src / name
        if f.is_file():
            shutil.copyfile(f, tmp / name)
    (tmp / "moeify.toml").write_text(toml)
    (tmp / "report.json").write_text(json.dumps(report) + "\n")
    copy_licence(src, tmp)
    write_card(tmp, name=tmp.name.removesuffix(PARTIAL_SUFFIX))
