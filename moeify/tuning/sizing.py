"""Memory: whether a run fits the device (moeify.maths.memory's model of it, said before anything loads), whether the
student's state is offloaded to host memory, how many tokens a step takes and how many windows a forward, and the
peak a run measured."""

from __future__ import annotations

from pathlib import Path

import torch

from ..maths.memory import device_memory
from .data import SAMPLE_BATCH
from .options import TuneOptions
from .output import BaseOutput


def fit_memory(src: Path, bo: BaseOutput, opts: TuneOptions, par, offload: bool | None, memory_check: bool,
               notify=None) -> bool:
    """Whether the run offloads (given, or where the memory model says the GPU needs it), after refusing a run that
    the model says fits nowhere here (unless memory_check is off). The run and its dry run both decide so."""
    from ..formats.families import load_source
    from ..maths.memory import check_fits, choose_offload

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


REFERENCE_STEP = 1024  # tokens a step on a CPU (where it is at its arithmetic limit at any batch), and the least
MIN_STEPS = 256  # a GPU run's steps at least: its warm-up and cosine stay resolved at any budget (1M tokens: 4,096
# a step; 16M: 65,536)
MAX_STEP = 65536  # tokens a step at most: 64x the reference, its step sizes x 8 by the square-root rule (moeify.training.distill
# .lr_scale), about as far as that rule has been checked (Malladi et al. 2022)
MAX_MICRO = 512  # windows a forward + backward at most
GPU_STEP_SHARE = 0.8  # of the GPU's memory a step's micro-batch may take by the memory model (it measured 6% low)


def teacher_inline(src: Path, bo: BaseOutput, opts: TuneOptions, seq: int, dev: str, world: int = 1,
                   offload: bool = False) -> bool:
    """Whether a new run keeps the teacher in the loop: on one GPU, not offloaded (offloading means memory is
    short), where the memory model says the run fits with the teacher's FFNs kept (in bf16); elsewhere the teacher
    pass computes the targets first and the FFNs are freed. Always with --hidden-weight: the layers' outputs are
    matched in the loop (tune_output refuses it where the teacher cannot run there)."""
    from ..maths.memory import device_memory

    if opts.hidden_weight:
        return True

    if not dev.startswith("cuda") or world > 1 or offload:
        return False
    have = device_memory(dev)
    return have is None or predicted_memory(src, bo, opts, seq, dev, inline=True).peak <= have


def step_size(src: Path, bo: BaseOutput, opts: TuneOptions, seq: int, dev: str, world: int = 1,
              offload: bool = False, inline: bool = False) -> tuple[int, int]:
    """(tokens a step, windows a forward + backward on each process) of a new run. A CPU: --step-tokens or 1,024,
    one window at a time (its arithmetic is the limit: a larger batch buys nothing; BENCHMARKS.md). A GPU: launch-
    bound at small batches, so as many windows a forward as GPU_STEP_SHARE of its memory holds by the memory model
    (up to MAX_MICRO), and --step-tokens or the run's tokens over MIN_STEPS (at least 1,024, at most MAX_STEP) a
    step, a whole number of those forwards on every process."""
    from ..training.distill import DistillSettings
    from ..maths.memory import device_memory

    windows = max(1, (opts.step_tokens or REFERENCE_STEP) // seq)
    if not dev.startswith("cuda"):
        return opts.step_tokens or REFERENCE_STEP, 1
    have = device_memory(dev)
    fit = 1
    while fit < MAX_MICRO and have is not None:
        settings = DistillSettings(tokens=opts.tokens, micro_windows=2 * fit)
        if predicted_memory(src, bo, opts, seq, dev, settings, world=world, offload=offload,
                            inline=inline).peak > GPU_STEP_SHARE * have:
            break
        fit *= 2
    if opts.step_tokens:
        return opts.step_tokens, min(fit, max(1, windows // world))
    target = min(MAX_STEP, max(REFERENCE_STEP, opts.tokens // MIN_STEPS))
    per_rank = max(1, target // seq // world)
    micro = min(fit, per_rank)
    per_rank = per_rank // micro * micro
    return per_rank * world * seq, micro


def predicted_memory(src: Path, bo: BaseOutput, opts: TuneOptions, seq: int, dev: str, settings=None, world: int = 1,
                     offload: bool = False, sample_batch: int = SAMPLE_BATCH, inline: bool = False):
    """moeify.maths.memory's prediction for this run (the config of SRC, the layout of the output; sample_batch: the
    windows sampled at once, SAMPLE_BATCH where the run has not chosen yet, the least it samples; inline: the
    teacher in the loop, its FFNs kept)."""
    from ..training.distill import DistillSettings
    from ..maths.numerics import tuning_autocast
    from ..formats.families import load_source
    from ..maths.memory import source_tuning_memory

    settings = settings or DistillSettings(tokens=opts.tokens)
    return source_tuning_memory(load_source(src), bo.cfg.experts, len(bo.cfg.dense_layers), seq=seq,
                                micro_windows=settings.micro_windows, kl_chunk=settings.kl_chunk,
                                sample_batch=sample_batch, bf16=tuning_autocast(dev, settings.autocast)[1],
                                train_attention=opts.train_attention, train_experts=opts.train_experts,
                                device=dev, world=world, offload=offload,
                                teacher_inline=inline or bool(opts.hidden_weight), layer_match=bool(opts.hidden_weight))


def peak_memory(dev: str) -> tuple[int, str]:
    """The process's peak memory so far on the device tuning ran on (a GPU's allocator, or the peak RSS)."""
    if dev.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(dev))), "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of this process"
