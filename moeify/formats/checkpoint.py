"""Checkpoint reading: a lazy safetensors reader, and the names, dtypes and tensor records reader and writer share
(moeify.formats.writer writes the streaming size-capped shards, moeify.formats.output the atomic output directory).

The reader reads headers only until a tensor is asked for, and keeps one shard open at a time (plus the read-ahead
thread's). It checks every shard's header and length when it opens a checkpoint, refuses pickled weights unless
asked, and NaN/Inf in any tensor it reads.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MoeifyError

SPILL_DIR = ".carve"  # inside the temporary output dir: per-layer tensors made by calibration, removed before commit

INDEX_NAME = "model.safetensors.index.json"
PARTIAL_SUFFIX = ".moeify-partial"

# safetensors dtype codes <-> torch dtypes
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def hash_files(h, root: Path, names) -> None:
    """Each named file's name and bytes (a missing one: its name alone) into the hash `h`."""
    for name in names:
        f = root / name
        h.update(name.encode())
        if f.is_file():
            h.update(f.read_bytes())


def weights_fingerprint(h, root: Path, samples: int = 16, chunk: int = 1 << 16) -> None:
    """Names, sizes and safetensors headers of every weight file, and `samples` chunks of its data spread evenly
    over it (cheap at any model size, and two models of one architecture differ in every chunk), into the hash `h`:
    what tells a model's weights apart (a tuning run's source and base, a model's cached task answers)."""
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + str(size).encode())
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(fh.read(min(n, 1 << 26)))
            for k in range(samples):
                fh.seek(8 + n + (size - 8 - n) * k // samples)
                h.update(fh.read(chunk))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _read_header(path: Path) -> dict:
    """Parse a safetensors header without loading data; clear errors for truncated/corrupt files.

    Checks what safe_open would only find out later, mid-conversion: every entry has a known dtype, a shape of
    non-negative integers, and data offsets that match the shape and lie inside the file.
    """
    size = path.stat().st_size
    fix = "the file is damaged; re-download this shard"
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise MoeifyError(f"{path} is truncated: no safetensors header", fix)
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100_000_000):
            raise MoeifyError(f"{path} has a corrupt safetensors header (length {n} > file size)", fix)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MoeifyError(f"{path} has a corrupt safetensors header (not JSON)", fix) from None
    if not isinstance(header, dict):
        raise MoeifyError(f"{path} has a corrupt safetensors header (not a JSON object)", fix)
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise MoeifyError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}",
                                  "quantized or exotic dtypes are not supported; use the bf16/fp16/fp32 release")
            shape, (start, stop) = entry["shape"], entry["data_offsets"]
            ints = [*shape, start, stop]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ints):
                raise ValueError
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if stop - start != nbytes:
                raise MoeifyError(f"{path}: tensor {name} has shape {shape} ({nbytes} bytes) but its data_offsets "
                                  f"span {stop - start} bytes", fix)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise MoeifyError(f"{path} has a corrupt safetensors header entry for {name}", fix) from None
        end = max(end, stop)
    if 8 + n + end > size:
        raise MoeifyError(f"{path} is truncated: data ends at byte {8 + n + end}, file has {size}", fix)
    return header


def is_inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def link_allowed(path: Path, root: Path) -> bool:
    """Whether `path` (possibly a symlink) stays inside the checkpoint directory `root`.

    One exception: a Hugging Face hub cache snapshot (`.../snapshots/<rev>/file -> ../../blobs/<sha>`) may
    link into its own `blobs` directory.
    """
    if is_inside(path, root):
        return True
    root = root.absolute()
    if root.parent.name == "snapshots":
        return is_inside(path, root.parent.parent / "blobs")
    return False


def check_links(root: Path, names) -> None:
    """Refuse files of the checkpoint (config, tokenizer) that are links escaping it: they would be read or copied."""
    for name in names:
        path = Path(root) / name
        if (path.exists() or path.is_symlink()) and not link_allowed(path, Path(root)):
            raise MoeifyError(f"{path} is a link that escapes {root}", "copy the real file into the checkpoint directory")


PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
NONFINITE_CHUNK = 1 << 24  # elements checked at a time (bounded temporary memory)


def first_nonfinite(t: torch.Tensor) -> tuple[int, int, float] | None:
    """(count of NaN/Inf elements, flat index of the first one, its value), or None if all are finite."""
    if not t.dtype.is_floating_point:
        return None
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return None
    lo, hi = torch.aminmax(flat)  # fast path: one reduction, no temporaries; NaN and +-Inf propagate into it
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return None
    count, first = 0, None
    for start in range(0, flat.numel(), NONFINITE_CHUNK):
        bad = ~torch.isfinite(flat[start:start + NONFINITE_CHUNK])
        n = int(bad.sum())
        if n:
            if first is None:
                first = start + int(bad.nonzero()[0, 0])
            count += n
    return None if first is None else (count, first, float(flat[first]))


def _index_str(flat: int, shape: tuple[int, ...]) -> str:
    idx = []
    for dim in reversed(shape):
        idx.append(flat % dim)
        flat //= dim
    return "[" + ", ".join(map(str, reversed(idx))) + "]"


def _read_into(fh, start: int, tensor: torch.Tensor) -> torch.Tensor:
    """Fill `tensor` with the file's bytes from offset `start` (plain reads: no mmap pages held); returns it."""
    buf = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    fh.seek(start)
    done = 0
    while done < len(buf):
        n = fh.readinto(buf[done:])
        if not n:
            raise OSError(f"file ends {len(buf) - done} bytes early")
        done += n
    return tensor


class NotWritten(RuntimeError):
    """A tensor of an output being written that its writer never wrote (it failed or was stopped)."""


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint directory (single file or sharded).

    safetensors is the format; pickled `pytorch_model*.bin` weights are read only with `allow_pickle`, and then
    only through `torch.load(weights_only=True)` (which refuses anything but tensors and plain containers).
    Every tensor is checked for NaN/Inf as it is read: a MoeifyError names it, unless `allow_nonfinite`,
    in which case it is recorded in `self.nonfinite` (name -> count) for the caller to warn about. `scan_nonfinite`
    False skips that scan: for a second read, in the process that scanned every tensor once (the upcycle check
    reading back what it wrote from scanned sources).
    """

    def __init__(self, root: str | Path, *, allow_pickle: bool = False, allow_nonfinite: bool = False,
                 scan_nonfinite: bool = True):
        self.root = Path(root)
        self.allow_nonfinite = allow_nonfinite
        self.scan_nonfinite = scan_nonfinite
        self.nonfinite: dict[str, int] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.file_of: dict[str, Path] = {}
        self._span: dict[str, tuple[int, int]] = {}  # safetensors: absolute byte range of each tensor's data
        self.pickled = False
        shards = self._shards(allow_pickle)
        for shard in shards:
            if self.pickled:
                entries = {name: (t.dtype, tuple(t.shape)) for name, t in self._load_pickle(shard).items()}
            else:
                header = _read_header(shard)
                with open(shard, "rb") as fh:
                    base = 8 + struct.unpack("<Q", fh.read(8))[0]
                entries = {name: (ST_DTYPES[e["dtype"]], tuple(e["shape"]))
                           for name, e in header.items() if name != "__metadata__"}
                self._span.update({name: (base + e["data_offsets"][0], base + e["data_offsets"][1])
                                   for name, e in header.items() if name != "__metadata__"})
            for name, (dtype, shape) in entries.items():
                if name in self.file_of and self.file_of[name] != shard:
                    raise MoeifyError(f"tensor {name} appears in both {self.file_of[name].name} and {shard.name}",
                                      "the checkpoint is inconsistent; re-download it")
                self.tensors[name] = TensorInfo(name, dtype, shape)
                self.file_of[name] = shard
        self._init_reads()

    def _init_reads(self) -> None:
        """The open-shard and read-ahead state, empty."""
        self._open_path: Path | None = None
        self._open = None
        self._pool = None  # the read-ahead thread (prefetch), started on first use
        self._ahead: dict = {}  # name -> Future of the tensor read ahead
        self._ahead_fh, self._ahead_path = None, None

    def _shards(self, allow_pickle: bool) -> list[Path]:
        index = self.root / INDEX_NAME
        if index.is_file() or index.is_symlink():
            return self._indexed_shards(index)
        shards = sorted(self.root.glob("*.safetensors"))
        if not shards:
            pickles = sorted(p for pat in ("*.bin", "*.pt", "*.pth") for p in self.root.glob(pat))
            pickle_index = self.root / PICKLE_INDEX_NAME
            if not pickles and not pickle_index.is_file():
                raise MoeifyError(f"{self.root} has no *.safetensors weights", "pass a Hugging Face checkpoint directory")
            if not allow_pickle:
                raise MoeifyError(
                    f"{self.root} has only pickle weights ({(pickles or [pickle_index])[0].name}), which can run code "
                    "when loaded",
                    "convert them to safetensors first (transformers save_pretrained(safe_serialization=True)), or "
                    "pass --allow-pickle to read them with torch.load(weights_only=True)",
                )
            self.pickled = True
            if pickle_index.is_file() or pickle_index.is_symlink():
                return self._indexed_shards(pickle_index)
            shards = [p for p in pickles if p.suffix == ".bin"] or pickles
        if len(shards) > 1:
            raise MoeifyError(f"{self.root} has {len(shards)} weight files ({shards[0].name}, ...) but no index "
                              f"({PICKLE_INDEX_NAME if self.pickled else INDEX_NAME})", "add the index file")
        if not link_allowed(shards[0], self.root):
            raise MoeifyError(f"{shards[0].name} is a link that escapes {self.root}", "copy the real file into the checkpoint")
        return shards

    def _indexed_shards(self, index: Path) -> list[Path]:
        if not link_allowed(index, self.root):
            raise MoeifyError(f"{index} is a link that escapes {self.root}", "copy the real file into the checkpoint")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise MoeifyError(f"{index} is not a valid weight index (needs a 'weight_map' of tensor -> file)",
                              "fix or re-download the index") from None
        shards = []
        for rel in files:
            if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
                raise MoeifyError(f"{index} names shard {rel!r} outside the checkpoint directory",
                                  "fix or re-download the index")
            path = self.root / rel
            if not link_allowed(path, self.root):
                raise MoeifyError(f"shard {rel} is a link that escapes {self.root}", "copy the real file into the checkpoint")
            if not path.is_file():
                raise MoeifyError(f"{index} names shard {rel}, which is missing", "re-download the checkpoint")
            shards.append(path)
        return shards

    @staticmethod
    def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
        """torch.load with weights_only=True (no code runs), memory-mapped when the file format allows it."""
        try:
            try:
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                data = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except pickle.UnpicklingError as exc:
            detail = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln), "not a plain state dict")
            raise MoeifyError(f"{path} holds more than tensors and was not loaded ({detail})",
                              "it may run code when loaded: get the safetensors release of this model") from None
        except Exception as exc:  # torch raises many types for damaged files
            raise MoeifyError(f"{path} could not be read as PyTorch weights ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})", "re-download this file") from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()):
            raise MoeifyError(f"{path} is not a state dict of named tensors", "get the safetensors release of this model")
        return data

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (opening its shard, closing the previously open one); NaN/Inf are refused."""
        path = self.file_of.get(name)
        if path is None:
            raise MoeifyError(f"tensor {name} is missing from {self.root}", "the checkpoint is incomplete or not a supported layout")
        ahead = self._ahead.pop(name, None)
        if ahead is None:
            self._wait(name)
        else:
            try:
                tensor, bad = ahead.result()
            except NotWritten:
                raise
            except Exception as exc:
                raise MoeifyError(f"tensor {name} in {path} could not be read ({exc})", "re-download this shard") from None
            return self._checked(name, path, tensor, bad)
        if path != self._open_path:
            self._close_open()
            if self.pickled:
                self._open = self._load_pickle(path)
            else:
                try:
                    self._open = open(path, "rb", buffering=0)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(self._open.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except Exception as exc:
                    raise MoeifyError(f"{path} could not be opened ({exc})", "re-download this shard") from None
            self._open_path = path
        try:
            tensor = self._open[name] if self.pickled else self._read(name, self._open)
        except Exception as exc:
            raise MoeifyError(f"tensor {name} in {path} could not be read ({exc})", "re-download this shard") from None
        return self._checked(name, path, tensor)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop (dim 0) of one tensor, reading only their bytes (a process's shard of a tensor it
        shards across processes: moeify.tuning.load_teacher); NaN/Inf are refused as in get()."""
        path, info = self.file_of.get(name), self.tensors.get(name)
        if path is None or info is None:
            raise MoeifyError(f"tensor {name} is missing from {self.root}", "the checkpoint is incomplete or not a supported layout")
        shape = (max(0, stop - start),) + tuple(info.shape[1:])
        if self.pickled:
            return self._checked(name, path, self.get(name)[start:stop].clone())
        tensor = torch.empty(shape, dtype=info.dtype)
        row = math.prod(info.shape[1:]) * tensor.element_size()
        try:
            with open(path, "rb", buffering=0) as fh:
                _read_into(fh, self._span[name][0] + start * row, tensor)
        except OSError as exc:
            raise MoeifyError(f"tensor {name} in {path} could not be read ({exc})", "re-download this shard") from None
        return self._checked(name, path, tensor)

    def _checked(self, name: str, path: Path, tensor: torch.Tensor, bad=False) -> torch.Tensor:
        """tensor, unless the scan finds NaN/Inf in it; bad: the scan's result when it ran already (read ahead)."""
        if bad is False:
            bad = first_nonfinite(tensor) if self.scan_nonfinite else None
        if bad is not None:
            count, first, value = bad
            if not self.allow_nonfinite:
                raise MoeifyError(
                    f"tensor {name} in {path.name} has {count} NaN/Inf value(s), the first {value} at "
                    f"{_index_str(first, tuple(tensor.shape))}",
                    "the checkpoint is damaged (re-download it), or pass --allow-nonfinite to convert it anyway",
                )
            self.nonfinite[name] = count
        return tensor

    def location(self, name: str) -> tuple[str, int]:
        """(shard file name, byte offset) of a tensor: sort names by it for sequential reads."""
        return self.file_of[name].name, self._span.get(name, (0, 0))[0]

    def layer_tensors(self, i: int) -> list[str]:
        """The tensors of decoder layer i, in the order they lie on disk (sequential reads)."""
        prefix = f"model.layers.{i}."
        return sorted((n for n in self.tensors if n.startswith(prefix)), key=self.location)

    def prefetch(self, names) -> None:
        """Start reading these tensors on a background thread (in order, one at a time), so that a later get()
        takes them from memory instead of waiting for the disk while the caller computes. The caller bounds the
        memory: what it prefetches stays resident until it get()s it (convert: the next layer, ~0.5 GB at 8B)."""
        if self.pickled:
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeify-reader")
        for name in names:
            if name in self._span and name not in self._ahead:
                self._ahead[name] = self._pool.submit(self._read_ahead, name)

    def forget(self, names) -> None:
        """Drop what was prefetched of these tensors and not taken (an expert no token reached)."""
        for name in names:
            fut = self._ahead.pop(name, None)
            if fut is not None:
                fut.cancel()

    def _read_ahead(self, name: str) -> tuple[torch.Tensor, tuple | None]:
        """On the reader thread: its own file handle (the caller's stays where it is), and the NaN/Inf scan there
        too. File reads and the scan release the GIL, so both run while the caller computes."""
        self._wait(name)
        path = self.file_of[name]
        if self._ahead_path != path:
            if self._ahead_fh is not None:
                self._ahead_fh.close()
            self._ahead_fh = open(path, "rb", buffering=0)
            self._ahead_path = path
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._ahead_fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        tensor = self._read(name, self._ahead_fh)
        return tensor, first_nonfinite(tensor) if self.scan_nonfinite else None

    def _wait(self, name: str) -> None:
        """Before a tensor's bytes are read: nothing to wait for in a finished checkpoint (a reader of one being
        written waits for the writer here: moeify.formats.writer.WrittenReader)."""

    def _read(self, name: str, fh) -> torch.Tensor:
        """Read one tensor's bytes straight into a new tensor with plain reads (no mmap): the process holds only
        the tensors it keeps, not the touched pages of a mapped 5 GB shard (which count in its RSS)."""
        info = self.tensors[name]
        return _read_into(fh, self._span[name][0], torch.empty(info.shape, dtype=info.dtype))

    def _close_open(self) -> None:
        if self._open is not None and not self.pickled:
            self._open.close()
        self._open = None
        self._open_path = None

    def close(self) -> None:
        """Close the open shards and stop the read-ahead thread (dropping what it read and nobody took)."""
        self._close_open()
        if self._pool is not None:
            for fut in self._ahead.values():
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None
        self._ahead.clear()
        if self._ahead_fh is not None:
            self._ahead_fh.close()
        self._ahead_fh, self._ahead_path = None, None
