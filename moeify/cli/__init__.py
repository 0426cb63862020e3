"""The face: moeify's command line, the only part that prints.

    app.py       the `moeify` Typer app: convert, eval, plan, inspect, verify, and the tune command's dispatch
    tune.py      `moeify tune`: recovery tuning of a carve, or next-token training of an upcycle or merge
    upcycle.py   `moeify upcycle` and `moeify merge`: flags parsed, the API's two halves called, plan and result shown
    report.py    rich rendering of results (convert, tune, train, inspect)
    report_eval.py, report_plan.py   of `eval` (perplexity, tasks, retention) and of plans (`plan`, --dry-run)
    tables.py    the 80-column tables and the numbers in them
    terminal.py  where messages and tables go, and the progress bars of long work
"""

from .app import main

__all__ = ["main"]
