"""The terminal: where messages and tables go, and the progress bars of long work (a live bar on a terminal, a plain
line a minute in a log file)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from ..errors import MoeifyError, ParallelError

console = Console(stderr=True)
out_console = Console()


def fail(exc: MoeifyError) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)  # e.g. moeify[plot]
    raise typer.Exit(2)


def fail_on_rank(exc: MoeifyError, rank: int) -> None:
    """A run across processes (torchrun, accelerate launch; rank 0 alone otherwise) refused or stopped: a
    ParallelError said by every rank, naming it (the rank that would report may be the one that is gone); any other
    error said by rank 0 alone (every rank refuses what any refuses), the other ranks exiting 2 without a word."""
    if isinstance(exc, ParallelError):
        console.print(f"[bold red]error:[/] rank {rank}: {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    if rank:
        raise typer.Exit(2)
    fail(exc)


JSON_HELP = "Write them as JSON to this file, or to stdout with '-' (the tables then go to stderr)."


def json_option(what: str):
    return typer.Option(None, "--json", metavar="PATH|-", help=f"{what} {JSON_HELP}")


def tables(json_dest: Optional[str]) -> Console:
    """Where human-readable output goes: stdout, unless stdout carries the JSON (--json -)."""
    return console if json_dest == "-" else out_console


def write_json(data: dict, dest: str) -> None:
    """Every command's --json: PATH writes a file (and says so), '-' prints the JSON alone on stdout."""
    text = json.dumps(data, indent=1) + "\n"
    if dest == "-":
        typer.echo(text, nl=False)
        return
    path = Path(dest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise MoeifyError(f"--json {path} cannot be written ({exc.strerror or exc.__class__.__name__})",
                          "give a writable file path, or '-' for stdout") from None
    console.print(f"[bold green]wrote[/] {escape(str(path))}", highlight=False, soft_wrap=True)


def stage_callback(bar: Progress):
    """A progress callback (stage, done, total) that shows one bar per stage."""
    tasks: dict[str, int] = {}

    logged: dict[str, float] = {}

    def on_progress(stage: str, done: int, total: int, note: str = "") -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
            logged[stage] = time.time()
        bar.update(tasks[stage], completed=done, description=f"{stage}: {note}" if note else stage)
        if not bar.console.is_terminal and (time.time() - logged[stage] >= LOG_EVERY or done == total):
            # no live bar in a log file (nohup, a batch job): a plain line now and then instead
            logged[stage] = time.time()
            task = bar.tasks[tasks[stage]]
            eta = f", {task.time_remaining / 60:.0f} min left" if task.time_remaining and done < total else ""
            bar.console.print(f"{time.strftime('%H:%M:%S')} {stage}: {done:,}/{total:,}{eta}" + (f" ({note})" if note
                              else ""), highlight=False, soft_wrap=True)

    return on_progress


LOG_EVERY = 60.0  # seconds between progress lines when stderr is not a terminal


class _CountColumn(ProgressColumn):
    """done/total, in k / M past ten thousand (token counts), so a bar fits an 80-column terminal."""

    @staticmethod
    def _short(n: float) -> str:
        if n >= 1e6:
            return f"{n / 1e6:.2f}M"
        return f"{n / 1e3:.0f}k" if n >= 1e4 else f"{int(n)}"

    def render(self, task) -> Text:
        return Text(f"{self._short(task.completed)}/{self._short(task.total or 0)}", style="progress.download")


def progress_bars() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=12), _CountColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
