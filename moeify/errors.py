"""The one exception that user mistakes raise. The CLI prints it on one line and exits with 2."""


class MoeifyError(Exception):
    """A user-facing error: what is wrong (naming the file, tensor or flag) and how to fix it."""

    def __init__(self, what: str, hint: str = ""):
        self.what = what
        self.hint = hint
        super().__init__(f"{what}{' — ' + hint if hint else ''}")
