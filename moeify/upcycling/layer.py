"""One layer of an upcycle or merge: its experts made from the dense FFN(s) (moeify.upcycling.copies' maths: copies,
slices, symmetry breaking, the shared expert, the router rows), one at a time as they are written or checked, and
the layer's FFN tensors in the order the plan lists them (moeify.upcycling.upcycle writes them). `plan` is that
module's UpcyclePlan (not imported: the stage imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .copies import (SHARED_GATE_FACTOR, add_noise, copy_expert, copy_orders, drop_count, drop_reinit, group_router,
                     matrix_stats, random_router, routed_neurons, shared_expert, shared_neurons)
from ..formats.families import ffn_tensor_names
from ..maths.router import SHARED_GATE_MIN


class LazyExperts:
    """A layer's experts made one at a time, in order, when iterated (writing holds the one being written, not all
    N); each is deterministic in (seed, layer, expert), so any pass gives the same tensors."""

    def __init__(self, make, n: int):
        self._make, self._n = make, n

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return (self._make(e) for e in range(self._n))

    def __getitem__(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._make(e)

    def cast(self, dtype: torch.dtype) -> "LazyExperts":
        return LazyExperts(lambda n: tuple(t.to(dtype) for t in self._make(n)), self._n)


class Recent:
    """The last `size` values put, by key (a layer's identical experts made, or cast, once: a copy's slices at most,
    so memory stays one FFN); `keep` holds the objects whose ids the key names alive while the entry is."""

    def __init__(self, size: int):
        self.size, self.items = max(1, size), {}

    def get(self, key):
        hit = self.items.get(key)
        return None if hit is None else hit[0]

    def put(self, key, value, keep=None) -> None:
        self.items[key] = (value, keep)
        while len(self.items) > self.size:
            del self.items[next(iter(self.items))]


@dataclass
class LayerExperts:
    """One layer's upcycled FFN: routed experts (gate, up, down), router rows, the shared expert and what was done."""

    experts: LazyExperts
    router: torch.Tensor  # (N, d_model)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    report: dict


def layer_experts(plan, i: int, ffns: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  broken: bool = True, shared_ffn: tuple | None = None) -> LayerExperts:
    """Layer i's experts from the dense gate/up/down of each copy (plan.ffns(i): one FFN E times, or a merge's one
    per source), deterministic in (seed, i): broken=False gives the copies before symmetry breaking and a merge's
    residual scales (what the exactness check runs). shared_ffn: a merge's shared source's FFN as plan.ffns(i) read
    it (None: read here)."""
    s, lay = plan.settings, plan.layout
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + i)
    rows = random_router(lay.copies, plan.src.hidden, plan.router_std, gen)
    if plan.router_rows is not None:
        rows = plan.router_rows[i]
    router = group_router(rows, lay.granularity)
    gate, up, down = ffns[0]
    shared_idx = shared_neurons(gate, up, down, 0 if lay.shared_apart else lay.shared_width)
    orders = copy_orders(routed_neurons(lay.d_ff, shared_idx), lay.copies, s.symmetry == "permute", gen)
    g, w = lay.granularity, lay.expert_width
    # beside a shared expert of its own each copy's output is halved: at its resting gate (1/2) the shared expert is
    # the other half, so a layer of the base's FFN everywhere computes the base
    factor = g / 2 if lay.shared_apart else g
    symmetry = s.symmetry if broken else "none"
    if symmetry == "drop":
        stats = (matrix_stats(gate), matrix_stats(up), tuple(v * g for v in matrix_stats(down)))
    elif symmetry == "noise":
        stds = (matrix_stats(gate)[1], matrix_stats(up)[1], matrix_stats(down)[1] * g)

    made = Recent(g)  # identical copies (one FFN, one order, one scale) are made once: the same tensors again

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        copy, part = divmod(n, g)
        scale = plan.scales[copy] if broken and plan.scales else 1
        key = (id(ffns[copy]), id(orders[copy]), part, scale)
        expert = made.get(key)
        if expert is None:
            expert = copy_expert(*ffns[copy], orders[copy][part * w:(part + 1) * w], factor)
            if scale != 1:  # a merge's residual_scale: the output × it
                expert = (*expert[:2], (expert[2].float() * scale).to(expert[2].dtype))
            made.put(key, expert, keep=(ffns[copy], orders[copy]))
        own = torch.Generator().manual_seed((s.seed * 1_000_003 + i) * 4099 + n)  # this expert's draws alone
        if symmetry == "drop":
            return drop_reinit(expert, s.drop_share, stats, own)[0]
        if symmetry == "noise":
            return add_noise(expert, s.noise_scale, stds, own)
        return expert

    report: dict = {"layer": i, "symmetry": s.symmetry}
    if symmetry == "drop":
        report["reinitialised_neurons"] = [drop_count(s.drop_share, w)] * lay.n_experts
    if lay.shared_apart:  # gate 1/2 at rest × 2 / 2: the shared FFN's own output × its residual scale
        sg, su, sd = shared_ffn if shared_ffn is not None else plan.shared_ffn(i)
        shared = sg, su, sd if plan.shared_scale == 1 else (sd.float() * plan.shared_scale).to(sd.dtype)
    else:
        shared = shared_expert(gate, up, down, shared_idx, SHARED_GATE_FACTOR) if lay.shared_width else None
    if lay.shared_width and not lay.shared_apart:
        report["shared_neurons"] = shared_idx.tolist()
    return LayerExperts(LazyExperts(make, lay.n_experts), router, shared, report)


def ffn_tensors(plan, i: int, le: LayerExperts):
    """(name, tensor) of layer i's FFN in the order the plan lists them, each expert made as it is reached."""
    dtype, h = plan.out_dtype, plan.src.hidden
    names = iter(ffn_tensor_names(plan.fmt, i, plan.layout.n_experts, dense=False, shared=plan.layout.shared_width > 0))
    yield next(names), le.router.to(dtype)
    cast = Recent(plan.layout.granularity)  # an expert made once and listed again (identical copies): cast once
    for expert in le.experts:
        ts = cast.get(id(expert))
        if ts is None:
            ts = tuple(t.to(dtype) for t in expert)
            cast.put(id(expert), ts, keep=expert)
        for t in ts:
            yield next(names), t
    if plan.fmt == "qwen2_moe":
        if le.shared is None:
            empty = torch.zeros(0, h, dtype=dtype)
            shared = (empty, empty, torch.zeros(h, 0, dtype=dtype))
        else:
            shared = tuple(t.to(dtype) for t in le.shared)
        for t in shared:
            yield next(names), t
        if plan.shared_rows is not None:  # a merge's shared gate from prompts
            yield next(names), plan.shared_rows[i].reshape(1, h).to(dtype)
        else:
            yield next(names), torch.full((1, h), SHARED_GATE_MIN, dtype=dtype)  # sigmoid ~ 1/2; never 0 (llama.cpp)


__all__ = ["LazyExperts", "Recent", "LayerExperts", "layer_experts", "ffn_tensors"]
