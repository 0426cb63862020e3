"""`moeify tune`: recovery tuning of a carve towards its dense source, or, for an output of `moeify upcycle` or
`moeify merge`, training on text (moeify.cli.upcycle.train_cmd). moeify.cli.app registers it among the commands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import MoeifyError
from .terminal import console, fail_on_rank, progress_bars, stage_callback
from .terminal import fail as _fail, json_option as _json_option, tables as _tables, write_json as _write_json


def interrupted_tuning(src: Path, out: Path) -> None:
    """Say where an interrupted tuning was saved and the command that continues it; exit 130."""
    from ..tuning import TuningState, resume_command, state_dir

    done = TuningState(state_dir(out)).progress()
    what = f"saved at step {done[0]:,} of {done[1]:,}" if done else "the tuning text sampled so far is saved"
    console.print(f"[bold red]interrupted[/]: tuning {what} in {escape(str(state_dir(out)))}; continue it with:\n"
                  f"  {escape(resume_command(src, out))}", highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def tune_cmd(
    src: Path = typer.Argument(..., help="The dense source checkpoint OUT was converted from (the teacher); not "
                               "given for an output of moeify upcycle / merge, which trains on text alone."),
    out: Optional[Path] = typer.Argument(None, help="A moeify output (tuned or not); replaced by the tuned model when "
                                         "the run ends."),
    tokens: Optional[int] = typer.Option(None, "--tokens", "--tune-tokens", help="Fresh tuning tokens of this run "
                                         "(a warm-up, then a cosine: --schedule). Quality keeps improving with tokens "
                                         "(BENCHMARKS.md); --dry-run says the time here; use a GPU for 7B+."),
    calib: Optional[list[Path]] = typer.Option(None, "--calib", help="Real tuning text (.txt/.jsonl; repeatable) "
                                               "[default: the text OUT was calibrated on, from its moeify.toml]."),
    tune_text: Optional[list[Path]] = typer.Option(None, "--tune-text", help="More real tuning text; repeatable "
                                                   "(a few hundred thousand tokens of prose kept task accuracy "
                                                   "that the sample and sampled text alone lost, BENCHMARKS.md) "
                                                   "[default: OUT's own --tune-text: a preset's bundled prose]."),
    tune_generated: Optional[float] = typer.Option(None, "--tune-generated", help="Share of the tuning tokens the "
                                                   "dense model samples itself; each run samples new text "
                                                   "[default: 0.5]."),
    lr: Optional[float] = typer.Option(None, "--lr", "--tune-model-lr", help="Adam step relative to each weight's "
                                       "RMS [default: 0.003]."),
    tune_router: Optional[bool] = typer.Option(None, "--tune-router/--freeze-router", help="Also train the routers "
                                               "[default: on]."),
    tune_attention: Optional[bool] = typer.Option(None, "--tune-attention/--experts-only", help="Also train "
                                                  "attention projections and RMSNorm weights [default: off]."),
    hidden_weight: Optional[float] = typer.Option(None, "--hidden-weight", help="Also match every decoder layer's "
                                                  "output to the dense model's: the loss adds this times the layers' "
                                                  "mean squared error relative to the dense states (on SmolLM2's 50% "
                                                  "carve the KL's gradient is ~20x the layer term's at weight 1); the "
                                                  "teacher then runs in the loop, in one process (there: 1.15x a CPU "
                                                  "step) [default: 0, the logit KL alone]."),
    seed: Optional[int] = typer.Option(None, help="Seed of the token stream and the sampled text [default: OUT's "
                                       "seed + 1000 x the number of earlier runs, so every run sees new text]."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="Step-size schedule of a tuned OUT's further "
                                           "tuning: continue = the rest of one cosine over its earlier tuning tokens "
                                           "and these (a doubling starts at half the peak step); restart = a whole "
                                           "cosine from the peak [default: continue]."),
    step_tokens: Optional[int] = typer.Option(None, "--step-tokens", help="Tokens a step (step sizes x sqrt(it / "
                                              "1,024) above 1,024) [default: CPU 1,024; GPU tokens / 256, to 65,536]."),
    device: str = typer.Option("auto", help="auto (a GPU if there is one) | cpu | cuda."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run saved in OUT.moeify-tune "
                                "(its settings; flags that differ are refused)."),
    restart: bool = typer.Option(False, "--restart", help="Discard an interrupted run's state and start anew."),
    save_every: float = typer.Option(600.0, "--save-every", metavar="SECONDS", help="Save the run's state this "
                                     "often (also at the end and on Ctrl-C / SIGTERM); 0 = after every step."),
    memory_check: bool = typer.Option(True, "--memory-check/--no-memory-check", help="Refuse a run whose "
                                      "predicted peak memory per process exceeds the device's."),
    offload: Optional[bool] = typer.Option(None, "--offload/--no-offload", help="Keep the student's trainable "
                                           "weights, gradients and Adam state in host memory (FSDP2 CPU offload; "
                                           "the GPU holds a layer or two at a time): an 8B model's tuning on one "
                                           "80 GB GPU [default: when the GPU is too small otherwise]."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Time a few tuning steps and the sampling, measure peak "
                                 "memory, print the estimated time of the run, and write nothing."),
    timeout: Optional[float] = typer.Option(None, "--timeout", metavar="SECONDS", help="Across processes "
                                            "(torchrun): how long a rank waits for the others at a phase or in a "
                                            "collective before every rank stops with an error naming the late "
                                            "rank [default: $MOEIFY_TIMEOUT, else 600]."),
    router_only: bool = typer.Option(False, "--router-only", help="Train the routers alone, the experts frozen "
                                     "as they are (a carve's: what routing alone recovers; then tune again "
                                     "without it for the experts)."),
    aux_loss_coef: Optional[float] = typer.Option(None, "--aux-loss-coef", help="Upcycled or merged OUT: α of the "
                                                  "load-balancing loss [default: OUT's router_aux_loss_coef]."),
    json_dest: Optional[str] = _json_option("The tuned output's report (--dry-run: the estimate)."),
) -> None:
    """Recovery tuning of a moeify output: distil its experts and routers towards the dense source's next-token
    distributions on fresh tokens, and write the tuned model back to OUT (all or nothing). An output of `moeify
    upcycle` or `moeify merge` (OUT alone) trains instead on --tune-text: next-token loss plus Mixtral's
    load-balancing loss, the expert load reported as it trains (docs/upcycling.md).

    A tuned output can be tuned again for more tokens: it continues from its weights, and report.json and
    moeify.toml keep the whole history. The run saves its state every --save-every seconds and on Ctrl-C; a killed
    run continues with --resume and ends with the weights an uninterrupted run would have.

    Example: moeify tune path/to/Llama-3-8B out/llama-moe --tokens 1048576
    Example: moeify tune out/upcycled --tune-text corpus.txt --tokens 4194304
    """
    from ..tuning.lm import is_trainable_output

    if out is None or is_trainable_output(out):
        from .upcycle import train_cmd

        if hidden_weight is not None:
            _fail(MoeifyError("--hidden-weight matches a carve to its dense source; an output of moeify upcycle or "
                              "merge trains on text alone", "drop --hidden-weight"))

        return train_cmd(out or src, None if out is None else src, dict(
            tokens=tokens, text=[*(calib or []), *(tune_text or [])], lr=lr, train_router=tune_router,
            train_attention=tune_attention, router_only=router_only, aux_loss_coef=aux_loss_coef, seed=seed,
            step_tokens=step_tokens, device=device, resume=resume, restart=restart, save_every=save_every,
            memory_check=memory_check, offload=bool(offload), timeout=timeout, json_dest=json_dest), dict(
            tune_generated=tune_generated, schedule=schedule, dry_run=dry_run or None))
    if aux_loss_coef is not None:
        _fail(MoeifyError(f"--aux-loss-coef is for an output of moeify upcycle or merge; {out} is a carve",
                          "a carve's routers learn from the KL to its dense source, without a balancing loss"))
    given = {"tokens": tokens, "lr": lr, "generated": tune_generated,
             "calib": None if calib is None else tuple(str(f) for f in calib),
             "tune_text": None if tune_text is None else tuple(str(f) for f in tune_text),
             "train_router": tune_router, "train_experts": False if router_only else None,
             "train_attention": tune_attention, "seed": seed, "schedule": schedule,
             "step_tokens": step_tokens, "hidden_weight": hidden_weight}
    run = dict(resume=resume, restart=restart, device=device, save_every=save_every, memory_check=memory_check,
               offload=offload, timeout=timeout)
    _tune_carve(src, out, given, run, dry_run, json_dest)


def _tune_carve(src: Path, out: Path, given: dict, run: dict, dry_run: bool, json_dest: Optional[str]) -> None:
    """`moeify tune SRC OUT` on a carve, `given` its options as the user set them (None: not set), `run` how it runs:
    the run (on every rank of a torchrun; rank 0 reports) or its --dry-run estimate; a refusal, a stop or an
    interruption said as a run across processes says it."""
    from ..tuning import TuneOptions, TuningInterrupted

    rank = int(os.environ.get("RANK", "0"))
    try:
        opts = None
        if not run["resume"]:
            if given["tokens"] is None:
                raise MoeifyError("--tokens is required (the tuning budget of this run)",
                                  f"e.g. moeify tune {src} {out} --tokens 262144; or --resume an interrupted run")
            opts = TuneOptions(**{k: v for k, v in given.items() if v is not None})
        if dry_run:
            _estimate(src, out, opts, run, json_dest)
        else:
            _tune(src, out, given, run, rank, json_dest)
    except MoeifyError as exc:
        fail_on_rank(exc, rank)
    except TuningInterrupted:
        if rank:
            raise typer.Exit(130)
        interrupted_tuning(src, out)
    except KeyboardInterrupt:
        from ..tuning import state_dir

        if rank:
            raise typer.Exit(130)
        if (state_dir(out) / "run.json").is_file():
            interrupted_tuning(src, out)
        console.print(f"[bold red]interrupted[/]: {escape(str(out))} was left as it was")
        raise typer.Exit(130)


def _estimate(src: Path, out: Path, opts, run: dict, json_dest: Optional[str]) -> None:
    """`tune --dry-run`: the run's time and memory estimated from a few steps here, in one process."""
    from ..formats.hub import resolve
    from ..tuning import estimate_run
    from .report import print_tuning

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MoeifyError("--dry-run measures one process", "run it without torchrun / accelerate launch")
    est = estimate_run(resolve(src), out, opts, resume=run["resume"], device=run["device"], offload=run["offload"],
                       memory_check=run["memory_check"])
    print_tuning(_tables(json_dest), est, estimate=True)
    if json_dest:
        _write_json(est, json_dest)


def _tune(src: Path, out: Path, given: dict, run: dict, rank: int, json_dest: Optional[str]) -> None:
    """The run on this rank; rank 0 shows its progress and reports it."""
    from ..api import tune as run_tune
    from .report import print_tuning

    run = dict(run, **{k: v for k, v in given.items() if k != "tokens"})
    if rank:  # a process of a torchrun / accelerate launch other than the first: rank 0 reports
        run_tune(src, out, given["tokens"], **run)
        return
    with progress_bars() as bar:
        report = run_tune(src, out, given["tokens"], progress=stage_callback(bar), **run,
                          notify=lambda msg: console.print(f"[yellow]{escape(msg)}[/]", highlight=False))
    print_tuning(_tables(json_dest), report, out=out)
    if json_dest:
        _write_json(report, json_dest)


__all__ = ["tune_cmd", "interrupted_tuning"]
