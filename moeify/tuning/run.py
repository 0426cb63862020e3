"""A tuning run from start to end: every refusal before any work (check_run), the state directory begun, the
teacher, tuning text and teacher pass, the student distilled (moeify.training.distill.distill), and the tuned output written
all or nothing. `moeify tune SRC OUT` and `moeify convert --tune-tokens N` both run tune_output."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..formats.checkpoint import CheckpointReader
from ..formats.output import check_free_space, commit_output, prepare_output
from ..errors import MoeifyError
from ..formats.families import SourceModel, load_source
from ..maths.numerics import release_memory, resolve_device
from .across import run_across
from .data import SAMPLE_BATCH, real_windows, text_sources, tuning_data
from .options import Progress, TuneOptions
from .output import BaseOutput, _check_written, _updated_report, check_source, read_output, write_tuned
from .sizing import fit_memory, peak_memory, predicted_memory, step_size, teacher_inline
from .state import (SAVE_EVERY, STATE_VERSION, TuningState, _atomic_write, _lock, _stop_on_signal, base_fingerprint,
                    check_resumable, describe_state, read_run, recorded_options, resume_command, source_fingerprint,
                    state_dir)
from .student import gather_student, local_bytes, tuning_student
from .teacher import free_teacher_ffns, load_teacher, teacher_pass


@dataclass
class CheckedRun:
    """A run every input of which has been checked (check_run): what the rest of the run needs of them."""

    source: SourceModel
    base: Path  # the output tuned: OUT, or the carve an interrupted convert left in the state directory
    bo: BaseOutput
    opts: TuneOptions
    seq: int  # tokens a window
    real: tuple | None  # the real texts' windows (data.real_windows), read up front where the run still needs them


def check_run(src: Path, out: Path, opts: TuneOptions | None, *, resume: bool, restart: bool, base: Path | None,
              given: dict | None, world: int) -> CheckedRun:
    """Everything a run refuses, refused before it changes or loads anything: contradicting flags, the source (a
    dense checkpoint, the model OUT was carved from: output.check_source), OUT (a moeify output with something to
    tune, whole: every weight file's header and length), the tuning texts (read and tokenized), and on --resume
    the saved state (every file checked, and its source, base, options and process count the same)."""
    root = state_dir(out)
    if resume and restart:
        raise MoeifyError("--resume and --restart contradict each other", "pass one of them")
    source = load_source(src)  # a dense llama/mistral/qwen2 checkpoint, or a clear error
    if resume:
        if not (root / "run.json").is_file():
            raise MoeifyError(f"there is no interrupted tuning of {out} to resume (no {root.name}/run.json)",
                              f"start one: moeify tune {src} {out} --tokens N")
        run_info = check_resumable(root)
        if run_info.get("world_size", 1) != world:
            raise MoeifyError(f"{root} was saved by a run across {run_info.get('world_size', 1)} process(es); this "
                              f"one has {world}", "resume with the same number of processes (the token stream "
                              "is split by rank), or start anew with --restart")
        base = root / run_info["base"] if run_info["base"] == "carved" else out
        saved = recorded_options(root, run_info)
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
        if (root / "run.json").exists() and not restart:
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
    with contextlib.closing(CheckpointReader(base)) as reader:  # OUT whole: every shard's header and length
        check_source(source, bo, reader)
    max_len = int(source.raw.get("max_position_embeddings") or cfg.calib_seq_len)
    seq = int(bo.report.get("calibration", {}).get("seq_len") or min(cfg.calib_seq_len, max_len))
    real = None
    if not (resume and (root / "data.safetensors").is_file()):  # the texts: read, tokenized, cut into windows
        real = real_windows(src, text_sources(bo, opts), seq)
    return CheckedRun(source, base, bo, opts, seq, real)


def begin_state(root: Path, src: Path, run: CheckedRun, *, resume: bool, restart: bool, seed: int, run_index: int,
                world: int, micro_windows: int = 1, teacher: str = "pass") -> None:
    """The state directory of a checked run (rank 0): locked, and for a new run, emptied of a restarted one (an
    interrupted convert's carve kept) and described in run.json."""
    if resume:
        _lock(root)
        return
    carved = run.base.resolve().parent == root.resolve()
    if restart and root.exists():
        _lock(root)
        for f in root.iterdir():
            if not (carved and f.name == "carved"):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    root.mkdir(parents=True, exist_ok=True)
    _lock(root)
    _atomic_write(root / "run.json", json.dumps({
        "version": STATE_VERSION, "created": time.time(), "source": source_fingerprint(src),
        "base": "carved" if carved else "out", "base_fingerprint": base_fingerprint(run.base),
        "options": dataclasses.asdict(run.opts), "seed": seed, "run_index": run_index, "world_size": world,
        "micro_windows": micro_windows, "teacher": teacher}).encode())


def discard_unworked_state(root: Path) -> None:
    """A new run refused after its state directory was begun (an input no check found before): remove what it
    wrote, unless it saved work a --resume would use (sampled text, teacher targets, a snapshot). An interrupted
    convert's carve stays."""
    worked = (root / "state.json").exists() or any(root.glob("sampled/batch-*")) or any(root.glob("targets/batch-*"))
    if worked or not root.is_dir():
        return
    for f in root.iterdir():
        if f.name != "carved":
            shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        root.rmdir()  # empty unless a carve waits in it


def tune_output(src: str | Path, out: str | Path, opts: TuneOptions | None = None, *, resume: bool = False,
                restart: bool = False, device: str = "auto", save_every: float = SAVE_EVERY,
                progress: Progress | None = None, notify: Callable[[str], None] | None = None,
                base: Path | None = None, given: dict | None = None, memory_check: bool = True,
                offload: bool | None = None, precompute_targets: bool | None = None,
                timeout: float | None = None) -> dict:
    """Tune the moeify output OUT (or `base`, the carve convert has just written) towards its dense source SRC and
    write the result to OUT all or nothing. Returns the new report.json.

    offload: keep the student's trainable tensors, gradients and optimizer state in host memory (FSDP2 CPU offload;
    moeify.training.parallel); None: when the GPU is too small otherwise and the offloaded run fits (moeify.maths.memory).
    precompute_targets: the teacher pass (teacher_pass) before tuning, the teacher's FFNs freed after it, and the
    sampled windows' hidden states kept from sampling; False: the teacher runs on every window inside the loop
    (nothing on disk: at 16M tokens the sampled text's would be 9.7 GB for SmolLM2, 69 GB at 8B); None: in the loop
    on one GPU where it fits (sizing.teacher_inline), the pass elsewhere. A resumed run keeps its own.
    resume: continue the interrupted run saved in OUT.moeify-tune (opts None: its own; `given`, the options the
    caller set explicitly, must agree with it). restart: discard such a state and start anew.
    timeout: across processes, the seconds a rank waits for the others (moeify.training.parallel.collective_timeout).

    Across processes every rank checks the inputs and any rank's refusal is every rank's; rank 0 decides what
    depends on the device or on files (offload, the step, the teacher's place, the state found) and shares it."""
    from ..training.parallel import setup

    src, out = Path(src), Path(out)
    root = state_dir(out)
    par = setup(resolve_device(device), timeout)
    par.resume_hint = resume_command(src, out)
    return run_across(par, out, lambda: _tune_across(
        src, out, root, par, opts, resume=resume, restart=restart, save_every=save_every, progress=progress,
        notify=notify, base=base, given=given, memory_check=memory_check, offload=offload,
        precompute_targets=precompute_targets))


def _tune_across(src: Path, out: Path, root: Path, par, opts: TuneOptions | None, *, resume: bool, restart: bool,
                 save_every: float, progress, notify, base: Path | None, given: dict | None, memory_check: bool,
                 offload: bool | None, precompute_targets: bool | None) -> dict:
    """tune_output's run on every rank (one, or each of a torchrun's): its checks agreed, its decisions shared."""
    def checks():
        run = check_run(src, out, opts, resume=resume, restart=restart, base=base, given=given, world=par.world)
        if run.opts.hidden_weight and (par.world > 1 or precompute_targets):
            raise MoeifyError("--hidden-weight runs the teacher in the tuning loop, in one process",
                              "tune with it on one device (no torchrun), or without it")
        if par.main:  # only rank 0 writes
            check_free_space(out, sum(f.stat().st_size for f in run.base.glob("*.safetensors")), overwrite=True)
        return run, fit_memory(src, run.bo, run.opts, par, offload, memory_check, notify if par.main else None)

    run, fits = par.agree(checks, "checking the inputs")  # one rank's refusal is every rank's
    offload_on = bool(par.share(fits))  # each rank's device memory may differ: rank 0's choice for all

    def steps() -> dict:
        if resume:  # as the interrupted run stepped (states from before these were recorded: 1 window, a pass)
            recorded = read_run(root)
            return {"micro": int(recorded.get("micro_windows", 1)), "teacher": recorded.get("teacher", "pass"),
                    "step": None}
        # on one GPU the teacher in the loop where it fits; the device's step (recorded in the options)
        inline = (teacher_inline(src, run.bo, run.opts, run.seq, par.device, par.world, offload_on)
                  if precompute_targets is None else not precompute_targets)
        step, micro = step_size(src, run.bo, run.opts, run.seq, par.device, par.world, offload_on, inline)
        return {"micro": micro, "teacher": "inline" if inline else "pass", "step": step}

    chosen = par.share(steps)
    micro, teacher = chosen["micro"], chosen["teacher"]
    if chosen["step"] is not None:
        run = dataclasses.replace(run, opts=dataclasses.replace(run.opts, step_tokens=chosen["step"]))
    run_index = len(run.bo.runs)
    seed = run.opts.seed if run.opts.seed is not None else run.bo.cfg.seed + 1000 * run_index
    par.agree(lambda: par.main and begin_state(root, src, run, resume=resume, restart=restart, seed=seed,
                                               run_index=run_index, world=par.world, micro_windows=micro,
                                               teacher=teacher), "beginning the state directory")
    try:
        return _tune(src, out, root, run, par, seed=seed, resume=resume, save_every=save_every,
                     progress=progress if par.main else None, notify=notify if par.main else None,
                     offload=offload_on, micro_windows=micro, precompute_targets=teacher == "pass")
    except MoeifyError:
        if par.main and not resume:
            discard_unworked_state(root)
        raise


def _tune(src: Path, out: Path, root: Path, run: CheckedRun, par, *, seed: int, resume: bool, save_every: float,
          progress: Progress | None, notify: Callable[[str], None] | None, offload: bool, micro_windows: int,
          precompute_targets: bool) -> dict:
    """The run's work, once its inputs are checked and its state directory begun (tune_output)."""
    from ..training.distill import DistillSettings, distill
    from ..maths.numerics import tuning_autocast

    bo, opts, seq, dev = run.bo, run.opts, run.seq, par.device
    if par.on and not precompute_targets:
        raise ValueError("across processes the teacher is sharded and runs in step on every rank: only the teacher "
                         "pass (precompute_targets) can run it")
    teacher = par.agree(lambda: load_teacher(src, dev, par), "loading the teacher")
    teacher_bytes = local_bytes(teacher)
    schedule_from = opts.schedule_from(sum(int(r.get("tokens", 0)) for r in bo.runs))
    settings = DistillSettings(tokens=opts.tokens, lr=opts.lr, train_router=opts.train_router,
                               train_experts=opts.train_experts, train_attention=opts.train_attention, seed=seed,
                               schedule_from=schedule_from,
                               batch_tokens=opts.step_tokens or DistillSettings.batch_tokens,
                               micro_windows=micro_windows, hidden_weight=opts.hidden_weight)
    bf16 = tuning_autocast(dev, settings.autocast)[1]
    # with the teacher in the loop, the sampled windows' hidden states are not kept (it computes them there)
    train, held, text, targets = tuning_data(root, src, bo, opts, seq, seed, teacher, progress, par, bf16=bf16,
                                             real=run.real, keep_hidden=precompute_targets)
    held_targets = None
    if precompute_targets:
        par.arrive("the teacher pass")
        targets, held_targets = teacher_pass(root, teacher, train, held, targets, settings, progress, par)
        free_teacher_ffns(teacher, bo)
        release_memory()
    reader = CheckpointReader(run.base)
    if offload:
        from ..training.parallel import with_offload

        par = with_offload(par)
    try:
        student = tuning_student(teacher, bo, reader, par, opts.train_attention, bf16)
        state = TuningState(root, save_every, par)
        saved = state.load()
        par.arrive("the tuning loop")
        with _stop_on_signal(state, notify):
            info = distill(teacher, student, train, held, settings, progress=progress, state=state, resume=saved,
                           targets=targets, par=par, held_targets=held_targets)
        par.arrive("writing the output")
        if par.sharded:
            gather_student(student, teacher, keep=par.main)
    except BaseException:
        reader.close()
        if par.own_group:
            par.close()
        raise
    info["offload"] = bool(offload)
    info["teacher"] = "pass" if precompute_targets else "inline"  # its targets computed before the loop, or in it
    info["teacher_bytes"] = teacher_bytes  # this process's share of the teacher, as loaded (rank 0's)
    info["peak_bytes"], info["peak_what"] = peak_memory(dev)
    predicted = predicted_memory(src, bo, opts, seq, dev, settings, world=par.world, offload=bool(offload),
                                 sample_batch=(text.get("generated") or {}).get("sample_batch", SAMPLE_BATCH),
                                 inline=not precompute_targets)
    info["predicted_peak_bytes"] = predicted.peak
    if dev.startswith("cuda"):  # the host side of a GPU run: measured peak RSS beside the predicted host memory
        info["host_peak_bytes"], info["predicted_host_bytes"] = peak_memory("cpu")[0], predicted.host_total
    info = {"scope": "model", "lr": opts.lr, "schedule": opts.schedule, "schedule_from": round(schedule_from, 6),
            "seed": seed, "text": text, "resumed": bool(resume),  # from a saved state, in sampling or in tuning
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **({"hidden_weight": opts.hidden_weight} if opts.hidden_weight else {}), **info}
    del teacher
    release_memory()
    report, toml = _updated_report(bo, info, opts)
    if par.main:
        _write_output(src, out, root, bo, reader, student, opts.train_attention, report, toml)
    reader.close()  # the other ranks do not wait for rank 0's write (a 70B output takes longer than any timeout)
    if par.own_group:
        par.close()
    return report


def _write_output(src: Path, out: Path, root: Path, bo: BaseOutput, reader: CheckpointReader, student,
                  train_attention: bool, report: dict, toml: dict) -> None:
    """The tuned output written to OUT all or nothing (rank 0), then the state directory removed."""
    tmp = prepare_output(out, overwrite=True, src=src)
    try:
        write_tuned(bo, reader, student, tmp, train_attention, report, toml)
        reader.close()
        _check_written(tmp, reader)
        commit_output(tmp, out)
    except BaseException:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(root, ignore_errors=True)
