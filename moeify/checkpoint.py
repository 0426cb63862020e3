"""Checkpoint I/O: a lazy safetensors reader, a streaming size-capped shard writer, atomic output dirs.

The reader reads headers only until a tensor is asked for, and keeps one shard open at a time.
The writer knows every tensor's name, dtype and shape up front (the conversion plan), so it can lay out
the shards and write each safetensors header before any data, then stream tensors one by one: the
output is never held in memory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import MoeifyError

INDEX_NAME = "model.safetensors.index.json"
PARTIAL_SUFFIX = ".moeify-partial"

# safetensors dtype codes <-> torch dtypes
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _read_header(path: Path) -> dict:
    """Parse a safetensors header without loading data; clear errors for truncated/corrupt files."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise MoeifyError(f"{path} is truncated: no safetensors header", "re-download this shard")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100_000_000):
            raise MoeifyError(f"{path} has a corrupt safetensors header (length {n} > file size)", "re-download this shard")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MoeifyError(f"{path} has a corrupt safetensors header (not JSON)", "re-download this shard") from None
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = entry["data_offsets"]
            if entry["dtype"] not in ST_DTYPES:
                raise MoeifyError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        except (KeyError, TypeError, ValueError):
            raise MoeifyError(f"{path} has a corrupt safetensors header entry for {name}", "re-download this shard") from None
        end = max(end, stop)
    if 8 + n + end > size:
        raise MoeifyError(f"{path} is truncated: data ends at byte {8 + n + end}, file has {size}", "re-download this shard")
    return header


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint directory (single file or sharded)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.tensors: dict[str, TensorInfo] = {}
        self.file_of: dict[str, Path] = {}
        for shard in self._shards():
            for name, entry in _read_header(shard).items():
                if name == "__metadata__":
                    continue
                if name in self.file_of and self.file_of[name] != shard:
                    raise MoeifyError(f"tensor {name} appears in both {self.file_of[name].name} and {shard.name}")
                self.tensors[name] = TensorInfo(name, ST_DTYPES[entry["dtype"]], tuple(entry["shape"]))
                self.file_of[name] = shard
        self._open_path: Path | None = None
        self._open = None

    def _shards(self) -> list[Path]:
        index = self.root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise MoeifyError(f"{index} is not a valid safetensors index (needs a 'weight_map')") from None
            shards = []
            for rel in files:
                if not isinstance(rel, str) or os.path.isabs(rel) or ".." in Path(rel).parts:
                    raise MoeifyError(f"{index} names shard {rel!r} outside the checkpoint directory", "fix or re-download the index")
                path = self.root / rel
                if not path.is_file():
                    raise MoeifyError(f"{index} names shard {rel}, which is missing", "re-download the checkpoint")
                if not _inside(path, self.root):
                    raise MoeifyError(f"shard {rel} is a link that escapes {self.root}", "copy the real file into the checkpoint")
                shards.append(path)
            return shards
        shards = sorted(self.root.glob("*.safetensors"))
        if len(shards) > 1:
            raise MoeifyError(f"{self.root} has {len(shards)} .safetensors files but no {INDEX_NAME}", "add the index file")
        if not shards:
            if any(self.root.glob("*.bin")) or any(self.root.glob("*.pt")) or any(self.root.glob("*.pth")):
                raise MoeifyError(
                    f"{self.root} has only pickle weights (.bin/.pt), which can run code when loaded",
                    "convert them to safetensors first (e.g. transformers save_pretrained(safe_serialization=True))",
                )
            raise MoeifyError(f"{self.root} has no *.safetensors weights")
        if not _inside(shards[0], self.root):
            raise MoeifyError(f"{shards[0].name} is a link that escapes {self.root}", "copy the real file into the checkpoint")
        return shards

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (opening its shard, closing the previously open one)."""
        path = self.file_of.get(name)
        if path is None:
            raise MoeifyError(f"tensor {name} is missing from {self.root}", "the checkpoint is incomplete or not a supported layout")
        if path != self._open_path:
            self._open = safe_open(str(path), framework="pt")
            self._open_path = path
        return self._open.get_tensor(name)

    def close(self) -> None:
        self._open = None
        self._open_path = None


# ----------------------------------------------------------------------------------------------- writing


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


def _header_bytes(tensors: list[TensorInfo]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Streams tensors, in the planned order, into the planned shard files under `out_dir`."""

    def __init__(self, out_dir: Path, layout: ShardLayout):
        self.out_dir = out_dir
        self.layout = layout
        self.names = layout.file_names()
        self.order = [t for f in layout.files for t in f]
        self._next = 0  # index into self.order
        self._file_idx = -1
        self._fh = None
        self._file_end = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self._next]
        if name != expected.name or tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
            raise RuntimeError(
                f"writer got {name} {tuple(tensor.shape)} {tensor.dtype}, plan expects "
                f"{expected.name} {expected.shape} {expected.dtype}"
            )
        if self._fh is None or self._next >= self._file_end:
            self._start_next_file()
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._fh.write(data.view(torch.uint8).numpy().tobytes())
        self._next += 1

    def _start_next_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._file_idx += 1
        tensors = self.layout.files[self._file_idx]
        self._file_end = self._next + len(tensors)
        self._fh = open(self.out_dir / self.names[self._file_idx], "wb")
        self._fh.write(_header_bytes(tensors))

    def finish(self) -> None:
        if self._next != len(self.order):
            raise RuntimeError(f"writer finished after {self._next} of {len(self.order)} planned tensors")
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        if len(self.names) > 1:
            weight_map = {t.name: self.names[i] for i, f in enumerate(self.layout.files) for t in f}
            index = {"metadata": {"total_size": self.layout.total_bytes()}, "weight_map": weight_map}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# ----------------------------------------------------------------------------------------- atomic output


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def prepare_output(out: Path, overwrite: bool) -> Path:
    """Create the temporary sibling that the conversion writes into; return it."""
    tmp = partial_dir(out)
    if out.exists() and not overwrite:
        raise MoeifyError(f"output {out} already exists", "pass --overwrite to replace it, or choose another path")
    if tmp.exists():
        if not overwrite:
            raise MoeifyError(
                f"{tmp} is left over from an interrupted conversion",
                "pass --overwrite to remove it and start again, or delete it yourself",
            )
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_output(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory into place (replacing OUT when --overwrite)."""
    if out.exists():
        old = out.with_name(out.name + ".moeify-old")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
