"""Preset layouts stated as shares of d_ff and resolved per model: the expert count, shared width and top-k.

A preset that says "48 routed + 16 shared experts, top-16" fixes 64 slices of d_ff whatever the model, and at the
shapes people carve that gives widths no quantized kernel takes (d_ff 14,336 / 64 = 224: not a multiple of 128 or
256). A `[layout]` table states what the preset means instead:

    [layout]
    active = 0.5          # share of d_ff active per token (shared expert + top-k routed experts)
    shared = 0.25         # share of d_ff in the always-on shared expert
    slices = 64           # the granularity the preset was chosen at (slices of d_ff = routed + shared experts)
    max_top_k = 16        # the largest top-k the preset's engines run (llama.cpp: 16)
    width = 128           # the expert width it prefers where d_ff has it (0: none)
    quanta = [256, 128, 32]  # expert widths it prefers, best first (K-quants; FP8 block / Marlin; Q8_0)

and `resolve_layout` picks, for one model's d_ff, the slice count U (every expert d_ff / U wide) that

1. divides d_ff (experts are equal slices, no padding),
2. keeps top-k within max_top_k and the active share within `tolerance` (2 points) of the preset's,
3. lies within a factor of two of `slices` (finer or coarser than that is another preset, not this one),
4. has experts exactly `width` wide, where one does,
5. has the width that fits the most preferred quantum (256 before 128 before 32 before none),
6. and, among those, is closest to `slices` (the granularity the preset's quality was measured at).

A serving format (`--serve`) brings its own quanta; the preferred width stays where the format takes it (a multiple
of its first quantum: not for K-quants' 256).

Explicit --experts / --shared / --top-k win: each one given is kept and the rest are resolved around it (rules 2's
share and 3 are then only preferences). The resolved counts and the reason are written to OUT/moeify.toml, so the
output's moeify.toml reproduces the conversion exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..errors import MoeifyError

LAYOUT_KEYS = ("active", "shared", "slices", "max_top_k", "width", "quanta", "tolerance", "resolved")
# what each serving format asks of an expert's width (`--serve`): the quanta it prefers, best first, and why
SERVE_QUANTA = {
    "k-quants": ((256, 128, 32), "llama.cpp Q4_K_M, Q5_K", "llama.cpp's K-quants need widths of 256 (else 128, 32)"),
    "fp8": ((128, 32), "vLLM FP8, Marlin int4", "vLLM's FP8 block and int4 Marlin kernels need widths of 128"),
    "q8_0": ((32,), "llama.cpp Q8_0, Q4_0", "llama.cpp's Q8_0 / Q4_0 need widths of 32"),
    "bf16": ((1,), "bf16 / fp16 anywhere", "bf16 and fp16 take any width"),
}


def serve_quanta(serve: str) -> tuple[int, ...]:
    if serve not in SERVE_QUANTA:
        raise MoeifyError(f"--serve {serve!r} is not a serving format moeify knows",
                          f"one of: {', '.join(SERVE_QUANTA)}")
    return SERVE_QUANTA[serve][0]


@dataclass(frozen=True)
class Layout:
    active: float  # share of d_ff active per token
    shared: float = 0.0  # share of d_ff in the shared expert
    slices: int = 64  # preferred granularity (routed + shared experts)
    max_top_k: int = 16
    width: int = 0  # the expert width preferred where d_ff has it within the window (0: none)
    quanta: tuple[int, ...] = (256, 128, 32)
    tolerance: float = 0.02  # allowed distance of the resolved active share from `active`
    resolved: str = ""  # how the counts were chosen for the model converted (written by convert)

    def validate(self, where: str = "[layout]") -> None:
        if not isinstance(self.active, (int, float)) or isinstance(self.active, bool) or not 0 < self.active <= 1:
            raise MoeifyError(f"{where} active must be a share in (0, 1], got {self.active!r}",
                              "e.g. active = 0.5 for half of the FFN neurons per token")
        if not isinstance(self.shared, (int, float)) or isinstance(self.shared, bool) or \
                not 0 <= self.shared < self.active:
            raise MoeifyError(f"{where} shared must be a share in [0, active), got {self.shared!r}",
                              "the shared expert is part of the active share; 0 for none")
        for name in ("slices", "max_top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise MoeifyError(f"{where} {name} must be an integer ≥ 2, got {v!r}")
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 0:
            raise MoeifyError(f"{where} width must be a non-negative integer (0: no preference), got {self.width!r}")
        if not self.quanta or any(not isinstance(q, int) or isinstance(q, bool) or q < 1 for q in self.quanta):
            raise MoeifyError(f"{where} quanta must be a list of positive widths, best first, got {list(self.quanta)!r}",
                              "e.g. quanta = [256, 128, 32]")
        if not isinstance(self.tolerance, (int, float)) or not 0 <= self.tolerance < 0.5:
            raise MoeifyError(f"{where} tolerance must be in [0, 0.5), got {self.tolerance!r}")

    def spec(self) -> str:
        """One line: what the preset asks for."""
        shared = f", shared {self.shared:.1%}" if self.shared else ""
        width = f"width {self.width} where d_ff has it, else " if self.width else ""
        return (f"{self.active:.1%} active{shared}, ~{self.slices} slices, top-k ≤ {self.max_top_k}, {width}widths "
                f"preferred: {' > '.join(map(str, self.quanta))}")

    def for_serving(self, quanta: tuple[int, ...]) -> Layout:
        """The layout with a serving format's quanta; its preferred width kept where the format takes it."""
        return replace(self, quanta=quanta, width=self.width if self.width % quanta[0] == 0 else 0)


def layout_from_table(table: dict, where: str) -> Layout:
    """A Layout from a preset's [layout] table; unknown keys and bad values are errors naming the preset."""
    if not isinstance(table, dict):
        raise MoeifyError(f"{where}: layout must be a table ([layout]), got {table!r}")
    table = {k.replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(table) - set(LAYOUT_KEYS))
    if unknown:
        raise MoeifyError(f"{where}: [layout] has unknown key(s): {', '.join(unknown)}",
                          f"known keys: {', '.join(LAYOUT_KEYS)}")
    if "active" not in table:
        raise MoeifyError(f"{where}: [layout] needs active (the share of d_ff active per token)")
    if isinstance(table.get("quanta"), list):
        table["quanta"] = tuple(table["quanta"])
    layout = Layout(**table)
    layout.validate(f"{where}: [layout]")
    return layout


@dataclass(frozen=True)
class Candidate:
    slices: int  # routed + shared experts
    experts: int
    shared: int
    top_k: int
    width: int
    quantum: int  # the first preferred quantum the width is a multiple of; 0: none

    @property
    def active(self) -> float:
        return (self.shared + self.top_k) / self.slices


@dataclass(frozen=True)
class Resolution:
    layout: Layout
    d_ff: int
    chosen: Candidate
    pinned: tuple[str, ...]  # the counts given explicitly
    considered: list[Candidate] = field(default_factory=list)  # every valid candidate, best first

    @property
    def why(self) -> str:
        c, lay = self.chosen, self.layout
        head = (f"d_ff {self.d_ff:,} = {c.slices} × {c.width}: "
                + (f"shared {c.shared} + " if c.shared else "") + f"top-{c.top_k} of {c.experts} routed = "
                f"{c.active:.1%} active")
        if self.pinned:
            return head + f" ({', '.join('--' + p.replace('_', '-') for p in self.pinned)} given)"
        fit = (f"width a multiple of {c.quantum}" if c.quantum else
               f"no slice count near {lay.slices} gives a width that is a multiple of {min(lay.quanta)}")
        better = [q for q in lay.quanta if c.quantum and q > c.quantum]
        if lay.width and c.width == lay.width:
            fit, better = f"the preset's preferred width {lay.width}", []
        if better:
            fit += f" ({'/'.join(map(str, better))} not reachable within ×2 of {lay.slices} slices)"
        return head + f"; {fit}; closest to the preset's {lay.slices} slices"

    def counts(self) -> dict:
        return {"experts": self.chosen.experts, "shared": self.chosen.shared, "top_k": self.chosen.top_k}


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def _quantum(width: int, quanta: tuple[int, ...]) -> int:
    return next((q for q in quanta if width % q == 0), 0)


def resolve_layout(layout: Layout, d_ff: int, *, experts: int | None = None, shared: int | None = None,
                   top_k: int | None = None) -> Resolution:
    """The counts that realise `layout` for a model with this d_ff (see the module docstring for the rules)."""
    pinned = tuple(n for n, v in (("experts", experts), ("shared", shared), ("top_k", top_k)) if v is not None)
    if experts is not None and shared is not None:
        units = [experts + shared]
    else:
        units = range(2, min(d_ff, 8 * layout.slices) + 1)
    valid = []
    for u in units:
        if d_ff % u:
            continue
        s = shared if shared is not None else _round(layout.shared * u)
        if shared is None and layout.shared > 0:
            s = max(s, 1)
        n = u - s
        if experts is not None and n != experts:
            continue
        k = top_k if top_k is not None else _round(layout.active * u) - s
        if n < 1 or not 1 <= k <= n:
            continue
        if top_k is None and k > layout.max_top_k:
            continue
        c = Candidate(u, n, s, k, d_ff // u, _quantum(d_ff // u, layout.quanta))
        valid.append(c)
    if not valid:
        given = " ".join(f"--{p.replace('_', '-')} {v}" for p, v in (("experts", experts), ("shared", shared),
                                                                     ("top_k", top_k)) if v is not None)
        raise MoeifyError(f"no expert layout gives {layout.active:.0%} active with top-k ≤ {layout.max_top_k} for "
                          f"d_ff {d_ff:,}" + (f" and {given}" if given else ""),
                          "pass --experts, --shared and --top-k explicitly (`moeify plan SRC` shows what they cost)")

    def window(c: Candidate) -> bool:
        return layout.slices / 2 <= c.slices <= 2 * layout.slices

    def rank(c: Candidate):
        q = layout.quanta.index(c.quantum) if c.quantum else len(layout.quanta)
        dist = abs(math.log(c.slices / layout.slices))
        off = abs(c.active - layout.active)
        if pinned:  # the user's counts: the share nearest the preset's first, then widths, then granularity
            return (round(off, 6), q, dist)
        # within the window and the tolerance before anything else; then the quantum; then granularity
        return (not window(c), off > layout.tolerance + 1e-9, not (layout.width and c.width == layout.width), q, dist,
                off)

    ordered = sorted(valid, key=rank)
    return Resolution(layout, d_ff, ordered[0], pinned, ordered)


def needs_resolution(values: dict) -> bool:
    """Whether values (a preset merged with flags) state a [layout] and leave a count to resolve from it."""
    return values.get("layout") is not None and any(values.get(k) is None for k in ("experts", "shared", "top_k"))


def resolve_into(values: dict, d_ff: int) -> dict:
    """values (a preset merged with flags) with experts/shared/top_k resolved from values['layout'] where not given,
    and the layout's `resolved` line recording how."""
    layout = values["layout"]
    given = {k: values.get(k) for k in ("experts", "shared", "top_k")}
    res = resolve_layout(layout, d_ff, **given)
    out = dict(values)
    out.update(res.counts())
    out["layout"] = replace(layout, resolved=res.why)
    return out


__all__ = ["Layout", "LAYOUT_KEYS", "SERVE_QUANTA", "Candidate", "Resolution", "layout_from_table", "resolve_layout",
           "needs_resolution", "resolve_into", "serve_quanta"]
