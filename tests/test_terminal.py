"""moeify.cli.terminal: the progress bars' plain lines in a log file (no live bar there)."""

from __future__ import annotations

import io
import re

from rich.console import Console

from moeify.cli import terminal


def test_log_file_gets_a_line_a_minute_and_the_last(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(terminal, "console", Console(file=buf, force_terminal=False, width=80))  # a log file
    bars = terminal.progress_bars()
    clock = [1000.0]
    monkeypatch.setattr(terminal.time, "time", lambda: clock[0])
    on_progress = terminal.stage_callback(bars)
    on_progress("tuning", 0, 4096)
    on_progress("tuning", 1024, 4096, "KL 1.2")  # under a minute later: no line
    assert "tuning" not in buf.getvalue()
    clock[0] += terminal.LOG_EVERY
    on_progress("tuning", 2048, 4096, "KL 0.9")
    on_progress("tuning", 4096, 4096)  # the end always has its line
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    assert len(lines) == 2, lines
    # HH:MM:SS stage: done/total[, N min left (rich's own estimate)] (note); the last line has no estimate
    assert re.fullmatch(r"\d\d:\d\d:\d\d tuning: 2,048/4,096(, \d+ min left)? \(KL 0\.9\)", lines[0]), lines[0]
    assert re.fullmatch(r"\d\d:\d\d:\d\d tuning: 4,096/4,096", lines[1]), lines[1]
    assert len(lines[0]) <= 80


def test_counts_are_short_enough_for_80_columns():
    short = terminal._CountColumn._short
    assert (short(999), short(65_536), short(16_777_216)) == ("999", "66k", "16.78M")
