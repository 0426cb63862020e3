"""`moeify tune --dry-run`: the run's inputs checked as the run checks them, then a few real tuning steps, a batch of
sampling and the teacher pass timed on this device, and the whole run's time and memory estimated from them."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ..formats.checkpoint import CheckpointReader
from ..maths.memory import device_memory
from ..maths.numerics import release_memory, resolve_device
from .data import SAMPLE_BATCH, drawn_windows, real_windows, sample_batch_for, text_sources
from .options import TuneOptions
from .run import check_run
from .sizing import fit_memory, peak_memory, predicted_memory, step_size, teacher_inline
from .student import tuning_student
from .teacher import free_teacher_ffns, load_teacher

BUDGETS = (1 << 20, 10 << 20)  # 1M and 10M tokens: the budgets the dry run also prices


def estimate_run(src: str | Path, out: str | Path, opts: TuneOptions | None, *, resume: bool = False,
                 device: str = "auto", steps: int = 4, offload: bool | None = None, memory_check: bool = True) -> dict:
    """`tune --dry-run`: build the teacher and student as the run would, time `steps` tuning steps on the real text
    (the first is a warm-up) and the sampling of one batch of short continuations, and measure the peak memory.
    Offload (FSDP2 CPU offload of the student's state) as the run would have it: given, or chosen by the memory
    model where the GPU is too small otherwise; a run that fits nowhere here is refused before anything loads, as
    the run itself would be. Writes nothing. Returns the measured rates, the estimated time of the whole run and the
    memory model's prediction (moeify.maths.memory)."""
    from ..training.distill import DistillSettings
    from ..maths.numerics import tuning_autocast
    from ..training.sampling import sample_text, sampling_seconds_per_token
    from ..training.parallel import Parallel

    src, out = Path(src), Path(out)
    run = check_run(src, out, opts, resume=resume, restart=True, base=None, given=None, world=1)
    bo, opts, seq = run.bo, run.opts, run.seq
    dev = resolve_device(device)
    offload = fit_memory(src, bo, opts, Parallel(device=dev), offload, memory_check)
    teacher = load_teacher(src, dev)
    real, held, _ = run.real or real_windows(src, text_sources(bo, opts), seq)
    n_prompt = min(16, seq // 4)
    new = min(seq - n_prompt, 96)  # a full sampling batch, a fifth of a window's new tokens: the cost per step,
    n_sampled = round(opts.generated * opts.tokens / seq)
    size = sample_batch_for(teacher, seq, n_sampled + min(2, max(1, n_sampled // 10))) if n_sampled else SAMPLE_BATCH
    prompts = real[torch.arange(size) % real.shape[0], :n_prompt]  # fitted against the KV cache's length
    stamps: list = []  # the dynamic cache: its steps grow with the length, as the fit assumes (the run's static cache
    # is sized by the whole window, not by these 96 tokens, and is ~20% cheaper: the estimate errs high, not low)
    inline = teacher_inline(src, bo, opts, seq, dev, 1, bool(offload))  # as the run decides (tune_output)
    step, micro = step_size(src, bo, opts, seq, dev, 1, bool(offload), inline)  # as the run steps (GPU: memory)
    settings = DistillSettings(tokens=steps * step, lr=opts.lr, train_router=opts.train_router,
                               train_experts=opts.train_experts, train_attention=opts.train_attention, evals=1,
                               batch_tokens=step, micro_windows=micro, show_every=0.0,  # every step timed
                               hidden_weight=opts.hidden_weight)
    ctx, bf16 = tuning_autocast(dev, settings.autocast)
    sample_text(teacher, prompts, new, 0, batch=size, keep_hidden=not inline, step_times=stamps, cache="dynamic",
                bf16=bf16)
    sampling_rate = sampling_seconds_per_token(stamps, n_prompt, seq) / size * 1024
    # the teacher pass over the windows these steps draw (timed), then the teacher's FFNs freed, as the run does
    held1 = held[:1] if len(held) else real[-1:]
    kept, held_t, teacher_rate = _time_teacher(teacher, bo, real, held1, seq, settings, steps, inline, ctx, dev)
    info, step_s = _time_steps(teacher, run, settings, real, held1, kept, held_t, dev, offload)
    per_step = max(1, settings.batch_tokens // seq) * seq

    def seconds_for(tokens: int) -> tuple[float, float, float, float]:
        """(total, tuning steps, sampling, teacher pass) seconds of a run of `tokens` at these rates and settings
        (a GPU run of more tokens takes larger steps, at least as fast a token: the estimate errs high)."""
        n_steps = -(-tokens // per_step)
        sampled = round(opts.generated * tokens / seq) * seq
        # the real windows the run is expected to draw at least once (draws uniform over real + sampled windows)
        n_real, n_all = real.shape[0], real.shape[0] + sampled // seq
        teacher_tokens = n_real * (1 - (1 - 1 / n_all) ** (n_steps * per_step // seq)) * seq + held.shape[0] * seq
        sampling_s = sampled // seq * (seq - n_prompt) / 1024 * sampling_rate  # generated tokens (prompts are real)
        parts = (n_steps * step_s, sampling_s, teacher_tokens / 1024 * teacher_rate)
        return (sum(parts), *parts)

    total_s, tuning_s, sampling_s, teacher_s = seconds_for(opts.tokens)
    n_steps = -(-opts.tokens // per_step)
    sampled = round(opts.generated * opts.tokens / seq) * seq
    peak, what = peak_memory(dev)
    predicted = predicted_memory(src, bo, opts, seq, dev, settings, offload=offload, sample_batch=size, inline=inline)
    return {"sample_batch": size, "tokens": opts.tokens, "device": dev, "offload": bool(offload), "step_tokens": per_step,
            "micro_windows": micro, "teacher": "inline" if inline else "pass", "moe_kernel": info["moe_kernel"],
            "compiled": info["compiled"], "step_seconds": step_s,
            "tokens_per_second": per_step / step_s, "steps": n_steps, "sampled_tokens": sampled,
            "sampling_seconds_per_1k": sampling_rate, "sampling_seconds": sampling_s,
            "tuning_seconds": tuning_s, "teacher_pass_seconds": teacher_s, "estimated_seconds": total_s,
            # what larger budgets would take here, at the same rates and mix (the quality they buy: README)
            "seconds_for_tokens": {str(n): round(seconds_for(n)[0], 1) for n in BUDGETS},
            "peak_bytes": peak, "peak_what": what, "predicted": predicted.to_dict(),
            "host_peak_bytes": peak_memory("cpu")[0], "device_bytes": device_memory(dev)}


def _time_teacher(teacher, bo, real: torch.Tensor, held1: torch.Tensor, seq: int, settings, steps: int,
                  inline: bool, ctx, dev: str) -> tuple[dict, torch.Tensor | None, float]:
    """The teacher pass over the windows `steps` steps draw and over the held-out window, timed, then the teacher's
    FFNs freed, as the run does: (the kept targets by window, the held-out window's, seconds per 1,024 tokens); with
    the teacher in the loop none of them ({}, None, 0.0)."""
    from ..training.steps import final_hidden

    drawn = [] if inline else drawn_windows(real.shape[0], settings.seed, max(1, settings.batch_tokens // seq), steps)
    t0 = time.time()
    with torch.no_grad(), ctx:
        kept = {int(i): final_hidden(teacher, real[i:i + 1].to(dev)).float().cpu()[0] for i in drawn}
        held_t = None if inline else final_hidden(teacher, held1.to(dev)).float().cpu()
    teacher_rate = 0.0 if inline else (time.time() - t0) / ((len(drawn) + 1) * seq) * 1024
    if not inline:
        free_teacher_ffns(teacher, bo)
        release_memory()
    return kept, held_t, teacher_rate


def _time_steps(teacher, run, settings, real: torch.Tensor, held1: torch.Tensor, kept: dict,
                held_t: torch.Tensor | None, dev: str, offload: bool | None) -> tuple[dict, float]:
    """distill's steps on the student built as the run builds it (offloaded where the run would be): (its info, the
    seconds a step, timed over steps 2..n-1: no warm-up, no held-out check)."""
    from ..training.distill import distill
    from ..maths.numerics import tuning_autocast
    from ..training.parallel import Parallel

    par = Parallel(device=dev)
    if offload:
        from ..training.parallel import with_offload

        par = with_offload(par)
    stamps = []
    try:
        with contextlib.closing(CheckpointReader(run.base)) as reader:
            student = tuning_student(teacher, run.bo, reader, par, run.opts.train_attention,
                                     tuning_autocast(dev, settings.autocast)[1])
        info = distill(teacher, student, real, held1, settings, progress=lambda *a: stamps.append(time.time()),
                       targets=kept.get, held_targets=held_t, par=par)
    finally:
        if par.own_group:
            par.close()
    return info, (stamps[-2] - stamps[0]) / max(1, len(stamps) - 2)
