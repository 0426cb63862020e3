"""The tuning text: the real texts' windows (the output's calibration text, --tune-text: the presets' bundled prose
unless the user's, the bundled broad sample), and windows the dense model samples itself, a few of each held out for
early stopping; assembled once per run and saved in the state directory, so a resumed run reads the same text back.
The sampled windows keep the teacher's final hidden states from their sampling (TeacherTargets), so the teacher never
runs on them again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..errors import MoeifyError
from ..maths.numerics import release_memory
from .options import Progress, TuneOptions
from .output import BaseOutput
from .state import _atomic_save

SAMPLE_BATCH = 64  # windows the dense model samples at once on a CPU (and at least, on a GPU)
GPU_SAMPLE_BATCH = 1024  # at most, on a GPU: sampling there is bound by kernel launches, not arithmetic (SmolLM2-135M
# on an H200: 64, 256 and 1,024 windows of 496 new tokens each take 13.3-13.5 s, i.e. 16x the tokens a second at
# 1,024; BENCHMARKS.md "GPU"), so a batch as large as half the free memory holds, up to this, costs no more a step
GPU_SAMPLE_SHARE = 0.5  # of the GPU memory free when sampling starts (the rest: generate()'s temporaries, slack)


def sample_batch_for(teacher, seq: int, n_windows: int, par=None) -> int:
    """Windows sampled at once: SAMPLE_BATCH on a CPU (compute-bound: a larger batch costs as much more time a
    step); on a GPU as many as GPU_SAMPLE_SHARE of its free memory holds (moeify.maths.memory's bytes a window), between
    SAMPLE_BATCH (what the memory check before the run counted) and GPU_SAMPLE_BATCH, and no more than the run
    samples; across processes the smallest rank's (each samples whole batches of the same size)."""
    from ..formats.families import attention_shape
    from ..maths.memory import sampling_bytes_per_window
    from ..training.parallel import Parallel

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


def text_sources(base: BaseOutput, opts: TuneOptions) -> list[tuple[str, list[str], int]]:
    """(name, files, windows the carve calibrated on) of each real text: the output's calibration text (or
    --calib), --tune-text, and the bundled broad sample unless already among them."""
    from ..formats.config import BUNDLED_CALIB

    calib = list(opts.calib) or list(base.cfg.calib)
    tune_text = list(opts.tune_text) if (opts.calib or opts.tune_text) else list(base.cfg.tune_text)
    used = int(base.report.get("calibration", {}).get("windows", 0)) if list(calib) == list(base.cfg.calib) else 0
    for f in (*calib, *tune_text):
        if not Path(f).is_file():
            raise MoeifyError(f"tuning text {f} (recorded in {base.path}/moeify.toml) not found",
                              "pass the text to tune on with --calib FILE (and --tune-text FILE)")
    sources = [("calib", calib, used)] if calib else []  # a weight-only output has no calibration text
    if tune_text:
        sources.append(("tune_text", tune_text, 0))
    if str(BUNDLED_CALIB) not in calib:
        sources.append(("bundled", [str(BUNDLED_CALIB)], 0))
    return sources


def real_windows(src_path: Path, sources, seq: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Every window of the real texts; the last windows of each (after those the carve calibrated on) held out."""
    from ..formats.text import text_windows

    train, held, text = [], [], {}
    for name, files, used in sources:
        w = text_windows(src_path, files, seq)
        n_hold = min(4, max(0, (w.shape[0] - used) // 5))  # only windows the carve never saw
        train.append(w[: w.shape[0] - n_hold])
        held.append(w[w.shape[0] - n_hold:])
        text[name] = {"files": [str(f) for f in files], "windows": int(w.shape[0]), "held_out": n_hold}
    return torch.cat(train), torch.cat(held), text


def sampled_windows(teacher, real: torch.Tensor, n_windows: int, seed: int, folder: Path,
                    progress: Progress | None, par=None, bf16: bool = False, keep_hidden: bool = True
                    ) -> tuple[torch.Tensor, int]:
    """n_windows of the dense model's own continuations of short prompts cut from the real text, sampled a batch
    at a time (sample_batch_for: 64 windows on a CPU, more on a GPU; chosen once and kept in folder/batch.json),
    each batch under its own seed and saved to `folder` as it is done (with the teacher's final hidden states at
    every position, kept from the sampling's forward passes: TeacherTargets), so an interrupted sampling resumes
    at its next batch with the same text. Returns the windows and the batch size. Across processes, batch b is sampled by
    rank b mod world (the same text: each batch has its own seed). bf16: sample under bf16 autocast, as the teacher
    computes the real windows' targets (teacher_pass) when tuning runs under it: 20% less time a batch on an
    AVX512-BF16 CPU, and its kept targets are as close to a float32 forward as the real windows' (BENCHMARKS.md).
    keep_hidden False: only the windows (the teacher runs in the tuning loop: one GPU)."""
    from ..training.sampling import sample_text
    from ..training.parallel import Parallel

    par = par or Parallel()
    seq = real.shape[1]
    n_prompt = min(16, seq // 4)
    gen = torch.Generator().manual_seed(seed + 1)
    starts = real[torch.randint(real.shape[0], (n_windows,), generator=gen)]
    offs = torch.randint(seq - n_prompt + 1, (n_windows,), generator=gen)
    prompts = torch.stack([w[o:o + n_prompt] for w, o in zip(starts, offs)])
    folder.mkdir(exist_ok=True)
    meta = folder / "batch.json"

    def saved_size() -> int | None:  # rank 0's look, shared: no rank reads batch.json while rank 0 writes it
        if meta.is_file():  # a resumed run samples its remaining batches at the size its first ones were
            return int(json.loads(meta.read_text())["sample_batch"])
        if any(folder.glob("batch-*.safetensors")):  # batches saved before batch.json was kept: all were 64
            return SAMPLE_BATCH
        return None

    size = par.share(saved_size)
    if size is None:
        size = sample_batch_for(teacher, seq, n_windows, par)  # on every rank (a collective on GPUs)
        if par.main:
            meta.write_text(json.dumps({"sample_batch": size}))
    n_batches = -(-n_windows // size)
    # a GPU decoding without kept hidden states is compiled (CUDA graphs): the last batch padded to the same shape
    compiled = not keep_hidden and next(teacher.parameters()).device.type == "cuda"
    for first in range(0, n_batches, par.world):  # rounds: every rank samples (or idles) in step with the others
        b = first + par.rank
        f = folder / f"batch-{b:05d}.safetensors"
        mine = b < n_batches and not f.is_file()
        if par.on and not par.any(mine):
            continue
        if mine:
            batch = prompts[b * size:(b + 1) * size]
            sampled = sample_text(teacher, batch, seq - n_prompt, seed * 100_003 + b, batch=size,
                                  keep_hidden=keep_hidden, bf16=bf16, pad=compiled)
            windows, hidden = sampled if keep_hidden else (sampled, None)
            _atomic_save({"windows": windows.contiguous(), **({"hidden": hidden.contiguous()} if keep_hidden else {})},
                         f)
            del windows, hidden, sampled
            release_memory()  # the sampling's KV cache
        else:  # the sharded teacher gathers each layer from every rank: a rank with nothing to do runs as many
            sample_text(teacher, prompts[:1], seq - n_prompt, 0, batch=1, keep_hidden=True, bf16=bf16)  # 1 window
        if progress:
            progress("sampling tuning text", min((first + par.world) * size, n_windows) * seq, n_windows * seq)
    par.arrive("the end of the sampling", then="the tuning text")  # every rank's batch files are written
    return torch.cat([load_file(str(folder / f"batch-{b:05d}.safetensors"))["windows"]
                      for b in range(n_batches)]), size


class TeacherTargets:
    """targets(i) for moeify.training.distill.distill: the teacher's final hidden states of training window i where the
    sampling kept them (the sampled windows, read from the batch files on demand), None for the real text."""

    def __init__(self, folder: Path, first: int, skip: int, batch: int):
        self.first, self.skip, self.batch = first, skip, batch  # train index of the first sampled window; held out
        self.files = [safe_open(str(f), "pt") for f in sorted(folder.glob("batch-*.safetensors"))]
        self.real: dict[int, tuple] = {}  # train index of a real window -> (file, row) of its precomputed targets

    def __call__(self, i: int) -> torch.Tensor | None:
        if i < self.first:
            where = self.real.get(i)
            return None if where is None else where[0].get_slice("hidden")[where[1]]
        j = i - self.first + self.skip
        return self.files[j // self.batch].get_slice("hidden")[j % self.batch]


def drawn_windows(n_train: int, seed: int, per_step: int, steps: int) -> torch.Tensor:
    """The training windows a run draws (moeify.training.distill.WindowStream with the run's seed), sorted, each once."""
    from ..training.steps import WindowStream

    return torch.unique(WindowStream(torch.empty(n_train, 0), seed).take_indices(per_step * steps))


def tuning_data(root: Path, src_path: Path, base: BaseOutput, opts: TuneOptions, seq: int, seed: int, teacher,
                progress: Progress | None, par=None, bf16: bool = False, real: tuple | None = None,
                keep_hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict, TeacherTargets | None]:
    """The run's tuning text, assembled once and saved in the state directory (a resumed run reads it back): every
    window of the real texts, and windows the dense model samples itself (opts.generated of the budget, never
    repeated; sampled under bf16 autocast when `bf16`, as tuning runs), a few of each held out for early stopping.
    real: real_windows' answer when the caller has read the texts already (to refuse bad ones before any work).
    keep_hidden: keep the sampled windows' final hidden states (False: the teacher runs in the loop on them).
    Returns (train, held out, description, the teacher's targets kept from sampling, or None)."""
    from ..training.parallel import Parallel

    par = par or Parallel()
    f = root / "data.safetensors"
    par.arrive("the tuning text")
    if par.share(lambda: not f.is_file()):  # rank 0's look, shared: it writes the file below
        real, held, text = real or real_windows(src_path, text_sources(base, opts), seq)
        train, held_parts = [real], [held]
        n_gen = round(opts.generated * opts.tokens / seq)
        if n_gen:
            n_hold_gen = min(2, max(1, n_gen // 10))
            sampled, size = sampled_windows(teacher, real, n_gen + n_hold_gen, seed, root / "sampled", progress, par,
                                            bf16, keep_hidden)
            train.append(sampled[n_hold_gen:])
            held_parts.append(sampled[:n_hold_gen])
            text["generated"] = {"windows": int(sampled.shape[0]), "held_out": n_hold_gen,
                                 "prompt_tokens": min(16, seq // 4), "first_train_window": int(real.shape[0]),
                                 "sample_batch": size, "bf16_autocast": bf16, "kept_targets": keep_hidden}
        train, held_out = torch.cat(train), torch.cat(held_parts)
        if held_out.shape[0] == 0:  # tiny texts: hold out the last training window rather than nothing
            held_out, train = train[-1:], train[:-1]
        if par.main:
            (root / "data.json").write_text(json.dumps(text))
            _atomic_save({"train": train.contiguous(), "held_out": held_out.contiguous()}, f)
        par.arrive("the end of the tuning text")
    data, text = load_file(str(f)), json.loads((root / "data.json").read_text())
    gen = text.get("generated")
    targets = (TeacherTargets(root / "sampled", gen["first_train_window"], gen["held_out"], gen["sample_batch"])
               if gen and gen.get("kept_targets", True) else None)
    return data["train"], data["held_out"], text, targets
