"""A run on every rank, seen from outside (tune_output and train_output both run by it): its errors as the user is
told them, and its process group closed whatever happens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..formats.output import output_errors


def run_across(par, out: Path, run: Callable[[], dict]) -> dict:
    """run() on this rank (one, or each of a torchrun's): an OS error writing OUT or its state one line naming OUT,
    OUT as it was (output_errors); a RuntimeError of a collective that a late or lost rank broke the ParallelError
    that says so (moeify.training.parallel.Parallel.failure), any other as it is; the process group closed at the
    end."""
    try:
        with output_errors(out):  # an OS error writing OUT or its state: one line naming OUT, OUT as it was
            return run()
    except RuntimeError as exc:
        failed = par.failure(exc)
        if failed is None:
            raise
        raise failed from None
    finally:
        par.close()
