"""The one exception that user mistakes raise (and its kind for a multi-process run that cannot go on). The CLI prints
it on one line and exits with 2."""


class MoeifyError(Exception):
    """A user-facing error: what is wrong (naming the file, tensor or flag) and how to fix it."""

    def __init__(self, what: str, hint: str = ""):
        self.what = what
        self.hint = hint
        super().__init__(f"{what}{' — ' + hint if hint else ''}")


class ParallelError(MoeifyError):
    """A run across processes that cannot go on: a rank did not arrive within the collective timeout, a collective
    failed (another rank died), or a stop did not finish in time. Every rank that sees it prints it, not only rank 0
    (the rank that would report may be the one that is gone)."""
