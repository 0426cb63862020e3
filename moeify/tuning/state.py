"""The resumable state of a tuning run, `OUT.moeify-tune/` beside OUT, and its files.

    run.json                 what the run is: source and base fingerprints, settings, seeds, the base's path
    lock.json                the process tuning into it now (pid, host)
    carved/                  (convert only) the untuned carve the run starts from
    sampled/batch-NNNNN.*    the dense model's own text, one file per sampling batch, with the teacher's final
                             hidden states on it (the tuning targets of those windows, kept from the sampling)
    data.json                what the tuning text is (its sources, windows, held-out counts, sampling batch size)
    data.safetensors         the tuning text: training and held-out windows (once assembled)
    targets/batch-NNNNN.*    the teacher pass: the teacher's final hidden states of the real windows the run draws
    state.json               the last saved snapshot's step and metadata (replaced atomically)
    state-STEP.safetensors   that snapshot's tensors; best-STEP.safetensors the best checked weights

Every file is written atomically (a temporary name, fsync, rename), so a kill at any moment leaves the last complete
state. Snapshots are saved every `save_every` seconds, at the last step, and when SIGINT or SIGTERM asks the run to
stop (at the end of the step in progress; a second signal stops at once). The state names its source and base by
fingerprint (sampled chunks of every weight file and the configs: cheap at any size) and its settings; `--resume`
refuses a state that does not match them, and one whose files are damaged (check_resumable), naming the file and
offering --restart. The directory is removed when the tuned output is committed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..formats.checkpoint import INDEX_NAME, TensorInfo, hash_files, weights_fingerprint
from ..formats.writer import ShardLayout, ShardWriter
from ..errors import MoeifyError
from .options import TuneOptions, TuningInterrupted

TUNE_SUFFIX = ".moeify-tune"
STATE_VERSION = 1
SAVE_EVERY = 600.0  # seconds between saved states (and one at the last step, and on SIGINT / SIGTERM)


def state_dir(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + TUNE_SUFFIX)


def source_fingerprint(src: Path) -> str:
    h = hashlib.sha256()
    hash_files(h, Path(src), ["config.json"])
    weights_fingerprint(h, Path(src))
    return h.hexdigest()[:32]


def base_fingerprint(base: Path) -> str:
    h = hashlib.sha256()
    hash_files(h, Path(base), ["config.json", "report.json", "moeify.toml", INDEX_NAME])
    weights_fingerprint(h, Path(base))
    return h.hexdigest()[:32]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _stream_save(tensors: dict, path: Path, write: bool) -> None:
    """Save a state's tensors (moeify.training.distill.Pending ones produced one at a time, in order, on every rank) to
    `path` atomically, streaming: the writer holds one whole tensor at a time, never the state. write False: only
    take part in the gathering."""
    from ..training.steps import Pending

    writer = tmp = None
    if write:
        tmp = path.with_name(path.name + ".writing")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        infos = [TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
        writer = ShardWriter(tmp, ShardLayout([infos]))
    try:
        for k, v in tensors.items():
            value = v.produce() if isinstance(v, Pending) else v
            if writer is not None:
                writer.write(k, value)
            del value
        if writer is not None:
            writer.finish()
            os.replace(tmp / "model.safetensors", path)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class SavedTensors:
    """The tensors of a saved safetensors file, each read when it is asked for (a resumed or finishing run reads one
    tensor at a time into its shard, not the whole state at once: across processes every rank reads it)."""

    def __init__(self, path: Path):
        self._file = safe_open(str(path), "pt")
        self._names = set(self._file.keys())

    def __contains__(self, name) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def pop(self, name: str) -> torch.Tensor:
        value = self[name]
        self._names.discard(name)
        return value

    def keys(self):
        return set(self._names)


class TuningState:
    """The state directory's snapshots: moeify.training.distill.distill's `state` (keep / kept / checkpoint)."""

    def __init__(self, root: Path, save_every: float = SAVE_EVERY, par=None):
        from ..training.parallel import Parallel

        self.root, self.save_every, self.par = Path(root), save_every, par or Parallel()
        self.stop_requested = False
        self._best: str | None = None
        self._last = time.time()

    def keep(self, tensors: dict, step: int) -> None:
        name = f"best-{step}.safetensors"
        _stream_save(tensors, self.root / name, self.par.main)  # on every rank: the gathering is a collective
        self._best = name

    def kept(self) -> SavedTensors:
        self.par.arrive("reading the kept weights")  # rank 0 has written them
        return SavedTensors(self.root / self._best)

    def checkpoint(self, step: int, total: int, snapshot) -> None:
        """Save the run's state when it is due: every save_every seconds, at the last step, on a stop request (and
        then stop). The snapshot file is written first, state.json (which names it) replaced atomically after, and
        only then are older snapshots removed: a kill at any moment leaves one complete state."""
        due = self.stop_requested or step == total or time.time() - self._last >= self.save_every
        if self.par.on:  # rank 0's clock decides, any rank's stop request counts
            due = self.par.any(due if self.par.main else self.stop_requested)
            self.stop_requested = self.par.any(self.stop_requested)
        if not due:
            return
        self.par.arrive("saving a snapshot")
        tensors, meta = snapshot()  # on every rank: gathering sharded tensors is a collective
        meta["best_file"] = self._best
        name = f"state-{step}.safetensors"
        _stream_save(tensors, self.root / name, self.par.main)
        if self.par.main:
            _atomic_write(self.root / "state.json", json.dumps({"version": STATE_VERSION, "file": name,
                                                                "meta": meta}).encode())
            for f in self.root.glob("*.safetensors"):
                if f.name.startswith(("state-", "best-")) and f.name not in (name, self._best):
                    f.unlink(missing_ok=True)
        self.par.arrive("the end of a snapshot", then=f"the tuning loop (after step {step:,})")
        self._last = time.time()
        if self.stop_requested and step < total:
            raise TuningInterrupted(step, total)

    def load(self) -> tuple[dict, dict] | None:
        """The last saved snapshot (its tensors, read on demand, and its metadata), None before the first save.
        Across processes rank 0 reads state.json and every rank resumes from what it found (a fresh run runs
        collectives a resumed one skips: no rank decides that from its own look at a file rank 0 writes)."""
        saved = self.par.share(lambda: read_snapshot(self.root))
        if saved is None:
            return None
        self._best = saved["meta"]["best_file"]
        return SavedTensors(self.root / saved["file"]), saved["meta"]

    def progress(self) -> tuple[int, int] | None:
        try:
            meta = json.loads((self.root / "state.json").read_text())["meta"]
            return meta["step"], meta["total"]
        except (OSError, ValueError, KeyError):
            return None


@contextlib.contextmanager
def _stop_on_signal(state: TuningState, notify: Callable[[str], None] | None):
    """SIGINT / SIGTERM: the first asks the run to save and stop at the end of its step; a second stops at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if state.stop_requested:
            raise KeyboardInterrupt
        state.stop_requested = True
        if notify:
            notify("stopping: saving the tuning state at the end of this step (signal again to stop at once)")

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _lock(root: Path) -> None:
    from ..formats.output import _pid_alive

    f = root / "lock.json"
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        info = {}
    pid = info.get("pid")
    if isinstance(pid, int) and pid != os.getpid() and info.get("host") == socket.gethostname() and _pid_alive(pid):
        raise MoeifyError(f"another moeify (pid {pid}) is tuning into {root} right now", "wait for it, or stop it first")
    _atomic_write(f, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())


def describe_state(root: Path) -> str:
    try:
        run = json.loads((root / "run.json").read_text())
        tokens, created = int(run["options"]["tokens"]), float(run["created"])
    except (OSError, ValueError, TypeError, KeyError):
        return "its run.json is unreadable"
    done = TuningState(root).progress()
    steps = f"step {done[0]:,} of {done[1]:,} saved" if done else "no step saved yet"
    return f"{tokens:,} tokens, {steps}, started {time.strftime('%Y-%m-%d %H:%M', time.localtime(created))}"


def resume_command(src: Path, out: Path) -> str:
    """The command that continues this run: a source from the Hub cache by its id at the commit the run began from
    (what the user typed, and the same weights), not by the cache's snapshot folder."""
    from ..formats.hub import hub_origin

    origin = hub_origin(src)
    return f"moeify tune {f'{origin[0]}@{origin[1]}' if origin else src} {out} --resume"


def refuse_leftover_state(out: Path, src: Path, overwrite: bool) -> None:
    """convert: an interrupted tuning of OUT is resumed with `moeify tune --resume`, or discarded with --overwrite."""
    root = state_dir(out)
    if root.exists():
        if not overwrite and (root / "run.json").is_file():
            raise MoeifyError(f"{root} holds an interrupted tuning of this output ({describe_state(root)})",
                              f"continue it with: {resume_command(src, out)}; or pass --overwrite to start again")
        shutil.rmtree(root)


# ------------------------------------------------------------------------------------------ checking a saved state

RESTART = "start anew with --restart (it discards the interrupted run's saved work)"
RUN_FIELDS = {"version": int, "created": (int, float), "source": str, "base": str, "base_fingerprint": str,
              "options": dict, "seed": int, "run_index": int}


def _damaged(f: Path, why: str) -> MoeifyError:
    return MoeifyError(f"the interrupted tuning's {f.name} is damaged ({why}): {f}", RESTART)


def _json_file(f: Path) -> dict:
    try:
        value = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _damaged(f, str(exc).split("\n")[0] or exc.__class__.__name__) from None
    if not isinstance(value, dict):
        raise _damaged(f, "not a JSON object")
    return value


def read_run(root: Path) -> dict:
    """run.json of an interrupted run, every field --resume reads checked (a damaged file is refused by name)."""
    f = root / "run.json"
    run = _json_file(f)
    if run.get("version") != STATE_VERSION and isinstance(run.get("version"), int):
        raise MoeifyError(f"{root} was written by another version of moeify", RESTART)
    for key, kind in RUN_FIELDS.items():
        if not isinstance(run.get(key), kind) or isinstance(run.get(key), bool):
            raise _damaged(f, f"no valid {key!r}")
    if run["base"] not in ("carved", "out"):
        raise _damaged(f, f"base {run['base']!r} is neither 'carved' nor 'out'")
    micro = run.get("micro_windows", 1)
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1 or run.get("teacher", "pass") not in (
            "pass", "inline"):
        raise _damaged(f, "no valid micro_windows or teacher")
    return run


def read_snapshot(root: Path) -> dict | None:
    """state.json (None before the first snapshot), checked against the snapshot and best-weights files it names."""
    f = root / "state.json"
    if not f.is_file():
        return None
    saved = _json_file(f)
    meta = saved.get("meta")
    if (not isinstance(saved.get("file"), str) or not isinstance(meta, dict)
            or not all(isinstance(meta.get(k), int) for k in ("step", "total")) or "best_file" not in meta):
        raise _damaged(f, "no valid file, step, total or best_file")
    for name in (saved["file"], meta["best_file"]):
        if name is not None and not re.fullmatch(r"(state|best)-\d+\.safetensors", str(name)):
            raise _damaged(f, f"it names {name!r}, not a snapshot file of this directory")
        if name is not None:
            check_tensor_file(root / name, f"named by {f.name}")
    return saved


def check_tensor_file(f: Path, why: str = "") -> None:
    """A saved tensor file opens: its safetensors header is whole and its data as long as the header says."""
    if not f.is_file():
        raise _damaged(f, f"missing{', ' + why if why else ''}")
    try:
        with safe_open(str(f), "pt"):
            pass
    except (SafetensorError, OSError, ValueError) as exc:
        raise _damaged(f, str(exc).split("\n")[0]) from None


def check_resumable(root: Path) -> dict:
    """Every file an interrupted run resumes from, checked before any work: run.json, state.json and the snapshot
    files it names, and the tuning text, sampling batches and teacher targets saved so far (headers and lengths;
    a file is written whole or not at all, so a damaged one means the disk or a person changed it). Returns run.json."""
    run = read_run(root)
    read_snapshot(root)
    if (root / "data.safetensors").is_file():
        check_tensor_file(root / "data.safetensors")
        _json_file(root / "data.json")
    if (root / "sampled" / "batch.json").is_file():
        size = _json_file(root / "sampled" / "batch.json").get("sample_batch")
        if not isinstance(size, int) or size < 1:
            raise _damaged(root / "sampled" / "batch.json", "no valid sample_batch")
    for f in sorted([*root.glob("sampled/batch-*.safetensors"), *root.glob("targets/batch-*.safetensors")]):
        check_tensor_file(f)
    return run


def recorded_options(root: Path, run: dict) -> TuneOptions:
    """The options the interrupted run in `root` was started with (run.json checked by read_run)."""
    try:
        return TuneOptions.from_record(run["options"])
    except (TypeError, ValueError) as exc:
        raise _damaged(root / "run.json", f"its options: {exc}") from None
