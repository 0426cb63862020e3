"""Recovery tuning as a stage: `moeify tune SRC OUT` and the tuning step of `moeify convert --tune-tokens N`.

The stage distils a moeify output (tuned or not) towards its dense source (moeify.distill) and writes the result
back all or nothing, as convert writes its output. Everything the student needs is read from OUT (the expert
tensors, routers and each layer's neuron permutation in report.json) and SRC (the teacher), so an output can be
tuned further at any later time, and `convert` runs the same code on the carve it has just written.

Resumable: the run's whole state (trainable weights, Adam moments, the schedule's position, the token stream's
position and generator, the best checked weights, the held-out curve, the tuning text itself) lives in
`OUT.moeify-tune/` next to OUT, saved atomically every `save_every` seconds, at the last step, and when SIGINT or
SIGTERM asks the run to stop (at the end of the step in progress; a second signal stops at once). `--resume`
continues from it and ends with the weights an uninterrupted run would have (same machine and thread count). The
state names its source and base by fingerprint and its settings, and a state that does not match is refused, never
silently reused. It is removed when the tuned output is committed.

Layout of `OUT.moeify-tune/`:
    run.json                 what the run is: source and base fingerprints, settings, seeds, the base's path
    carved/                  (convert only) the untuned carve the run starts from
    sampled/batch-NNNNN.*    the dense model's own text, one file per sampling batch, with the teacher's final
                             hidden states on it (the tuning targets of those windows, kept from the sampling)
    data.safetensors         the tuning text: training and held-out windows (once assembled)
    state.json               the last saved snapshot's step and metadata (replaced atomically)
    state-STEP.safetensors   that snapshot's tensors; best-STEP.safetensors the best checked weights
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from .checkpoint import (INDEX_NAME, CheckpointReader, ShardLayout, ShardWriter, TensorInfo, check_free_space,
                         commit_output, prepare_output)
from .config import ConvertConfig, build_config, config_to_toml
from .errors import MoeifyError
from .families import ATTENTION_TENSORS, TOKENIZER_FILES, ffn_tensor_names
from .memory import device_memory
from .numerics import release_memory, resolve_device
from .partition import Partition

TUNE_SUFFIX = ".moeify-tune"
STATE_VERSION = 1
SAVE_EVERY = 600.0  # seconds between saved states (and one at the last step, and on SIGINT / SIGTERM)
SCHEDULES = ("continue", "restart")
SAMPLE_BATCH = 64  # windows the dense model samples at once on a CPU (and at least, on a GPU)
GPU_SAMPLE_BATCH = 1024  # at most, on a GPU: sampling there is bound by kernel launches, not arithmetic (SmolLM2-135M
# on an H200: 64, 256 and 1,024 windows of 496 new tokens each take 13.3-13.5 s, i.e. 16x the tokens a second at
# 1,024; BENCHMARKS.md "GPU"), so a batch as large as half the free memory holds, up to this, costs no more a step
GPU_SAMPLE_SHARE = 0.5  # of the GPU memory free when sampling starts (the rest: generate()'s temporaries, slack)


def sample_batch_for(teacher, seq: int, n_windows: int, par=None) -> int:
    """Windows sampled at once: SAMPLE_BATCH on a CPU (compute-bound: a larger batch costs as much more time a
    step); on a GPU as many as GPU_SAMPLE_SHARE of its free memory holds (moeify.memory's bytes a window), between
    SAMPLE_BATCH (what the memory check before the run counted) and GPU_SAMPLE_BATCH, and no more than the run
    samples; across processes the smallest rank's (each samples whole batches of the same size)."""
    from .families import attention_shape
    from .memory import sampling_bytes_per_window
    from .parallel import Parallel

    dev = next(teacher.parameters()).device
    if dev.type != "cuda":
        return SAMPLE_BATCH
    c = teacher.config
    _, kv_heads, head_dim = attention_shape(c)
    per_window = sampling_bytes_per_window(seq=seq, n_layers=c.num_hidden_layers, kv_heads=kv_heads,
                                           head_dim=head_dim, hidden=c.hidden_size, vocab=c.vocab_size)
    return -(par or Parallel()).most(-gpu_sample_batch(torch.cuda.mem_get_info(dev)[0], per_window, n_windows))


def gpu_sample_batch(free_bytes: int, window_bytes: int, n_windows: int) -> int:
    """sample_batch_for on a GPU with free_bytes free, window_bytes a window."""
    fits = int(GPU_SAMPLE_SHARE * free_bytes // max(1, window_bytes))
    return max(SAMPLE_BATCH, min(GPU_SAMPLE_BATCH, fits, n_windows))

Progress = Callable[..., None]


def state_dir(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + TUNE_SUFFIX)


@dataclass(frozen=True)
class TuneOptions:
    """What a tuning run is asked to do (`moeify tune` flags; `convert` derives them from its --tune-* flags)."""

    tokens: int  # training tokens of this run (its warm-up and cosine: see schedule)
    lr: float = 0.003  # Adam step relative to each expert tensor's RMS (moeify.distill.DistillSettings.lr)
    generated: float = 0.5  # share of the tokens the dense model samples itself
    calib: tuple[str, ...] = ()  # real tuning text; () = the output's own calibration text (its moeify.toml)
    tune_text: tuple[str, ...] = ()  # more real text; () with calib () = the output's own --tune-text
    train_router: bool = True
    train_attention: bool = False
    seed: int | None = None  # None: the output's seed, moved on by the number of earlier runs (fresh text each run)
    schedule: str = "continue"  # continue: the step size follows one cosine over the output's earlier tuning tokens
    # and these (a doubling starts at half the peak and decays to 0); restart: a whole cosine from the peak

    def validate(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise MoeifyError(f"--tokens must be a positive integer (tuning tokens), got {self.tokens!r}")
        if not 0.0 < self.lr < 1.0:
            raise MoeifyError(f"--lr must be in (0, 1) (a step size relative to each weight's RMS), got {self.lr}")
        if not 0.0 <= self.generated < 1.0:
            raise MoeifyError(f"--tune-generated must be in [0, 1) (the share of tuning windows the dense model "
                              f"samples itself), got {self.generated}")
        if self.schedule not in SCHEDULES:
            raise MoeifyError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for f in (*self.calib, *self.tune_text):
            if not Path(f).is_file():
                raise MoeifyError(f"tuning text {f} not found", "pass existing .txt/.jsonl files to --calib / --tune-text")

    def schedule_from(self, prior_tokens: int) -> float:
        """Where in one cosine schedule over prior_tokens + tokens this run starts (DistillSettings.schedule_from):
        prior / (prior + tokens) when continuing a tuned output, 0 for a fresh output or a restarted schedule."""
        return prior_tokens / (prior_tokens + self.tokens) if self.schedule == "continue" and prior_tokens > 0 else 0.0


def options_from_config(cfg: ConvertConfig) -> TuneOptions:
    """The tuning run `convert --tune-tokens` asks for."""
    return TuneOptions(tokens=cfg.tune_tokens, lr=cfg.tune_model_lr, generated=cfg.tune_generated,
                       train_router=cfg.tune_router, train_attention=cfg.tune_attention)


class TuningInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT / SIGTERM after saving its state."""

    def __init__(self, step: int, total: int):
        super().__init__(f"tuning stopped at step {step} of {total}; its state is saved")
        self.step, self.total = step, total


# ------------------------------------------------------------------------------------------ the base output


@dataclass
class BaseOutput:
    """What a moeify output says of itself: its settings, report (layers with their permutations) and config."""

    path: Path
    cfg: ConvertConfig
    provenance: dict
    report: dict
    config_json: dict

    @property
    def fmt(self) -> str:
        return self.report["format"]

    @property
    def runs(self) -> list[dict]:
        return list(self.report.get("tuning", {}).get("runs", []))


def read_output(path: Path) -> BaseOutput:
    path = Path(path)
    if not path.is_dir():
        raise MoeifyError(f"{path} is not a directory", "pass the output directory of an earlier `moeify convert`")
    missing = [n for n in ("moeify.toml", "report.json", "config.json") if not (path / n).is_file()]
    if missing:
        raise MoeifyError(f"{path} is not a moeify output (no {missing[0]})",
                          "`moeify tune` tunes what `moeify convert` wrote; convert the dense checkpoint first")
    try:
        report = json.loads((path / "report.json").read_text())
        config_json = json.loads((path / "config.json").read_text())
        toml = tomllib.loads((path / "moeify.toml").read_text())
        cfg = build_config(path / "moeify.toml")
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise MoeifyError(f"{path}: report.json, config.json or moeify.toml cannot be read ({exc})",
                          "the output is damaged; convert again") from None
    layers = report.get("layers")
    if not isinstance(layers, list) or not all(isinstance(e, dict) for e in layers):
        raise MoeifyError(f"{path}/report.json has no per-layer record", "the output is damaged; convert again")
    for e in layers:
        if not e.get("dense") and not isinstance(e.get("perm"), list):
            raise MoeifyError(f"{path}/report.json: layer {e.get('layer')} has no neuron permutation",
                              "outputs of moeify 0.1 before the permutation was recorded cannot be tuned; convert again")
    return BaseOutput(path, cfg, toml.get("provenance", {}), report, config_json)


def _hash_files(h, root: Path, names) -> None:
    for name in names:
        f = root / name
        h.update(name.encode())
        if f.is_file():
            h.update(f.read_bytes())


def _weights_fingerprint(h, root: Path, samples: int = 16, chunk: int = 1 << 16) -> None:
    """Names, sizes and safetensors headers of every weight file, and `samples` chunks of its data spread evenly
    over it (cheap at any model size, and two models of one architecture differ in every chunk)."""
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + str(size).encode())
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(fh.read(min(n, 1 << 26)))
            for k in range(samples):
                fh.seek(8 + n + (size - 8 - n) * k // samples)
                h.update(fh.read(chunk))


def source_fingerprint(src: Path) -> str:
    h = hashlib.sha256()
    _hash_files(h, Path(src), ["config.json"])
    _weights_fingerprint(h, Path(src))
    return h.hexdigest()[:32]


def base_fingerprint(base: Path) -> str:
    h = hashlib.sha256()
    _hash_files(h, Path(base), ["config.json", "report.json", "moeify.toml", INDEX_NAME])
    _weights_fingerprint(h, Path(base))
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------------------ the saved state


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
    """Save a state's tensors (moeify.distill.Pending ones produced one at a time, in order, on every rank) to
    `path` atomically, streaming: the writer holds one whole tensor at a time, never the state. write False: only
    take part in the gathering."""
    from .distill import Pending

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
        from safetensors import safe_open

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
    """The state directory's snapshots: moeify.distill.distill's `state` (keep / kept / checkpoint)."""

    def __init__(self, root: Path, save_every: float = SAVE_EVERY, par=None):
        from .parallel import Parallel

        self.root, self.save_every, self.par = Path(root), save_every, par or Parallel()
        self.stop_requested = False
        self._best: str | None = None
        self._last = time.time()

    def keep(self, tensors: dict, step: int) -> None:
        name = f"best-{step}.safetensors"
        _stream_save(tensors, self.root / name, self.par.main)  # on every rank: the gathering is a collective
        self._best = name

    def kept(self) -> SavedTensors:
        self.par.barrier()  # rank 0 has written it
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
        self.par.barrier()
        self._last = time.time()
        if self.stop_requested and step < total:
            raise TuningInterrupted(step, total)

    def load(self) -> tuple[dict, dict] | None:
        f = self.root / "state.json"
        if not f.is_file():
            return None
        try:
            saved = json.loads(f.read_text())
            tensors = SavedTensors(self.root / saved["file"])
        except (ValueError, KeyError, OSError) as exc:
            raise MoeifyError(f"the saved tuning state in {self.root} cannot be read ({exc})",
                              "start again with --restart") from None
        self._best = saved["meta"]["best_file"]
        return tensors, saved["meta"]

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
    from .checkpoint import _pid_alive

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
    except (OSError, ValueError):
        return "unreadable"
    done = TuningState(root).progress()
    steps = f"step {done[0]:,} of {done[1]:,} saved" if done else "no step saved yet"
    return f"{run['options']['tokens']:,} tokens, {steps}, started {time.strftime('%Y-%m-%d %H:%M', time.localtime(run['created']))}"


def resume_command(src: Path, out: Path) -> str:
    return f"moeify tune {src} {out} --resume"


# ------------------------------------------------------------------------------------------ the tuning text


def _text_sources(base: BaseOutput, opts: TuneOptions) -> list[tuple[str, list[str], int]]:
    """(name, files, windows the carve calibrated on) of each real text: the output's calibration text (or
    --calib), --tune-text, and the bundled broad sample unless already among them."""
    from .config import BUNDLED_CALIB

    calib = list(opts.calib) or list(base.cfg.calib)
    tune_text = list(opts.tune_text) if (opts.calib or opts.tune_text) else list(base.cfg.tune_text)
    used = int(base.report.get("calibration", {}).get("windows", 0)) if list(calib) == list(base.cfg.calib) else 0
    for f in (*calib, *tune_text):
        if not Path(f).is_file():
            raise MoeifyError(f"tuning text {f} (recorded in {base.path}/moeify.toml) not found",
                              "pass the text to tune on with --calib FILE (and --tune-text FILE)")
    sources = [("calib", calib, used)]
    if tune_text:
        sources.append(("tune_text", tune_text, 0))
    if str(BUNDLED_CALIB) not in calib:
        sources.append(("bundled", [str(BUNDLED_CALIB)], 0))
    return sources


def load_teacher(src: Path, dev: str, par=None):
    """The dense source as the tuning teacher, float32 on `dev`, frozen, in eval mode.

    One process: transformers' from_pretrained. Across processes (torchrun): the teacher is sharded, never held
    whole by any process: the model is built on the meta device, every decoder layer's attention and FFN become
    FSDP2 groups of their own (moeify.parallel.Parallel.shard_frozen: gathered for each forward, resharded after
    it), and each rank reads from SRC's safetensors only its own rows of those weights (CheckpointReader.get_rows);
    the embeddings, norms and output head (small beside the layers; the KL reads the head whole) are read whole on
    every rank. The student shares these modules with the teacher (share_frozen), so the FSDP2 groups are the
    teacher's attention and FFN modules themselves: whoever calls them gathers them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .parallel import Parallel

    par = par or Parallel()
    if not par.on:
        try:
            return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True,
                                                        use_safetensors=True, trust_remote_code=False).to(dev).eval()
        except OSError as exc:
            raise MoeifyError(f"tuning cannot load {src} ({exc.__class__.__name__})",
                              "tuning needs the source's safetensors weights") from None
    from torch.distributed.tensor import DTensor

    reader = CheckpointReader(src)  # refuses pickled weights, as from_pretrained(use_safetensors=True) does
    config = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    for layer in teacher.model.layers:
        par.shard_frozen(layer.self_attn)
        par.shard_frozen(layer.mlp)
    teacher.to_empty(device=dev)
    teacher.tie_weights()  # to_empty gives tied weights separate storage
    rotary = teacher.model.rotary_emb  # its buffers are computed from the config, not read
    teacher.model.rotary_emb = type(rotary)(teacher.config).to(dev)
    others = [n for n, _ in teacher.named_buffers() if not n.startswith("model.rotary_emb.")]
    if others:  # a buffer to_empty left uninitialised
        raise MoeifyError(f"{src}: tuning across processes cannot build this model's buffers ({', '.join(others)})",
                          "tune it in one process")
    try:
        with torch.no_grad():
            for name, p in teacher.named_parameters():
                if isinstance(p, DTensor):
                    local = p.to_local()
                    a, b = par.rows(p.shape[0])
                    if local.shape[0] != b - a:
                        raise RuntimeError(f"{name}: FSDP2 holds {local.shape[0]} rows on rank {par.rank}, "
                                           f"expected {b - a}")
                    local.copy_(reader.get_rows(name, a, b).to(local.dtype))
                else:
                    p.copy_(reader.get(name).to(p.dtype))
    finally:
        reader.close()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


def real_windows(src_path: Path, sources, seq: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Every window of the real texts; the last windows of each (after those the carve calibrated on) held out."""
    from .calibrate import text_windows

    train, held, text = [], [], {}
    for name, files, used in sources:
        w = text_windows(src_path, files, seq)
        n_hold = min(4, max(0, (w.shape[0] - used) // 5))  # only windows the carve never saw
        train.append(w[: w.shape[0] - n_hold])
        held.append(w[w.shape[0] - n_hold:])
        text[name] = {"files": [str(f) for f in files], "windows": int(w.shape[0]), "held_out": n_hold}
    return torch.cat(train), torch.cat(held), text


def sampled_windows(teacher, real: torch.Tensor, n_windows: int, seed: int, folder: Path,
                    progress: Progress | None, par=None, bf16: bool = False) -> tuple[torch.Tensor, int]:
    """n_windows of the dense model's own continuations of short prompts cut from the real text, sampled a batch
    at a time (sample_batch_for: 64 windows on a CPU, more on a GPU; chosen once and kept in folder/batch.json),
    each batch under its own seed and saved to `folder` as it is done (with the teacher's final hidden states at
    every position, kept from the sampling's forward passes: TeacherTargets), so an interrupted sampling resumes
    at its next batch with the same text. Returns the windows and the batch size. Across processes, batch b is sampled by
    rank b mod world (the same text: each batch has its own seed). bf16: sample under bf16 autocast, as the teacher
    computes the real windows' targets (teacher_pass) when tuning runs under it: 20% less time a batch on an
    AVX512-BF16 CPU, and its kept targets are as close to a float32 forward as the real windows' (BENCHMARKS.md)."""
    from .distill import sample_text
    from .parallel import Parallel

    par = par or Parallel()
    seq = real.shape[1]
    n_prompt = min(16, seq // 4)
    gen = torch.Generator().manual_seed(seed + 1)
    starts = real[torch.randint(real.shape[0], (n_windows,), generator=gen)]
    offs = torch.randint(seq - n_prompt + 1, (n_windows,), generator=gen)
    prompts = torch.stack([w[o:o + n_prompt] for w, o in zip(starts, offs)])
    folder.mkdir(exist_ok=True)
    meta = folder / "batch.json"
    if meta.is_file():  # a resumed run samples its remaining batches at the size its first ones were
        size = int(json.loads(meta.read_text())["sample_batch"])
    elif any(folder.glob("batch-*.safetensors")):  # batches saved before batch.json was kept: all were 64
        size = SAMPLE_BATCH
    else:
        size = sample_batch_for(teacher, seq, n_windows, par)
    par.barrier()  # every rank has looked for batch.json before it is written
    if par.main and not meta.is_file():
        meta.write_text(json.dumps({"sample_batch": size}))
    n_batches = -(-n_windows // size)
    for first in range(0, n_batches, par.world):  # rounds: every rank samples (or idles) in step with the others
        b = first + par.rank
        f = folder / f"batch-{b:05d}.safetensors"
        mine = b < n_batches and not f.is_file()
        if par.on and not par.any(mine):
            continue
        if mine:
            batch = prompts[b * size:(b + 1) * size]
            windows, hidden = sample_text(teacher, batch, seq - n_prompt, seed * 100_003 + b, batch=size,
                                          keep_hidden=True, bf16=bf16)
            _atomic_save({"windows": windows.contiguous(), "hidden": hidden.contiguous()}, f)
            del windows, hidden
            release_memory()  # the sampling's KV cache
        else:  # the sharded teacher gathers each layer from every rank: a rank with nothing to do runs as many
            sample_text(teacher, prompts[:1], seq - n_prompt, 0, batch=1, keep_hidden=True, bf16=bf16)  # 1 window
        if progress:
            progress("sampling tuning text", min((first + par.world) * size, n_windows) * seq, n_windows * seq)
    par.barrier()
    return torch.cat([load_file(str(folder / f"batch-{b:05d}.safetensors"))["windows"]
                      for b in range(n_batches)]), size


class TeacherTargets:
    """targets(i) for moeify.distill.distill: the teacher's final hidden states of training window i where the
    sampling kept them (the sampled windows, read from the batch files on demand), None for the real text."""

    def __init__(self, folder: Path, first: int, skip: int, batch: int):
        from safetensors import safe_open

        self.first, self.skip, self.batch = first, skip, batch  # train index of the first sampled window; held out
        self.files = [safe_open(str(f), "pt") for f in sorted(folder.glob("batch-*.safetensors"))]
        self.real: dict[int, tuple] = {}  # train index of a real window -> (file, row) of its precomputed targets

    def __call__(self, i: int) -> torch.Tensor | None:
        if i < self.first:
            where = self.real.get(i)
            return None if where is None else where[0].get_slice("hidden")[where[1]]
        j = i - self.first + self.skip
        return self.files[j // self.batch].get_slice("hidden")[j % self.batch]


TARGET_BATCH = 16  # windows per file of the teacher pass


def drawn_windows(n_train: int, seed: int, per_step: int, steps: int) -> torch.Tensor:
    """The training windows a run draws (moeify.distill.WindowStream with the run's seed), sorted, each once."""
    from .distill import WindowStream

    return torch.unique(WindowStream(torch.empty(n_train, 0), seed).take_indices(per_step * steps))


def teacher_pass(root: Path, teacher, train: torch.Tensor, held: torch.Tensor, targets: TeacherTargets | None,
                 settings, progress: Progress | None, par=None) -> tuple[TeacherTargets | None, torch.Tensor]:
    """The teacher's final hidden states (float32) of every real training window the run will draw and of the
    held-out windows, computed once before tuning (saved batch by batch in the state directory, so a resumed run
    reads them back), so that the tuning loop never runs the teacher: a window seen in several passes costs one
    teacher forward, and the teacher's FFNs can be freed before the student is built. Returns (the targets of
    every drawn window, the held-out windows' targets)."""
    from safetensors import safe_open

    from .distill import _autocast, final_hidden
    from .parallel import Parallel

    par = par or Parallel()
    folder = root / "targets"
    folder.mkdir(exist_ok=True)
    seq = train.shape[1]
    per_step = max(1, settings.batch_tokens // seq)
    steps = max(1, -(-settings.tokens // (per_step * seq)))
    first = targets.first if targets is not None else train.shape[0]
    real = [int(i) for i in drawn_windows(train.shape[0], settings.seed, per_step, steps) if i < first]
    jobs = [("held", torch.arange(held.shape[0]))] + [
        ("train", torch.tensor(real[s:s + TARGET_BATCH])) for s in range(0, len(real), TARGET_BATCH)]
    dev = next(teacher.parameters()).device
    ctx = _autocast(str(dev), settings.autocast)[0]
    done_tokens, total_tokens = 0, sum(len(idx) for _, idx in jobs) * seq
    for start in range(0, len(jobs), par.world):  # rounds of one job a rank, in step (the teacher may be sharded)
        b = start + par.rank
        kind, idx = jobs[b] if b < len(jobs) else ("none", torch.empty(0, dtype=torch.long))
        f = folder / f"batch-{b:05d}.safetensors"
        # float32, and batched as the loop would run them (held-out windows a step's worth at a time, training
        # windows one micro-batch at a time): the targets are the very values the teacher in the loop computes
        size = per_step if kind == "held" else max(1, settings.micro_windows)
        todo = [] if f.is_file() or not len(idx) else list(range(0, len(idx), size))
        rounds = par.most(len(todo))
        with torch.no_grad(), ctx:
            windows = (held if kind == "held" else train)[idx] if todo else None
            hidden = [final_hidden(teacher, windows[s:s + size].to(dev)).float().cpu() for s in todo]
            for _ in range(rounds - len(todo)):  # as many forwards as the busiest rank (one token each)
                final_hidden(teacher, train[:1, :1].to(dev))
        if todo:
            _atomic_save({"index": idx.contiguous(), "hidden": torch.cat(hidden).contiguous()}, f)
        done_tokens += sum(len(j[1]) for j in jobs[start:start + par.world]) * seq
        if progress:
            progress("teacher targets", done_tokens, total_tokens)
    if par.main:
        (folder / "complete.json").write_text(json.dumps({"real_windows": len(real), "held_out": int(held.shape[0])}))
    par.barrier()
    if targets is None:
        targets = TeacherTargets(root / "sampled", first, 0, SAMPLE_BATCH)
    held_t = torch.empty(0)
    for b, (kind, _) in enumerate(jobs):
        f = folder / f"batch-{b:05d}.safetensors"
        if not f.is_file():
            continue
        if kind == "held":
            held_t = load_file(str(f))["hidden"]
        else:
            handle = safe_open(str(f), "pt")
            for row, i in enumerate(handle.get_tensor("index").tolist()):
                targets.real[int(i)] = (handle, row)
    return targets, held_t


def free_teacher_ffns(teacher, base: BaseOutput) -> None:
    """Drop the teacher's FFN weights of the layers the base output carved, once tuning reads all its targets from
    the teacher pass (what the student shares with the teacher, its attention, embeddings, norms and head, stays;
    so do the FFNs of layers kept dense, which the student copies)."""
    for entry in base.report["layers"]:
        if not entry.get("dense"):
            teacher.model.layers[entry["layer"]].mlp = _FreedFFN()


class _FreedFFN(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("the teacher's FFNs were freed after the teacher pass; tuning reads its targets")


def tuning_data(root: Path, src_path: Path, base: BaseOutput, opts: TuneOptions, seq: int, seed: int, teacher,
                progress: Progress | None, par=None, bf16: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, dict, TeacherTargets | None]:
    """The run's tuning text, assembled once and saved in the state directory (a resumed run reads it back): every
    window of the real texts, and windows the dense model samples itself (opts.generated of the budget, never
    repeated; sampled under bf16 autocast when `bf16`, as tuning runs), a few of each held out for early stopping.
    Returns (train, held out, description, the teacher's targets kept from sampling)."""
    from .parallel import Parallel

    par = par or Parallel()
    f = root / "data.safetensors"
    if not f.is_file():
        real, held, text = real_windows(src_path, _text_sources(base, opts), seq)
        train, held_parts = [real], [held]
        n_gen = round(opts.generated * opts.tokens / seq)
        if n_gen:
            n_hold_gen = min(2, max(1, n_gen // 10))
            sampled, size = sampled_windows(teacher, real, n_gen + n_hold_gen, seed, root / "sampled", progress, par,
                                            bf16)
            train.append(sampled[n_hold_gen:])
            held_parts.append(sampled[:n_hold_gen])
            text["generated"] = {"windows": int(sampled.shape[0]), "held_out": n_hold_gen,
                                 "prompt_tokens": min(16, seq // 4), "first_train_window": int(real.shape[0]),
                                 "sample_batch": size, "bf16_autocast": bf16}
        train, held_out = torch.cat(train), torch.cat(held_parts)
        if held_out.shape[0] == 0:  # tiny texts: hold out the last training window rather than nothing
            held_out, train = train[-1:], train[:-1]
        if par.main:
            (root / "data.json").write_text(json.dumps(text))
            _atomic_save({"train": train.contiguous(), "held_out": held_out.contiguous()}, f)
        par.barrier()
    data, text = load_file(str(f)), json.loads((root / "data.json").read_text())
    gen = text.get("generated")
    targets = (TeacherTargets(root / "sampled", gen["first_train_window"], gen["held_out"], gen["sample_batch"])
               if gen else None)
    return data["train"], data["held_out"], text, targets


# ------------------------------------------------------------------------------------------ student and output


def _partition(entry: dict, cfg: ConvertConfig) -> Partition:
    return Partition(torch.tensor(entry["perm"], dtype=torch.long), int(entry["shared_neurons"]), cfg.experts,
                     int(entry["expert_sizes"][0]))


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object with the same children, parameters and buffers (none of them copied)."""
    twin = copy.copy(module)
    for k, v in module.__dict__.items():  # its own registries (children, parameters, buffers, hooks): a hook
        if isinstance(v, (dict, set)):    # registered on one (FSDP2's, say) is not registered on the other
            twin.__dict__[k] = copy.copy(v)
    return twin


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters this process holds (its shards of sharded ones)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _own_attention(layer, i: int, config, device: str) -> None:
    """Give the student's decoder layer its own attention and norms, copies of the teacher's (which the layer holds
    until now). A sharded attention (load_teacher across processes) is gathered into a fresh module: the copy is
    then sharded with the student's layer."""
    from .parallel import full

    for name in ("input_layernorm", "post_attention_layernorm"):
        setattr(layer, name, copy.deepcopy(getattr(layer, name)))
    attn = layer.self_attn
    if not _is_sharded(attn):
        layer.self_attn = copy.deepcopy(attn)
        return
    with torch.device("meta"):
        fresh = type(layer)(config, i).self_attn
    fresh.to_empty(device=device)
    theirs = dict(attn.named_parameters())
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(full(theirs[name].detach()))  # a collective: every rank gathers the same tensors in order
    layer.self_attn = fresh


def build_student(teacher, base: BaseOutput, reader: CheckpointReader, device: str, train_attention: bool = False,
                  shard_moe: Callable | None = None, shard_layer: Callable | None = None):
    """The dense model with every carved layer's FFN replaced by a MaskedMoE holding OUT's experts (un-permuted to
    the dense neuron order) and router (its scale folded in: log scale 0); layers whose attention an earlier run
    tuned take OUT's attention and norms. The student is the teacher's module tree down to its decoder layers, new
    objects holding the teacher's own modules (nothing is copied: the model is not held twice, even for a moment),
    except the FFNs it replaces and, where it trains or an earlier run tuned them, its own attention and norms.
    shard_moe / shard_layer (a sharded run): called on each MaskedMoE as it is built, and on each decoder layer with
    its own attention at the end (its MaskedMoE already a group). Returns (student, the layers whose attention an
    earlier run tuned)."""
    from .convert import unpermute_ffn
    from .distill import MaskedMoE

    cfg, fmt = base.cfg, base.fmt
    student = _shallow(teacher)
    student.model = _shallow(teacher.model)
    student.model.layers = torch.nn.ModuleList([_shallow(layer) for layer in teacher.model.layers])
    own_attention = set()
    for entry in base.report["layers"]:
        i = entry["layer"]
        if train_attention or entry.get("attention_tuned"):
            _own_attention(student.model.layers[i], i, teacher.config, device)
        if entry.get("attention_tuned"):
            own_attention.add(i)
            with torch.no_grad():
                for name in ATTENTION_TENSORS:
                    w = student.get_submodule(f"model.layers.{i}.{name}").weight
                    w.copy_(reader.get(f"model.layers.{i}.{name}.weight").to(w.dtype))
        if entry.get("dense"):
            if not _is_sharded(teacher.model.layers[i].mlp):  # its own frozen copy: share_frozen may store the
                student.model.layers[i].mlp = copy.deepcopy(teacher.model.layers[i].mlp)  # teacher's in bf16
            continue
        names = ffn_tensor_names(fmt, i, cfg.experts, False, cfg.shared > 0)
        tensors = {n: reader.get(n) for n in names}
        gate, up, down = unpermute_ffn(tensors, _partition(entry, cfg), fmt, i, cfg)
        c = entry.get("shared_gate") if fmt == "qwen2_moe" else None
        moe = MaskedMoE(gate, up, down, tensors[names[0]].float(), 1.0, _partition(entry, cfg).labels(), cfg.top_k,
                        fmt, c)
        del tensors, gate, up, down
        student.model.layers[i].mlp = moe
        if shard_moe is not None:  # sharded as it is built (FSDP2 moves it to the device, then each rank keeps
            shard_moe(moe)         # its shard): no rank ever holds the whole student
        else:
            moe.to(device)
    if shard_layer is not None:
        for layer in student.model.layers:
            shard_layer(layer)
    return student, own_attention


def gather_student(student, teacher, keep: bool = True) -> None:
    """After a sharded run: every sharded tensor of the student's own (the MaskedMoEs', and with --tune-attention
    each layer's attention and norms; not the teacher's modules it shares) replaced by the whole one in host memory
    (a collective, one tensor at a time), so the output is written from plain tensors. keep False (the ranks that do
    not write the output): the gathered tensors are dropped as they come."""
    from torch.distributed.tensor import DTensor

    from .parallel import full

    theirs = {id(p) for p in teacher.parameters()}
    for m in student.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if isinstance(p, DTensor) and id(p) not in theirs:
                whole = full(p.detach())
                value = whole.cpu().clone() if keep else torch.empty(0)
                del whole
                m._parameters[name] = torch.nn.Parameter(value, requires_grad=False)


def _base_layout(reader: CheckpointReader) -> ShardLayout:
    """The base output's shard layout (files and the order of their tensors), to write the tuned output alike."""
    files: dict[str, list[str]] = {}
    for name in sorted(reader.tensors, key=reader.location):
        files.setdefault(reader.location(name)[0], []).append(name)
    return ShardLayout([[reader.tensors[n] for n in files[f]] for f in sorted(files)])


def write_tuned(base: BaseOutput, reader: CheckpointReader, student, tmp: Path, train_attention: bool,
                report: dict, toml_tuning: dict) -> None:
    """The tuned output in `tmp`: the base's tensors, with every carved layer's experts and router (and, when
    trained, attention and norms) taken from the student, in the base's shard layout; config, tokenizer, and the
    base's report.json / moeify.toml with the tuning history."""
    from .convert import ffn_output_tensors
    from .distill import MaskedMoE

    cfg, fmt = base.cfg, base.fmt
    layout = _base_layout(reader)
    if layout.file_names() != sorted({reader.location(n)[0] for n in reader.tensors}):
        raise MoeifyError(f"{base.path}: its weight files are not named as moeify names them",
                          "tune an output written by moeify convert")
    new: dict[str, torch.Tensor] = {}
    writer = ShardWriter(tmp, layout)
    order = [t for f in layout.files for t in f]
    pending_layer = None
    try:
        for t in order:
            if t.name.startswith("model.layers."):
                i = int(t.name.split(".")[2])
                if i != pending_layer:
                    pending_layer, new = i, {}
                    entry = base.report["layers"][i]
                    mlp = student.model.layers[i].mlp
                    if isinstance(mlp, MaskedMoE):
                        out_dtype = reader.tensors[ffn_tensor_names(fmt, i, cfg.experts, False, cfg.shared > 0)[1]].dtype
                        new = ffn_output_tensors(fmt, i, _partition(entry, cfg), mlp.exported_router().float().cpu(),
                                                 mlp.gate.detach().cpu(), mlp.up.detach().cpu(), mlp.down.detach().cpu(),
                                                 cfg, out_dtype, entry.get("shared_gate", 0.0))
                    if train_attention:
                        for name in ATTENTION_TENSORS:
                            new[f"model.layers.{i}.{name}.weight"] = student.get_submodule(
                                f"model.layers.{i}.{name}").weight.detach().cpu()
            value = new.pop(t.name, None)
            writer.write(t.name, (reader.get(t.name) if value is None else value).to(t.dtype))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    (tmp / "config.json").write_text(json.dumps(base.config_json, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        f = base.path / name
        if f.is_file():
            shutil.copyfile(f, tmp / name)
    text = config_to_toml(cfg, base.provenance)
    text += "\n[tuning]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in toml_tuning.items()) + "\n"
    (tmp / "moeify.toml").write_text(text)
    (tmp / "report.json").write_text(json.dumps(report) + "\n")


def _check_written(tmp: Path, reader: CheckpointReader) -> None:
    written = CheckpointReader(tmp).tensors
    if {n: (t.shape, t.dtype) for n, t in written.items()} != {n: (t.shape, t.dtype) for n, t in reader.tensors.items()}:
        raise RuntimeError(f"output check failed: the tuned tensors in {tmp} differ in names, shapes or dtypes from the base")
    from .verify import check_structure

    problems, _, _ = check_structure(tmp)
    if problems:
        raise RuntimeError("output check failed: " + "; ".join(problems))


def _updated_report(base: BaseOutput, run: dict, train_router: bool, train_attention: bool) -> tuple[dict, dict]:
    report = copy.deepcopy(base.report)
    report.get("calibration", {}).pop("tuning", None)
    runs = base.runs + [run]
    report["tuning"] = {"tokens": sum(r["tokens"] for r in runs), "seconds": round(sum(r["seconds"] for r in runs), 1),
                        "holdout_kl": run["holdout_kl_after"], "runs": runs}
    for entry in report["layers"]:
        if entry.get("dense"):
            if train_attention:
                entry["attention_tuned"] = True
            continue
        tuned = set(entry.get("tuned", [])) | {"gate", "up", "down"} | ({"router"} if train_router else set())
        entry["tuned"] = [t for t in ("gate", "up", "down", "router") if t in tuned]
        if train_router:
            entry["router_scale"] = 1.0  # folded into the trained router rows
        if train_attention:
            entry["attention_tuned"] = True
    toml = {"tokens": report["tuning"]["tokens"], "runs": len(runs), "holdout_kl": round(run["holdout_kl_after"], 5),
            "seconds": report["tuning"]["seconds"]}
    return report, toml


# ------------------------------------------------------------------------------------------ the stage


def _fit_memory(src: Path, bo: BaseOutput, opts: TuneOptions, par, offload: bool | None, memory_check: bool,
                notify=None) -> bool:
    """Whether the run offloads (given, or where the memory model says the GPU needs it), after refusing a run that
    the model says fits nowhere here (unless memory_check is off). The run and its dry run both decide so."""
    from .families import load_source
    from .memory import check_fits, choose_offload

    seq = int(bo.report.get("calibration", {}).get("seq_len") or bo.cfg.calib_seq_len)
    dev, have = par.device, device_memory(par.device)
    if offload is None:
        offload = choose_offload(*(predicted_memory(src, bo, opts, seq, dev, world=par.world, offload=o)
                                   for o in (False, True)), dev, have)
        if offload and notify:
            notify("the student's state does not fit the GPU: offloading it to host memory (FSDP2 CPU offload); "
                   "--no-offload turns that off")
    if memory_check:
        check_fits(predicted_memory(src, bo, opts, seq, dev, world=par.world, offload=offload), dev, have,
                   load_source(src), bo.cfg.experts, len(bo.cfg.dense_layers), seq)
    return offload


def _student(teacher, bo: BaseOutput, reader: CheckpointReader, par, train_attention: bool, bf16: bool):
    """The student as the run trains it: built from OUT's tensors (each MaskedMoE an FSDP2 group as it is built when
    par shards, and each decoder layer with its own attention one more), sharing the teacher's frozen modules (in
    bf16 under autocast, except a sharded teacher's, which stay as loaded)."""
    from .distill import share_frozen

    student, own_attention = build_student(
        teacher, bo, reader, par.device, train_attention,
        shard_moe=(lambda m: par.shard_moe(m, torch.bfloat16 if bf16 else None)) if par.sharded else None,
        shard_layer=par.shard if par.sharded and train_attention else None)
    share_frozen(teacher, student, train_attention, torch.bfloat16 if bf16 and not par.on else None,
                 own_attention=own_attention)
    release_memory()
    return student


def tune_output(src: str | Path, out: str | Path, opts: TuneOptions | None = None, *, resume: bool = False,
                restart: bool = False, device: str = "auto", save_every: float = SAVE_EVERY,
                progress: Progress | None = None, notify: Callable[[str], None] | None = None,
                base: Path | None = None, given: dict | None = None, memory_check: bool = True,
                offload: bool | None = None, precompute_targets: bool = True) -> dict:
    """Tune the moeify output OUT (or `base`, the carve convert has just written) towards its dense source SRC and
    write the result to OUT all or nothing. Returns the new report.json.

    offload: keep the student's trainable tensors, gradients and optimizer state in host memory (FSDP2 CPU offload;
    moeify.parallel); None: when the GPU is too small otherwise and the offloaded run fits (moeify.memory).
    precompute_targets: the teacher pass (teacher_pass) before tuning, the teacher's FFNs freed after it; False: the
    teacher runs on the real windows inside the loop (the path before the teacher pass; kept for comparison).
    resume: continue the interrupted run saved in OUT.moeify-tune (opts None: its own; `given`, the options the
    caller set explicitly, must agree with it). restart: discard such a state and start anew."""
    from .distill import DistillSettings, _autocast, distill
    from .families import load_source
    from .parallel import setup

    src, out = Path(src), Path(out)
    root = state_dir(out)
    par = setup(resolve_device(device))
    if resume and restart:
        raise MoeifyError("--resume and --restart contradict each other", "pass one of them")
    load_source(src)  # a dense llama/mistral checkpoint, or a clear error
    if resume:
        if not (root / "run.json").is_file():
            raise MoeifyError(f"there is no interrupted tuning of {out} to resume (no {root.name}/run.json)",
                              f"start one: moeify tune {src} {out} --tokens N")
        run_info = json.loads((root / "run.json").read_text())
        if run_info.get("world_size", 1) != par.world:
            raise MoeifyError(f"{root} was saved by a run across {run_info.get('world_size', 1)} process(es); this "
                              f"one has {par.world}", "resume with the same number of processes (the token stream "
                              "is split by rank), or start anew with --restart")
        if run_info.get("version") != STATE_VERSION:
            raise MoeifyError(f"{root} was written by another version of moeify", "start again with --restart")
        base = root / run_info["base"] if run_info["base"] == "carved" else out
        options = {"schedule": "restart", **run_info["options"]}  # states saved before --schedule ran whole cosines
        saved = TuneOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
        for k, v in (given or {}).items():
            if v is not None and getattr(saved, k) != (tuple(v) if isinstance(v, list) else v):
                raise MoeifyError(f"--resume: the interrupted run was started with {k} = {getattr(saved, k)!r}, "
                                  f"not {v!r}", "resume without that flag, or start anew with --restart")
        opts = saved
        if source_fingerprint(src) != run_info["source"]:
            raise MoeifyError(f"{root} is the tuning state of another source than {src} (its weights or config "
                              "differ)", "resume with the source it was started with, or start anew with --restart")
        if not base.is_dir() or base_fingerprint(base) != run_info["base_fingerprint"]:
            raise MoeifyError(f"{root} was started from another {base} (the output changed since)",
                              "start anew with --restart")
    else:
        if base is None:  # an interrupted convert's carve waits in the state directory
            base = root / "carved" if (root / "carved").is_dir() else out
        base = Path(base)
        if (root / "run.json").exists():
            if not restart:
                raise MoeifyError(f"{out} has an interrupted tuning in {root} ({describe_state(root)})",
                                  f"continue it with: {resume_command(src, out)}; or pass --restart to discard it")
        if opts is None:
            raise MoeifyError("--tokens is required", "e.g. --tokens 262144")
        opts.validate()
        if not base.exists():
            raise MoeifyError(f"output {out} not found", "pass the directory `moeify convert` wrote")
    bo = read_output(base)
    cfg = bo.cfg
    if cfg.top_k >= cfg.experts:
        raise MoeifyError(f"{base}: every expert is active (top-k {cfg.top_k} of {cfg.experts}): the model is the "
                          "dense one and there is nothing to tune")
    check_free_space(out, sum(f.stat().st_size for f in base.glob("*.safetensors")), overwrite=True)
    offload = _fit_memory(src, bo, opts, par, offload, memory_check, notify if par.main else None)
    run_index = len(bo.runs)
    seed = opts.seed if opts.seed is not None else cfg.seed + 1000 * run_index
    par.barrier()  # every rank has checked the same files before rank 0 changes them
    if par.main:
        if not resume:
            if restart and root.exists():
                _lock(root)
                keep_carved = base.resolve().parent == root.resolve()
                for f in root.iterdir():
                    if not (keep_carved and f.name == "carved"):
                        shutil.rmtree(f) if f.is_dir() else f.unlink()
            root.mkdir(parents=True, exist_ok=True)
            _lock(root)
            _atomic_write(root / "run.json", json.dumps({
                "version": STATE_VERSION, "created": time.time(), "source": source_fingerprint(src),
                "base": "carved" if base.resolve().parent == root.resolve() else "out",
                "base_fingerprint": base_fingerprint(base), "options": dataclasses.asdict(opts), "seed": seed,
                "run_index": run_index, "world_size": par.world}).encode())
        else:
            _lock(root)
    par.barrier()
    if not par.main:
        progress = notify = None  # rank 0 reports
    dev = par.device
    if par.on and not precompute_targets:
        raise ValueError("across processes the teacher is sharded and runs in step on every rank: only the teacher "
                         "pass (precompute_targets) can run it")
    teacher = load_teacher(src, dev, par)
    teacher_bytes = local_bytes(teacher)
    seq = int(bo.report.get("calibration", {}).get("seq_len") or min(cfg.calib_seq_len, teacher.config.max_position_embeddings))
    schedule_from = opts.schedule_from(sum(int(r.get("tokens", 0)) for r in bo.runs))
    settings = DistillSettings(tokens=opts.tokens, lr=opts.lr, train_router=opts.train_router,
                               train_attention=opts.train_attention, seed=seed, schedule_from=schedule_from)
    bf16 = _autocast(dev, settings.autocast)[1]
    train, held, text, targets = tuning_data(root, src, bo, opts, seq, seed, teacher, progress, par, bf16=bf16)
    held_targets = None
    if precompute_targets:
        targets, held_targets = teacher_pass(root, teacher, train, held, targets, settings, progress, par)
        free_teacher_ffns(teacher, bo)
        release_memory()
    reader = CheckpointReader(base)
    if offload:
        from .parallel import with_offload

        par = with_offload(par)
    try:
        student = _student(teacher, bo, reader, par, opts.train_attention, bf16)
        state = TuningState(root, save_every, par)
        saved = state.load()
        with _stop_on_signal(state, notify):
            info = distill(teacher, student, train, held, settings, progress=progress, state=state, resume=saved,
                           targets=targets, par=par, held_targets=held_targets)
        if par.sharded:
            gather_student(student, teacher, keep=par.main)
    except BaseException:
        if par.own_group:
            par.close()
        raise
    info["offload"] = bool(offload)
    info["teacher_bytes"] = teacher_bytes  # this process's share of the teacher, as loaded (rank 0's)
    info["peak_bytes"], info["peak_what"] = _peak_memory(dev)
    predicted = predicted_memory(src, bo, opts, seq, dev, world=par.world, offload=bool(offload),
                                 sample_batch=(text.get("generated") or {}).get("sample_batch", SAMPLE_BATCH))
    info["predicted_peak_bytes"] = predicted.peak
    if dev.startswith("cuda"):  # the host side of a GPU run: measured peak RSS beside the predicted host memory
        info["host_peak_bytes"], info["predicted_host_bytes"] = _peak_memory("cpu")[0], predicted.host_total
    info = {"scope": "model", "lr": opts.lr, "schedule": opts.schedule, "schedule_from": round(schedule_from, 6),
            "seed": seed, "text": text, "resumed": bool(resume),  # from a saved state, in sampling or in tuning
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}
    del teacher
    release_memory()
    report, toml = _updated_report(bo, info, opts.train_router, opts.train_attention)
    if par.main:
        tmp = prepare_output(out, overwrite=True, src=src)
        try:
            write_tuned(bo, reader, student, tmp, opts.train_attention, report, toml)
            reader.close()
            _check_written(tmp, reader)
            commit_output(tmp, out)
        except BaseException:
            reader.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(root, ignore_errors=True)
    reader.close()
    par.barrier()
    par.close()
    return report


def estimate_run(src: str | Path, out: str | Path, opts: TuneOptions | None, *, resume: bool = False,
                 device: str = "auto", steps: int = 4, offload: bool | None = None, memory_check: bool = True) -> dict:
    """`tune --dry-run`: build the teacher and student as the run would, time `steps` tuning steps on the real text
    (the first is a warm-up) and the sampling of one batch of short continuations, and measure the peak memory.
    Offload (FSDP2 CPU offload of the student's state) as the run would have it: given, or chosen by the memory
    model where the GPU is too small otherwise; a run that fits nowhere here is refused before anything loads, as
    the run itself would be. Writes nothing. Returns the measured rates, the estimated time of the whole run and the
    memory model's prediction (moeify.memory)."""
    from .distill import DistillSettings, _autocast, distill, final_hidden, sample_text, sampling_seconds_per_token
    from .parallel import Parallel

    src, out = Path(src), Path(out)
    root = state_dir(out)
    if resume:
        if not (root / "run.json").is_file():
            raise MoeifyError(f"there is no interrupted tuning of {out} to resume (no {root.name}/run.json)")
        run_info = json.loads((root / "run.json").read_text())
        opts = TuneOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in run_info["options"].items()})
    if opts is None:
        raise MoeifyError("--tokens is required", "e.g. --tokens 262144")
    opts.validate()
    base = root / "carved" if (root / "carved").is_dir() else out
    if not base.exists():
        raise MoeifyError(f"output {out} not found", "pass the directory `moeify convert` wrote")
    bo = read_output(base)
    dev = resolve_device(device)
    offload = _fit_memory(src, bo, opts, Parallel(device=dev), offload, memory_check)
    teacher = load_teacher(src, dev)
    seq = int(bo.report.get("calibration", {}).get("seq_len") or teacher.config.max_position_embeddings)
    real, held, _ = real_windows(src, _text_sources(bo, opts), seq)
    n_prompt = min(16, seq // 4)
    new = min(seq - n_prompt, 96)  # a full sampling batch, a fifth of a window's new tokens: the cost per step,
    n_sampled = round(opts.generated * opts.tokens / seq)
    size = sample_batch_for(teacher, seq, n_sampled + min(2, max(1, n_sampled // 10))) if n_sampled else SAMPLE_BATCH
    prompts = real[torch.arange(size) % real.shape[0], :n_prompt]  # fitted against the KV cache's length
    stamps: list = []  # the dynamic cache: its steps grow with the length, as the fit assumes (the run's static cache
    # is sized by the whole window, not by these 96 tokens, and is ~20% cheaper: the estimate errs high, not low)
    settings = DistillSettings(tokens=steps * 1024, lr=opts.lr, train_router=opts.train_router,
                               train_attention=opts.train_attention, evals=1)
    ctx, bf16 = _autocast(dev, settings.autocast)
    sample_text(teacher, prompts, new, 0, batch=size, keep_hidden=True, step_times=stamps, cache="dynamic",
                bf16=bf16)
    sampling_rate = sampling_seconds_per_token(stamps, n_prompt, seq) / size * 1024
    # the teacher pass over the windows these steps draw (timed), then the teacher's FFNs freed, as the run does
    held1 = held[:1] if len(held) else real[-1:]
    drawn = drawn_windows(real.shape[0], settings.seed, max(1, settings.batch_tokens // seq), steps)
    t0 = time.time()
    with torch.no_grad(), ctx:
        kept = {int(i): final_hidden(teacher, real[i:i + 1].to(dev)).float().cpu()[0] for i in drawn}
        held_t = final_hidden(teacher, held1.to(dev)).float().cpu()
    teacher_rate = (time.time() - t0) / ((len(drawn) + 1) * seq) * 1024
    free_teacher_ffns(teacher, bo)
    release_memory()
    par = Parallel(device=dev)
    if offload:
        from .parallel import with_offload

        par = with_offload(par)
    stamps = []
    try:
        with contextlib.closing(CheckpointReader(base)) as reader:
            student = _student(teacher, bo, reader, par, opts.train_attention, _autocast(dev, settings.autocast)[1])
        distill(teacher, student, real, held1, settings, progress=lambda *a: stamps.append(time.time()),
                targets=kept.get, held_targets=held_t, par=par)
    finally:
        if par.own_group:
            par.close()
    step_s = (stamps[-2] - stamps[0]) / max(1, len(stamps) - 2)  # steps 2..n-1: no warm-up, no held-out check
    per_step = max(1, settings.batch_tokens // seq) * seq
    n_steps = -(-opts.tokens // per_step)
    sampled = round(opts.generated * opts.tokens / seq) * seq
    # the real windows the whole run is expected to draw at least once (draws uniform over real + sampled windows)
    n_real, n_all = real.shape[0], real.shape[0] + sampled // seq
    teacher_tokens = n_real * (1 - (1 - 1 / n_all) ** (n_steps * per_step // seq)) * seq + held.shape[0] * seq
    sampling_s = sampled // seq * (seq - n_prompt) / 1024 * sampling_rate  # generated tokens (prompts are real)
    peak, what = _peak_memory(dev)
    predicted = predicted_memory(src, bo, opts, seq, dev, settings, offload=offload, sample_batch=size)
    return {"sample_batch": size, "tokens": opts.tokens, "device": dev, "offload": bool(offload), "step_tokens": per_step,
            "step_seconds": step_s,
            "tokens_per_second": per_step / step_s, "steps": n_steps, "sampled_tokens": sampled,
            "sampling_seconds_per_1k": sampling_rate, "sampling_seconds": sampling_s,
            "tuning_seconds": n_steps * step_s, "teacher_pass_seconds": teacher_tokens / 1024 * teacher_rate,
            "estimated_seconds": n_steps * step_s + sampling_s + teacher_tokens / 1024 * teacher_rate,
            "peak_bytes": peak, "peak_what": what, "predicted": predicted.to_dict(),
            "host_peak_bytes": _peak_memory("cpu")[0], "device_bytes": device_memory(dev)}


def _peak_memory(dev: str) -> tuple[int, str]:
    """The process's peak memory so far on the device tuning ran on (a GPU's allocator, or the peak RSS)."""
    if dev.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(dev))), "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of this process"


def predicted_memory(src: Path, bo: BaseOutput, opts: TuneOptions, seq: int, dev: str, settings=None, world: int = 1,
                     offload: bool = False, sample_batch: int = SAMPLE_BATCH):
    """moeify.memory's prediction for this run (the config of SRC, the layout of the output; sample_batch: the
    windows sampled at once, SAMPLE_BATCH where the run has not chosen yet, the least it samples)."""
    from .distill import DistillSettings, _autocast
    from .families import load_source
    from .memory import source_tuning_memory

    settings = settings or DistillSettings(tokens=opts.tokens)
    return source_tuning_memory(load_source(src), bo.cfg.experts, len(bo.cfg.dense_layers), seq=seq,
                                micro_windows=settings.micro_windows, kl_chunk=settings.kl_chunk,
                                sample_batch=sample_batch, bf16=_autocast(dev, settings.autocast)[1],
                                train_attention=opts.train_attention, device=dev, world=world, offload=offload)


def refuse_leftover_state(out: Path, src: Path, overwrite: bool) -> None:
    """convert: an interrupted tuning of OUT is resumed with `moeify tune --resume`, or discarded with --overwrite."""
    root = state_dir(out)
    if root.exists():
        if not overwrite and (root / "run.json").is_file():
            raise MoeifyError(f"{root} holds an interrupted tuning of this output ({describe_state(root)})",
                              f"continue it with: {resume_command(src, out)}; or pass --overwrite to start again")
        shutil.rmtree(root)


__all__ = ["TuneOptions", "TuningInterrupted", "tune_output", "estimate_run", "state_dir", "options_from_config", "read_output",
           "resume_command", "refuse_leftover_state"]
