"""Upcycling maths: experts made of copies of a dense SwiGLU FFN, their routers, and the ways to break the copies'
symmetry. Pure tensor functions, no I/O (moeify.upcycle writes what they make; tests/test_copies.py checks them).

E copies of the FFN's routed neurons, each cut into G slices of equal width, give N = E·G experts; expert n = e·G + s
is slice s of copy e. A token routed to top-k = m·G experts that are m whole copies, with weights renormalised over
the k (Mixtral; Qwen2-MoE / Qwen3-MoE with norm_topk_prob), gets Σ_e w_e · (Σ_s slice_s) with Σ_e G·w_e = 1, that is
FFN(x) / G: the slices' down_proj × G makes it exact. Whole copies are chosen when the router rows of one copy's G
slices are equal (a "virtual group": equal logits, and top-k with k a multiple of G keeps or drops a copy whole; a
tie between two copies at the cut is broken by index on CPU, which keeps whole copies too). A shared expert (Qwen2-MoE)
holds `shared_width` neurons apart from the copies, always on at sigmoid(~0) = 1/2, so its down_proj is × 2.

Breaking the symmetry (identical copies get identical gradients, and a router between them almost none):
- "drop" (Drop-Upcycling, Nakamura et al., ICLR 2025): in each expert a share r of its neurons re-initialised, gate/up
  rows and down columns drawn from a normal with the source matrix's mean and standard deviation; not exact.
- "permute": each copy's routed neurons shuffled before slicing (copy 0 kept), so that slice s of two copies holds
  different neurons; exact at initialisation (whole copies still sum to the FFN), no effect at G = 1.
- "noise": every copy's weights plus Gaussian noise of `scale` × the source matrix's standard deviation; not exact.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import MoeifyError

BREAKS = ("none", "drop", "permute", "noise")
SHARED_GATE_FACTOR = 2  # the shared expert's down_proj × 2: its gate is sigmoid(~0) = 1/2
DRAW_CHUNK = 1 << 20  # elements one generator draws: fixed, so that the values do not depend on the thread count


@dataclass(frozen=True)
class UpcycleLayout:
    """E copies of the FFN's routed neurons cut into G slices: N = E·G routed experts, top-k of them a token."""

    d_ff: int
    copies: int  # E
    granularity: int  # G
    top_k: int  # a multiple of G
    shared_width: int = 0  # neurons of the FFN kept apart in an always-on shared expert (Qwen2-MoE), not copied
    shared_apart: bool = False  # the shared expert a whole FFN of its own (a merge's shared source), every copy whole

    @property
    def n_experts(self) -> int:
        return self.copies * self.granularity

    @property
    def routed_width(self) -> int:
        """The FFN's neurons that are copied: all but the shared expert's (all when it is an FFN of its own)."""
        return self.d_ff if self.shared_apart else self.d_ff - self.shared_width

    @property
    def expert_width(self) -> int:
        return self.routed_width // self.granularity

    @property
    def copies_per_token(self) -> int:
        return self.top_k // self.granularity

    @property
    def params_ratio(self) -> float:
        """FFN parameters of the MoE / the dense FFN's (routers not counted)."""
        return (self.copies * self.routed_width + self.shared_width) / self.d_ff

    @property
    def compute_ratio(self) -> float:
        """FFN products a token computes / the dense FFN's."""
        return (self.top_k * self.expert_width + self.shared_width) / self.d_ff

    def check(self) -> None:
        """MoeifyError naming the flag for a layout that cannot be exact."""
        if self.copies < 1:
            raise MoeifyError(f"--copies {self.copies}: at least 1 copy of the FFN is needed")
        if self.granularity < 1:
            raise MoeifyError(f"--granularity {self.granularity} must be at least 1")
        if self.shared_apart and self.shared_width != self.d_ff:
            raise ValueError(f"a shared expert of its own holds a whole FFN ({self.d_ff}), not {self.shared_width}")
        if not self.shared_apart and not 0 <= self.shared_width < self.d_ff:
            raise MoeifyError(f"--shared-width {self.shared_width} must be at least 0 and less than the FFN's "
                              f"{self.d_ff} neurons")
        if self.routed_width % self.granularity:
            raise MoeifyError(f"--granularity {self.granularity} does not divide the {self.routed_width} routed "
                              f"neurons ({self.d_ff} - shared {self.shared_width}) into equal slices",
                              f"valid --granularity: {', '.join(map(str, divisors(self.routed_width)[:16]))}")
        if self.top_k < 1 or self.top_k > self.n_experts:
            raise MoeifyError(f"--top-k {self.top_k} must be between 1 and the {self.n_experts} experts "
                              f"({self.copies} copies × {self.granularity} slices)")
        if self.top_k % self.granularity:
            raise MoeifyError(f"--top-k {self.top_k} is not a multiple of --granularity {self.granularity}: a token "
                              "would get part of a copy, and the upcycled model would not compute the dense one",
                              f"use --top-k {max(1, self.top_k // self.granularity) * self.granularity} or "
                              f"{(self.top_k // self.granularity + 1) * self.granularity}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shared_neurons(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` neurons with the largest product of weight norms ||gate_i|| ||up_i|| ||down_:,i|| (a weight-only
    measure of how much a neuron can contribute), ascending ids; the shared expert holds them."""
    if width == 0:
        return torch.zeros(0, dtype=torch.long)
    score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)
    return torch.sort(torch.topk(score, width).indices).values


def routed_neurons(d_ff: int, shared: torch.Tensor) -> torch.Tensor:
    """Every neuron not in `shared`, ascending."""
    keep = torch.ones(d_ff, dtype=torch.bool)
    keep[shared] = False
    return torch.nonzero(keep).flatten()


def copy_orders(routed: torch.Tensor, copies: int, permute: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """The routed neuron ids of each copy in slicing order: the same for every copy, or (permute) shuffled for every
    copy but the first."""
    if not permute:
        return [routed] * copies
    return [routed] + [routed[torch.randperm(len(routed), generator=generator)] for _ in range(copies - 1)]


def copy_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor,
                factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert of the neurons idx: (gate (w, d_model), up (w, d_model), down (d_model, w) × factor, computed in
    float32), new tensors in the source dtype."""
    if len(idx) and _is_run(idx):  # a contiguous run of neurons (full-width copies): slices, not gathers
        run = slice(int(idx[0]), int(idx[0]) + len(idx))
        gate, up, cols = gate[run].clone(), up[run].clone(), down[:, run]
    else:
        gate, up, cols = gate[idx], up[idx], down[:, idx]
    if factor == 1:  # x × 1 in float32 is x: the same bits, without the round trip
        return gate, up, cols.clone(memory_format=torch.contiguous_format)
    return gate, up, (cols.float() * factor).to(cols.dtype)


def _is_run(idx: torch.Tensor) -> bool:
    """Whether idx is a contiguous ascending run of indices (a slice reads it faster than a gather)."""
    return bool(torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + len(idx), dtype=idx.dtype)))


def copy_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, orders: list[torch.Tensor],
                 layout: UpcycleLayout, factor: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The N = E·G experts, expert e·G + s being slice s of copy e (neurons orders[e][s·w:(s+1)·w])."""
    w = layout.expert_width
    return [copy_expert(gate, up, down, order[s * w:(s + 1) * w], factor)
            for order in orders for s in range(layout.granularity)]


def shared_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor,
                  factor: float = SHARED_GATE_FACTOR) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gate[idx].clone(), up[idx].clone(), (down[:, idx].float() * factor).to(down.dtype)


def group_router(copy_rows: torch.Tensor, granularity: int) -> torch.Tensor:
    """(E·G, d_model) router rows from one row per copy (E, d_model): each copy's G slices share its row."""
    return copy_rows.repeat_interleave(granularity, dim=0)


def random_router(copies: int, d_model: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """(copies, d_model) router rows ~ N(0, std²), as sparse upcycling initialises a router."""
    return torch.randn(copies, d_model, generator=generator) * std


def normal(shape: tuple[int, int], mean: float, std: float, generator: torch.Generator,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (rows, cols) matrix of N(mean, std²) draws in `dtype`, drawn in float32 in blocks of rows of about
    DRAW_CHUNK elements, each block from its own generator seeded by one draw of `generator`. torch draws normals on
    one core; the blocks run in threads (torch.get_num_threads()), so that re-initialising an 8B model's experts is
    not bound by one core, and give the same values at any thread count."""
    rows, cols = shape
    out = torch.empty(rows, cols, dtype=dtype)
    base = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    per = max(1, DRAW_CHUNK // max(cols, 1))
    blocks = list(enumerate(range(0, rows, per)))

    def fill(block: tuple[int, int]) -> None:
        j, r0 = block
        g = torch.Generator().manual_seed(base + j)
        out[r0:r0 + per] = torch.empty(min(per, rows - r0), cols).normal_(mean, std, generator=g).to(dtype)

    workers = min(torch.get_num_threads(), len(blocks))
    if workers <= 1:
        for b in blocks:
            fill(b)
    else:
        with ThreadPoolExecutor(workers) as pool:  # torch's kernels release the GIL
            list(pool.map(fill, blocks))
    return out


def drop_reinit(expert: tuple[torch.Tensor, torch.Tensor, torch.Tensor], share: float,
                stats: tuple[tuple[float, float], tuple[float, float], tuple[float, float]],
                generator: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """Drop-Upcycling: re-initialise round(share × width) of the expert's neurons (gate/up rows, down columns) from
    N(mean, std²) of the source gate, up and down matrices as the experts hold them (`stats`; down's × its factor, so
    a drawn column has the size of its neighbours). Returns (the new expert, neurons drawn)."""
    gate, up, down = expert
    w = gate.shape[0]
    n = drop_count(share, w)
    if n == 0:
        return expert, 0
    idx = torch.randperm(w, generator=generator)[:n]
    (gm, gs), (um, us), (dm, ds) = stats
    gate, up, down = gate.clone(), up.clone(), down.clone()
    gate[idx] = normal((n, gate.shape[1]), gm, gs, generator, gate.dtype)
    up[idx] = normal((n, up.shape[1]), um, us, generator, up.dtype)
    down[:, idx] = normal((down.shape[0], n), dm, ds, generator, down.dtype)
    return (gate, up, down), n


def drop_count(share: float, width: int) -> int:
    """Neurons Drop-Upcycling re-initialises in an expert of `width`."""
    return int(round(share * width))


def add_noise(expert: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
              stds: tuple[float, float, float], generator: torch.Generator,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each matrix plus N(0, (scale × std)²) noise, `stds` those of the source matrices as the experts hold them
    (down's × its factor): noise relative to the weights, the same in every matrix."""
    out = []
    for t, s in zip(expert, stds):
        out.append((t.float() + normal(tuple(t.shape), 0.0, scale * s, generator)).to(t.dtype))
    return tuple(out)


def matrix_stats(t: torch.Tensor) -> tuple[float, float]:
    """(mean, std) of a weight matrix, in float64 sums (exact enough at 10⁸ elements)."""
    x = t.double()
    mean = x.mean().item()
    return mean, math.sqrt(max(x.var(unbiased=False).item(), 0.0))


__all__ = ["BREAKS", "UpcycleLayout", "divisors", "shared_neurons", "routed_neurons", "copy_orders", "copy_expert",
           "copy_experts", "drop_count",
           "shared_expert", "group_router", "random_router", "drop_reinit", "add_noise", "matrix_stats", "normal",
           "SHARED_GATE_FACTOR"]
