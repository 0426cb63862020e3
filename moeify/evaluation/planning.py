"""`moeify plan`: what an MoE built from a dense config costs, in the four regimes of the FFN-MoE scaling notes.

Pure arithmetic on config.json (no weights). For N routed experts of width d_e, top-k active, a shared expert of
S experts' width, the FFN part of each layer holds N·3·h·d_e + S·3·h·d_e + N·h (router) parameters and a token
touches k·3·h·d_e + S·3·h·d_e + N·h of them. The two upcycles are priced as `moeify upcycle` builds them by default,
whatever the carve's counts; the carve's regimes use --experts, --top-k and --shared:

- max capacity:       E8 top-2, d_e = d_ff        (P ≈ 8·P_dense FFN, FLOPs ≈ 2·dense): `moeify upcycle` as it is
- constant compute:   E8 G4 top-4, d_e = d_ff / 4 (P ≈ 8·P_dense FFN, FLOPs ≈ dense): `--granularity 4 --top-k 4`
- inference saving:   d_e = d_ff / (N + S)        (P ≈ P_dense, FLOPs ≈ k/N·dense) — what `moeify convert` carves
- custom:             d_e = --expert-width

For the upcycles it also says what training them (`moeify tune OUT --tune-text`) needs per process across N GPUs,
plain and offloaded, and the fewest GPUs of a given size that hold it (moeify.maths.memory.train_memory).
The numbers come from moeify.maths.budget.carve_budget, the same function `convert --dry-run` uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..maths.budget import Budget, active_neuron_share, carve_budget, padded_width
from ..errors import MoeifyError
from ..formats.families import SourceModel, read_source_config


@dataclass(frozen=True)
class Regime:
    name: str
    expert_width: int
    shared_width: int
    budget: Budget
    exact: bool = True  # False when d_ff does not divide evenly and the width was rounded down
    experts: int = 0  # routed experts of this regime (the upcycles': E·G, whatever the carve's count)
    top_k: int = 0
    granularity: int = 0  # an upcycle's slices per copy (0: a carve's regime)

    @property
    def layout(self) -> str:
        """How the regime is built, shortly: E8 top-2, E8 G4 top-4, 8 of d_ff/8 top-2."""
        if self.granularity:
            g = f" G{self.granularity}" if self.granularity > 1 else ""
            return f"E{self.experts // self.granularity}{g} top-{self.top_k}"
        return f"{self.experts} experts top-{self.top_k}"


@dataclass(frozen=True)
class MoePlan:
    src: SourceModel
    experts: int
    top_k: int
    shared: int
    other_params: int  # everything that is not an FFN: embeddings (+ lm_head), attention, norms
    regimes: list[Regime]
    layout: object = None  # the preset's Layout (moeify/formats/layout.py) these counts were resolved from, if any
    alternatives: list = dataclasses.field(default_factory=list)  # the layout each --serve format would get

    @property
    def dense_params(self) -> int:
        return self.regimes[0].budget.dense_total_params

    @property
    def dense_ffn_flops(self) -> int:
        return self.regimes[0].budget.dense_ffn_flops

    def to_dict(self, processes: int = 8, gpu_bytes: float = 80e9) -> dict:
        s = self.src
        return {
            "source": str(s.path), "model_type": s.model_type, "hidden": s.hidden, "d_ff": s.d_ff,
            "n_layers": s.n_layers, "experts": self.experts, "top_k": self.top_k, "shared": self.shared,
            "other_params": self.other_params, "dense_params": self.dense_params, "dense_ffn_flops": self.dense_ffn_flops,
            "regimes": [{
                "name": r.name, "expert_width": r.expert_width, "shared_width": r.shared_width, "exact": r.exact,
                "experts": r.experts, "top_k": r.top_k, "granularity": r.granularity, "layout": r.layout,
                "total_params": r.budget.total_params, "active_params": r.budget.active_params,
                "ffn_flops": r.budget.ffn_flops, "total_ratio": r.budget.total_ratio,
                "active_ratio": r.budget.active_ratio, "flops_ratio": r.budget.flops_ratio,
                "serving": serving_json(padded_width(r.expert_width)),
            } for r in self.regimes],
            "engines": [{"engine": n.engine, "fails": n.fails, "what": n.what, "fix": n.fix}
                        for n in self.engine_notes()],
            "tuning_memory": self.tuning_memory(),
            "training_memory": self.training_memory(processes, gpu_bytes),
            "layout": None if self.layout is None else {**dataclasses.asdict(self.layout),
                                                        "quanta": list(self.layout.quanta)},
            "alternatives": self.alternatives,
            "carved": self.carved_share(),
        }

    def carved_share(self) -> dict:
        """What `convert` carves (the inference-saving split), as plan, convert and the card say it: the share of
        the FFN neurons active per token, and the stored (zero-padded to ×8) expert width with the FLOPs it costs."""
        s, r = self.src, next(r for r in self.regimes if r.name == "inference saving")
        stored = padded_width(r.expert_width)
        flops = carve_budget(hidden=s.hidden, d_ff=s.d_ff, n_layers=s.n_layers, other_params=self.other_params,
                             experts=self.experts, top_k=self.top_k, expert_width=stored,
                             shared_width=r.shared_width).flops_ratio
        return {"active_share": active_neuron_share(d_ff=s.d_ff, n_layers=s.n_layers, top_k=self.top_k,
                                                    expert_width=r.expert_width, shared_width=r.shared_width),
                "expert_width": r.expert_width, "stored_width": stored, "stored_flops_ratio": flops}

    def tuning_memory(self) -> list[dict]:
        """Predicted peak memory per process of recovery tuning (CPU float32; 1-8 GPUs in bf16 with FSDP2)."""
        from ..maths.memory import memory_table

        return memory_table(self.src, self.experts)

    def upcycles(self) -> list[Regime]:
        return [r for r in self.regimes if r.granularity]

    def training_memory(self, processes: int = 8, gpu_bytes: float = 80e9) -> list[dict]:
        """Per upcycle regime: next-token training's peak per process on `processes` GPUs, plain and offloaded (with
        its host memory), and the fewest GPUs of gpu_bytes that hold it (moeify.maths.memory.train_memory, bf16)."""
        return [upcycle_training(self.src, r, processes, gpu_bytes) for r in self.upcycles()]

    def engine_notes(self):
        """What transformers, vLLM and llama.cpp say of the layout `convert` carves (the inference-saving regime),
        written as convert's default would (Mixtral, or Qwen2-MoE with a shared expert or q/k/v biases, Qwen3-MoE
        for a Qwen3, and untied embeddings)."""
        from ..formats.engines import engine_notes

        s = self.src
        width = s.d_ff // (self.experts + self.shared)
        fmt = "qwen3_moe" if s.qk_norm else "qwen2_moe" if self.shared or s.qkv_bias else "mixtral"
        return engine_notes(fmt, self.top_k, self.experts, self.shared * width, padded_width(width), False, 0,
                            s.head_dim, s.hidden, s.heads, s.qkv_bias)


def non_ffn_params(src: SourceModel) -> int:
    """Embeddings (+ untied lm_head), attention q/k/v/o (GQA, head_dim; Qwen2's q/k/v biases), the norms per layer
    (Qwen3's q/k norms too) and the final norm."""
    h, q, kv = src.hidden, src.heads * src.head_dim, src.kv_heads * src.head_dim
    embed = src.vocab * h * (1 if src.tied else 2)
    attention = h * q + 2 * h * kv + q * h
    norms = 2 * h + (2 * src.head_dim if src.qk_norm else 0) + (q + 2 * kv if src.qkv_bias else 0)
    return embed + src.n_layers * (attention + norms) + h


UPCYCLE_COPIES, UPCYCLE_TOP_K = 8, 2  # `moeify upcycle`'s defaults: max capacity
FINE_GRANULARITY = 4  # constant compute: E8 G4, top-4 (one copy's worth: dense compute)


def upcycle_regimes(src: SourceModel, other: int) -> list[Regime]:
    """The two upcycles `moeify upcycle` builds: E8 top-2 full width, and E8 fine-grained at dense compute (G4
    top-4; G2 top-2 where d_ff is not a multiple of 4; none where it is odd)."""
    regimes = []
    g = next((g for g in (FINE_GRANULARITY, 2) if src.d_ff % g == 0), None)
    for name, gran, k in (("max capacity", 1, UPCYCLE_TOP_K), ("constant compute", g, g)):
        if gran is None:
            continue
        n, width = UPCYCLE_COPIES * gran, src.d_ff // gran
        budget = carve_budget(hidden=src.hidden, d_ff=src.d_ff, n_layers=src.n_layers, other_params=other,
                              experts=n, top_k=k, expert_width=width, shared_width=0)
        regimes.append(Regime(name, width, 0, budget, True, n, k, gran))
    return regimes


def upcycle_training(src: SourceModel, r: Regime, processes: int = 8, gpu_bytes: float = 80e9) -> dict:
    """Training regime r (an upcycle) on GPUs (training_needs), named."""
    return {"regime": r.name, "layout": r.layout, "total_params": r.budget.total_params,
            **training_needs(src, r.experts, r.top_k, r.expert_width, 0, processes, gpu_bytes)}


def training_needs(src: SourceModel, experts: int, top_k: int, expert_width: int, shared_width: int = 0,
                   processes: int = 8, gpu_bytes: float = 80e9) -> dict:
    """Next-token training of an upcycle or merge of src's shape on GPUs: the peak per process on `processes`
    GPUs, plain and offloaded (and the offloaded run's host memory per process), and the fewest GPUs of gpu_bytes
    that hold it, plain and offloaded (moeify.maths.memory.train_memory, bf16)."""
    from ..maths.memory import gpus_needed, train_memory, train_windows

    def at(world: int, offload: bool):
        return train_memory(hidden=src.hidden, n_layers=src.n_layers, heads=src.heads, kv_heads=src.kv_heads,
                            head_dim=src.head_dim, vocab=src.vocab, tied=src.tied, experts=experts, top_k=top_k,
                            expert_width=expert_width, shared_width=shared_width, windows=train_windows(world),
                            world=world, offload=offload)

    plain, off = at(processes, False), at(processes, True)
    return {"processes": processes, "peak": plain.peak, "offload_peak": off.peak, "offload_host": off.host,
            "gpu_bytes": gpu_bytes, "gpus_needed": gpus_needed(at, gpu_bytes), "parts": plain.to_dict()}


def plan_moe(src: SourceModel, *, experts: int, top_k: int, shared: int = 0,
             expert_width: int | None = None) -> MoePlan:
    """The four regimes for one dense source. Raises MoeifyError for flags that make no sense."""
    for flag, value in (("experts", experts), ("top-k", top_k), ("shared", shared)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise MoeifyError(f"--{flag} must be an integer, got {value!r}")
    if experts < 1:
        raise MoeifyError(f"--experts must be ≥ 1, got {experts}")
    if shared < 0:
        raise MoeifyError(f"--shared must be ≥ 0, got {shared}")
    if not 1 <= top_k <= experts:
        raise MoeifyError(f"--top-k must be between 1 and --experts ({experts}), got {top_k}",
                          "top-k is the number of routed experts each token uses")
    d_ff = src.d_ff
    units = experts + shared
    if d_ff % units:
        valid = [n for n in range(1, 257) if d_ff % (n + shared) == 0]
        raise MoeifyError(
            f"--experts {experts} with --shared {shared} does not divide intermediate_size {d_ff} into {units} equal "
            "experts, so the model cannot be carved (the inference-saving regime)",
            f"valid --experts for --shared {shared}: {', '.join(map(str, valid[:40]))}",
        )
    if expert_width is not None and (isinstance(expert_width, bool) or not isinstance(expert_width, int)
                                     or expert_width < 1):
        raise MoeifyError(f"--expert-width must be a positive integer, got {expert_width!r}")

    other = non_ffn_params(src)
    regimes = upcycle_regimes(src, other)
    widths = [("inference saving", d_ff // units)] + ([("custom", expert_width)] if expert_width is not None else [])
    for name, width in widths:
        budget = carve_budget(hidden=src.hidden, d_ff=d_ff, n_layers=src.n_layers, other_params=other,
                              experts=experts, top_k=top_k, expert_width=width, shared_width=shared * width)
        regimes.append(Regime(name, width, shared * width, budget, True, experts, top_k))
    return MoePlan(src, experts, top_k, shared, other, regimes)


# ------------------------------------------------------------------------------ serving formats and widths


@dataclass(frozen=True)
class ServingRule:
    """A quantized serving path that needs the routed expert width (the stored, padded width) to be a multiple
    of `multiple`; with `per_gpu`, vLLM splits the width over tensor-parallel GPUs, so width / TP must be."""

    name: str
    multiple: int
    per_gpu: bool
    why: str


SERVING_RULES = (
    ServingRule("llama.cpp Q8_0", 32, False, "Q8_0/Q4_0 quantize rows in blocks of 32 and down_proj rows are "
                "expert-width long; otherwise llama.cpp keeps them in a wider type"),
    ServingRule("llama.cpp K-quants", 256, False, "Q4_K..Q6_K quantize rows in blocks of 256 and down_proj rows are "
                "expert-width long; otherwise llama.cpp falls back to another type for them"),
    ServingRule("vLLM FP8 block", 128, True, "block-quantized FP8 MoE (128×128 blocks) needs the per-GPU expert "
                "width divisible by 128"),
    ServingRule("vLLM int4 Marlin", 128, True, "the fused Marlin MoE kernel (GPTQ/AWQ, group size 128) needs the "
                "per-GPU expert width divisible by 128 (64 for per-channel scales)"),
)
TP_SIZES = (1, 2, 4, 8)


def serving_fit(width: int) -> list[tuple[ServingRule, int]]:
    """(rule, largest tensor-parallel size in TP_SIZES whose per-GPU width the rule accepts; 0: none; 1 for rules
    that do not split the width) for a stored expert width."""
    fits = []
    for rule in SERVING_RULES:
        sizes = TP_SIZES if rule.per_gpu else (1,)
        fits.append((rule, max((tp for tp in sizes if width % (rule.multiple * tp) == 0), default=0)))
    return fits


def friendly_expert_counts(d_ff: int, shared: int, multiple: int, limit: int = 256) -> list[int]:
    """Routed expert counts (2..limit) that split d_ff into equal experts of a width divisible by `multiple`."""
    return [n for n in range(2, limit + 1) if d_ff % (n + shared) == 0 and (d_ff // (n + shared)) % multiple == 0]


def serving_advice(d_ff: int, experts: int, shared: int, width: int) -> list[str]:
    """What to change when the stored width misses a serving rule: zero padding, or expert counts that fit."""
    if all(tp for _, tp in serving_fit(width)):
        return []
    raw = d_ff // (experts + shared)
    advice = []
    for multiple in sorted({r.multiple for r, tp in serving_fit(width) if not tp}):
        extra = padded_width(raw, multiple) / raw - 1
        counts = sorted(sorted(friendly_expert_counts(d_ff, shared, multiple), key=lambda n: abs(n - experts))[:4])
        advice.append(f"×{multiple}: --pad-experts-to {multiple} (+{extra:.0%} weights, zeros)"
                      + (f" or --experts {', '.join(map(str, counts))}" if counts else ""))
    return advice


def plan_preset(src: SourceModel, preset: str | Path, *, experts: int | None = None, shared: int | None = None,
                top_k: int | None = None, expert_width: int | None = None, serve: str | None = None) -> MoePlan:
    """The plan of the layout a preset gives this model: its [layout] resolved for src.d_ff (flags win; for the
    serving format `serve`, else the preset's own widths), or its counts as written; with the layout every serving
    format would get beside it (alternatives)."""
    from ..formats.config import load_preset, resolve_preset
    from ..formats.layout import needs_resolution

    values = load_preset(preset)
    given = {k: v for k, v in (("experts", experts), ("shared", shared), ("top_k", top_k)) if v is not None}
    values.update(given)
    alternatives = serve_alternatives(values, src, given)
    if needs_resolution(values):
        values = resolve_preset(values, src.d_ff, src.qk_norm, given=given, serve=serve)
    plan = plan_moe(src, experts=values.get("experts", 8), top_k=values.get("top_k", 2),
                    shared=values.get("shared", 0), expert_width=expert_width)
    return dataclasses.replace(plan, layout=values.get("layout"), alternatives=alternatives)


def serve_alternatives(values: dict, src: SourceModel, given: dict | None = None) -> list[dict]:
    """The layout a preset (values: merged with the flags `given`) gets for each serving format (--serve), for the
    one table `plan` and `convert --dry-run` print; [] when its counts need no resolving."""
    from ..formats.config import resolve_preset
    from ..formats.layout import SERVE_QUANTA, needs_resolution

    if not needs_resolution(values):
        return []
    rows = []
    for fmt in SERVE_QUANTA:
        r = resolve_preset(dict(values), src.d_ff, src.qk_norm, given=given, serve=fmt)
        rows.append({"serve": fmt, "experts": r["experts"], "shared": r["shared"], "top_k": r["top_k"],
                     "width": src.d_ff // (r["experts"] + r["shared"]),
                     "active": (r["top_k"] + r["shared"]) / (r["experts"] + r["shared"]),
                     "preset_active": values["layout"].active})
    return rows


def measured_tradeoff(preset_active: float) -> list[dict]:
    """What the --serve layouts finer than the K-quant one were measured to cost or gain on real models, for a preset
    of this active share: moeify/data/granularity.json (scripts/granularity_table.py writes it from
    results/granularity/; BENCHMARKS.md "Granularity and shared experts"). [] for shares not measured."""
    import json
    from importlib import resources

    rows = json.loads(resources.files("moeify.data").joinpath("granularity.json").read_text())["rows"]
    return [r for r in rows if abs(r["preset"] / 100 - preset_active) < 1e-9]


def plan_from_path(path: str | Path, **kwargs) -> MoePlan:
    return plan_moe(read_source_config(path), **kwargs)


def serving_json(width: int) -> dict:
    """{rule name: largest tensor-parallel size that fits (0: none)} for a stored expert width."""
    return {rule.name: tp for rule, tp in serving_fit(width)}
