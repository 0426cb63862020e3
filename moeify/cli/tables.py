"""What every report shares: human-readable counts and sizes, and a table whose cells never get cut."""

from __future__ import annotations

from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def table(title: str, columns: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> Table:
    """A table whose cells never get cut: each column is at least as wide as its widest cell; headers
    may wrap. Columns in `left` are left-justified, the others right-justified."""
    from rich import box

    t = Table(title=title or None, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
              show_edge=False, padding=(0, 1, 0, 0))  # one space between columns: 8 columns fit 80 characters
    for c, name in enumerate(columns):
        t.add_column(name, justify="left" if c in left else "right",
                     min_width=max(len(line) for r in rows for line in r[c].split("\n")))
    for r in rows:
        t.add_row(*r)
    return t


def fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)
