"""The upcycle stage: an MoE whose experts are copies of each dense FFN (moeify.upcycling.copies), for MoE training.

plan (config + shard headers only, every check up front) -> per layer: copies, router, symmetry breaking
(moeify.upcycling.layer) -> stream out (one decoder layer resident, as convert), checked beside the writer -> commit.
The check streams a few tokens through the source and the written MoE one decoder layer at a time (transformers' own
classes, the MoE's real top-k routing, moeify.evaluation.layerwise), a layer behind the writer: the construction with
unbroken copies must give the source's logits (else the run stops and writes nothing), and the KL to the source of
the model as written (the price of the symmetry breaking) goes into report.json and the card.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from ..formats.checkpoint import DTYPE_NAMES, CheckpointReader, TensorInfo, check_links
from .copies import BREAKS, UpcycleLayout
from .layer import ffn_tensors, layer_experts
from ..errors import MoeifyError
from ..formats.families import (TOKENIZER_FILES, SourceModel, attention_infos, check_source_tensors, ffn_tensor_names,
                       load_source, target_format, target_config)
from ..version import __version__
from ..formats.config import FORMATS
from .check import check_output
from ..formats.output import commit_output, staged_output, write_metadata, write_shards
from ..formats.writer import ShardLayout, write_attention, write_head

Progress = Callable[[str, int, int], None]  # (stage, done, total)
# a merge's choices as report.json and moeify.toml record them (UpcyclePlan.summary)
MERGE_KEYS = ("sources", "attention", "router", "residual_scales", "shared_source", "shared_scale", "shared_gate")
# Training the output with AdamW in mixed precision holds, per parameter: bf16 weights and gradients (2 + 2), float32
# master weights and two moments (4 + 4 + 4): 16 bytes, before activations (the usual estimate, e.g. ZeRO's paper).
TRAIN_BYTES_PER_PARAM = 16


@dataclass
class UpcycleSettings:
    """What `moeify upcycle` is asked to build (flags of the same names in kebab-case)."""

    copies: int = 8  # E: copies of each FFN
    granularity: int = 1  # G: slices per copy (fine-grained experts); N = E·G experts
    top_k: int = 2  # experts a token uses, a multiple of G
    shared_width: int = 0  # neurons kept apart in an always-on shared expert (Qwen2-MoE)
    format: str = "auto"
    symmetry: str = "drop"  # how the copies are made to differ: none, drop, permute, noise (moeify.upcycling.copies)
    drop_share: float = 0.5  # Drop-Upcycling's r
    noise_scale: float = 0.01  # noise std relative to each matrix's
    router_std: float = 0.0  # 0: the source's initializer_range (0.02 when it has none)
    aux_loss_coef: float = 0.01  # config.json router_aux_loss_coef: the load-balancing loss transformers adds in training
    dtype: str = "auto"
    max_shard_bytes: int = 5_000_000_000
    seed: int = 0
    targets: tuple[str, ...] = ()  # engines that must run the output (moeify.formats.engines)

    def validate(self) -> None:
        if self.symmetry not in BREAKS:
            raise MoeifyError(f"--symmetry {self.symmetry!r} is not one of {', '.join(BREAKS)}")
        if self.format not in FORMATS:
            raise MoeifyError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise MoeifyError(f"--dtype {self.dtype!r} is not one of auto, float32, bfloat16, float16")
        if not 0 < self.drop_share <= 1:
            raise MoeifyError(f"--drop-share {self.drop_share} must be in (0, 1]")
        if not self.noise_scale > 0:
            raise MoeifyError(f"--noise-scale {self.noise_scale} must be positive")
        if self.aux_loss_coef < 0:
            raise MoeifyError(f"--aux-loss-coef {self.aux_loss_coef} must be at least 0")
        if self.router_std < 0:
            raise MoeifyError(f"--router-std {self.router_std} must be positive (or 0: the source's initializer_range)")
        if self.max_shard_bytes < 1:
            raise MoeifyError(f"--max-shard-size {self.max_shard_bytes} must be positive")
        from ..formats.engines import ENGINES

        for t in self.targets:
            if t not in ENGINES:
                raise MoeifyError(f"--target {t!r} is not one of {', '.join(ENGINES)}")
        if self.symmetry == "permute" and self.granularity == 1:
            raise MoeifyError("--symmetry permute does nothing at --granularity 1 (a copy's neurons reordered are the "
                              "same expert)", "use --symmetry drop or noise, or fine-grained copies (--granularity G)")


@dataclass
class UpcyclePlan:
    src: SourceModel
    settings: UpcycleSettings
    layout: UpcycleLayout
    fmt: str
    out_dtype: torch.dtype
    router_std: float
    tensors: list[TensorInfo]
    shards: ShardLayout
    config_json: dict
    total_params: int
    active_params: int
    reader: CheckpointReader | None = field(repr=False)  # None: planned from config.json alone (not runnable)
    # a merge (moeify.merging.merge): copy e is the FFN of sources[e]; attention, norms and embeddings the base's (src) or
    # the sources' average; router rows per layer (E, d_model) from each source's text, or random when None
    sources: list[SourceModel] = field(default_factory=list)
    readers: list[CheckpointReader] = field(default_factory=list, repr=False)
    attention: str = "base"
    router_rows: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    gate_mode: str = "random"  # how router_rows were made (moeify.merging.spec.GATE_MODES)
    scales: list[float] | None = None  # a merge's residual_scale per copy: its down_proj × it (None: all 1)
    # a merge's shared expert of its own (layout.shared_apart): the FFN of shared_source, its output × shared_scale,
    # its gate row per layer from prompts (None: constant, sigmoid ~ 1/2)
    shared_source: SourceModel | None = None
    shared_reader: CheckpointReader | None = field(default=None, repr=False)
    shared_scale: float = 1.0
    shared_rows: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def output_bytes(self) -> int:
        return self.shards.total_bytes()

    @property
    def exact(self) -> bool:
        """Whether the output as written computes the source: no symmetry breaking (or a permutation of slices), and
        a merge only of the base itself (every source the base, unscaled, its attention and any shared expert the
        base's: the exact construction a merge is checked with)."""
        if self.settings.symmetry not in ("none", "permute"):
            return False
        return not self.sources or (all(m.path == self.src.path for m in self.sources) and self.attention == "base"
                                    and all(s == 1 for s in self.scales or []) and self.shared_is_base)

    @property
    def shared_is_base(self) -> bool:
        """Whether a shared expert of its own computes the base's FFN at a constant gate of 1/2 (so that, with every
        copy the base's FFN, the layer computes the base: the routed half plus the shared half)."""
        return (self.shared_source is None or self.shared_source.path == self.src.path) and self.shared_scale == 1 \
            and self.shared_rows is None

    def ffns(self, i: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple | None]:
        """Layer i's dense (gate, up, down) of every copy (the source's for an upcycle, each source's for a merge),
        and of a merge's shared source when it has one (else None): a checkpoint named twice is read once."""
        read: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def of(r: CheckpointReader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if id(r) not in read:
                read[id(r)] = tuple(r.get(f"model.layers.{i}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            return read[id(r)]

        ffns = [of(r) for r in self.readers or [self.reader]]
        shared = of(self.shared_reader) if self.layout.shared_apart else None
        return (ffns if self.sources else ffns * self.layout.copies), shared

    def base_ffn(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's (gate, up, down) of the base (a merge's exact construction: every copy the base's FFN)."""
        return tuple(self.reader.get(f"model.layers.{i}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))

    def shared_ffn(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's (gate, up, down) of a merge's shared source."""
        return tuple(self.shared_reader.get(f"model.layers.{i}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))

    @property
    def engine_notes(self):
        from ..formats.engines import engine_notes

        s, lay = self.src, self.layout
        return engine_notes(self.fmt, lay.top_k, lay.n_experts, lay.shared_width, lay.expert_width,
                            self.src.tied, 0, s.head_dim, s.hidden, s.heads, s.qkv_bias, renormalised=True,
                            upcycle="merge" if self.sources else "upcycle")

    def summary(self) -> dict:
        lay = self.layout
        merge = {"sources": [str(m.path) for m in self.sources], "attention": self.attention,
                 "router": self.gate_mode,
                 **({"residual_scales": self.scales} if self.scales else {}),
                 **({"shared_source": str(self.shared_source.path), "shared_scale": self.shared_scale,
                     "shared_gate": "prompts" if self.shared_rows is not None else "constant"}
                    if self.shared_source is not None else {})} if self.sources else {}
        return {"source": str(self.src.path), "construction": "merge" if self.sources else "upcycle", **merge,
                "format": self.fmt,
                "output_dtype": str(self.out_dtype).removeprefix("torch."), "settings": settings_dict(self.settings),
                "copies": lay.copies, "granularity": lay.granularity, "experts": lay.n_experts, "top_k": lay.top_k,
                "expert_width": lay.expert_width, "shared_width": lay.shared_width,
                "ffn_params_ratio": lay.params_ratio, "ffn_flops_ratio": lay.compute_ratio,
                "total_params": self.total_params, "active_params": self.active_params,
                "output_bytes": self.output_bytes, "shards": len(self.shards.files), "exact": self.exact,
                "training_state_bytes": TRAIN_BYTES_PER_PARAM * self.total_params,
                "router_std": self.router_std,
                "engines": [{"engine": n.engine, "fails": n.fails, "what": n.what, "fix": n.fix}
                            for n in self.engine_notes]}


def settings_dict(s: UpcycleSettings) -> dict:
    d = asdict(s)
    d["targets"] = list(s.targets)
    return d


def plan_upcycle(src_path: str | Path, settings: UpcycleSettings, *, allow_pickle: bool = False,
                 force: bool = False, weights: bool = True, shared_apart: bool = False) -> UpcyclePlan:
    """Read config and shard headers only; check everything before heavy work. weights=False: config.json alone
    (a plan to print, from a Hub id without fetching its weights; it cannot be run). shared_apart: the shared expert
    (settings.shared_width = d_ff) a whole FFN of its own, the copies whole (a merge's shared source)."""
    settings.validate()
    src = load_source(src_path)
    if weights:
        check_links(src.path, ("config.json", *TOKENIZER_FILES))
        reader = CheckpointReader(src.path, allow_pickle=allow_pickle)
        check_source_tensors(src, reader.tensors)
        headers, stored = reader.tensors, reader.tensors["model.embed_tokens.weight"].dtype
    else:
        reader, stored = None, src.dtype or torch.bfloat16
        headers = {n: TensorInfo(n, stored, shape) for n, shape in src.expected_tensors().items()}
    fmt = target_format(src, settings.format, shared=settings.shared_width > 0,
                        shared_fix="leave out --shared-width (or a merge's shared_experts)")
    layout = UpcycleLayout(src.d_ff, settings.copies, settings.granularity, settings.top_k, settings.shared_width,
                           shared_apart)
    layout.check()
    out_dtype = DTYPE_NAMES[settings.dtype] if settings.dtype != "auto" else stored
    tensors = _output_tensors(src, headers, fmt, layout, out_dtype)
    shards = ShardLayout.plan(tensors, settings.max_shard_bytes)
    config_json = target_config(src, fmt, experts=layout.n_experts, top_k=layout.top_k,
                                expert_width=layout.expert_width, shared_width=layout.shared_width, dense_layers=(),
                                dtype=out_dtype, tied=src.tied, renormalise=True)
    config_json["router_aux_loss_coef"] = settings.aux_loss_coef  # with output_router_logits=True in training
    total = sum(math.prod(t.shape) for t in tensors)
    ffn_dense = 3 * src.hidden * src.d_ff
    per_layer_active = ffn_dense * layout.compute_ratio
    per_layer_all = ffn_dense * layout.params_ratio
    active = total - src.n_layers * round(per_layer_all - per_layer_active)
    std = settings.router_std or float(src.raw.get("initializer_range") or 0.02)
    plan = UpcyclePlan(src, settings, layout, fmt, out_dtype, std, tensors, shards, config_json, total, active, reader)
    from ..formats.engines import refuse_blocked

    refuse_blocked(plan.engine_notes, settings.targets, force)
    return plan


def _output_tensors(src: SourceModel, headers: dict[str, TensorInfo], fmt: str, layout: UpcycleLayout,
                    dtype: torch.dtype) -> list[TensorInfo]:
    h, w, n = src.hidden, layout.expert_width, layout.n_experts
    out = [TensorInfo("model.embed_tokens.weight", dtype, (src.vocab, h))]
    for i in range(src.n_layers):
        out += attention_infos(src, headers, fmt, i, dtype)
        for name in ffn_tensor_names(fmt, i, n, dense=False, shared=layout.shared_width > 0):
            if name.endswith("shared_expert_gate.weight"):
                shape = (1, h)
            elif name.endswith(".gate.weight"):
                shape = (n, h)
            else:
                width = layout.shared_width if ".shared_expert." in name else w
                shape = (h, width) if name.endswith(("w2.weight", "down_proj.weight")) else (width, h)
            out.append(TensorInfo(name, dtype, shape))
    out.append(TensorInfo("model.norm.weight", dtype, (h,)))
    if not src.tied:
        out.append(TensorInfo("lm_head.weight", dtype, (src.vocab, h)))
    return out


# ------------------------------------------------------------------------------------------------ running


def run_upcycle(plan: UpcyclePlan, out: str | Path, *, overwrite: bool = False, progress: Progress | None = None,
                check_ids: torch.Tensor | Callable[[], torch.Tensor] | None = None) -> dict:
    """Write OUT atomically and check it against the source; returns the report (also OUT/report.json).
    check_ids: (n, seq) token windows the model as written is scored on (KL to the source), or what makes them (on
    the check's thread, beside the writer); None: random tokens."""
    out = Path(out)
    src = plan.src
    if plan.reader is None:
        raise MoeifyError(f"the plan of {src.path} was made from config.json alone (a dry run) and cannot be written",
                          "plan it with its weights (weights=True)")
    try:
        with staged_output(out, overwrite, src.path, plan.output_bytes) as tmp:
            report = _write_output(plan, tmp, progress, check_ids)
            commit_output(tmp, out)
    finally:
        for reader in (plan.reader, *plan.readers, *([plan.shared_reader] if plan.shared_reader else [])):
            reader.close()
    return report


def _write_output(plan: UpcyclePlan, tmp: Path, progress: Progress | None, check_ids) -> dict:
    """Write into the temporary directory `tmp` and check it, the check a layer behind the writer on a thread of its
    own (reading back each layer once written, or the sources through readers of its own); returns the report."""
    t0 = time.time()
    (tmp / "config.json").write_text(json.dumps(plan.config_json, indent=2, sort_keys=True) + "\n")

    def follow(reader) -> dict:
        ids = check_ids() if callable(check_ids) else check_ids
        own, readers = _own_readers(plan)
        try:
            check = check_output(plan, tmp, partial(_regenerate, own), progress, ids, reader)
        finally:
            for r in readers:
                r.close()
        check["seconds"] = round(time.time() - t0, 3)  # its thread's time, from the writer's start
        return check

    layers, check = write_shards(tmp, plan.shards, lambda writer: _write_tensors(plan, writer, progress),
                                 follow=follow)
    seconds = time.time() - t0  # writing and checking, side by side
    summary = plan.summary()
    summary.pop("engines")
    report = {"moeify_version": __version__, **summary, "seconds": round(seconds, 3), "check": check,
              "layers": layers}
    write_metadata(tmp, plan.src.path, report=report, toml=recipe_toml(plan))
    return report


def _own_readers(plan: UpcyclePlan) -> tuple[UpcyclePlan, list[CheckpointReader]]:
    """The plan with readers of its own over the same checkpoints (a checkpoint named twice still read once), for
    the check's thread while the writer's reads the plan's; and those readers, to close. Without the NaN/Inf scan:
    the writer's side scans every source tensor it reads."""
    fresh: dict[int, CheckpointReader] = {}

    def own(r: CheckpointReader | None) -> CheckpointReader | None:
        if r is not None and id(r) not in fresh:
            fresh[id(r)] = CheckpointReader(r.root, allow_pickle=r.pickled, scan_nonfinite=False)
        return None if r is None else fresh[id(r)]

    copy = replace(plan, reader=own(plan.reader), readers=[own(r) for r in plan.readers],
                               shared_reader=own(plan.shared_reader))
    return copy, list(fresh.values())


def _regenerate(plan: UpcyclePlan, broken: bool, base_only: bool = False):
    """Each layer's experts made again (the check's, for an output too large to read back, and the construction before
    symmetry breaking), cast as the output holds them; base_only: every copy the base's FFN (a merge's exact model)."""
    def experts(i: int):
        ffns, shared = ([plan.base_ffn(i)] * plan.layout.copies, None) if base_only else plan.ffns(i)
        return layer_experts(plan, i, ffns, broken, shared_ffn=shared).experts.cast(plan.out_dtype)
    return experts


class AveragedReader:
    """The mean of several readers' tensors of one name (a merge's --attention average), float32 sums."""

    def __init__(self, readers: list[CheckpointReader]):
        self.readers = readers
        self.tensors = readers[0].tensors

    def get(self, name: str) -> torch.Tensor:
        first = self.readers[0].get(name)
        return (sum(r.get(name).float() for r in self.readers) / len(self.readers)).to(first.dtype)


def _write_tensors(plan: UpcyclePlan, writer, progress: Progress | None) -> list[dict]:
    src, dtype = plan.src, plan.out_dtype
    reader = AveragedReader(plan.readers) if plan.attention == "average" else plan.reader
    plan.reader.prefetch(plan.reader.layer_tensors(0))
    writer.write("model.embed_tokens.weight", reader.get("model.embed_tokens.weight").to(dtype))
    layers = []
    for i in range(src.n_layers):
        if i + 1 < src.n_layers:
            plan.reader.prefetch(plan.reader.layer_tensors(i + 1))
        write_attention(writer, reader, src, plan.fmt, i, dtype)
        ffns, shared = plan.ffns(i)
        le = layer_experts(plan, i, ffns, shared_ffn=shared)
        del ffns, shared
        for name, t in ffn_tensors(plan, i, le):
            writer.write(name, t)
        layers.append(le.report)
        del le
        if progress:
            progress("writing", i + 1, src.n_layers)
    write_head(writer, reader, src, src.tied, dtype)
    return layers


def recipe_toml(plan: UpcyclePlan) -> str:
    """What was built, as TOML (OUT/moeify.toml): the construction, a merge's sources and choices, the settings."""
    kind = "merge" if plan.sources else "upcycle"
    lines = [f"# moeify {__version__}: {kind} of {plan.src.path.name}", f"construction = \"{kind}\""]
    if plan.sources:  # the checkpoints by folder name (report.json has their paths)
        merge = {k: v for k, v in plan.summary().items() if k in MERGE_KEYS}
        merge["sources"] = [Path(p).name for p in merge["sources"]]
        if "shared_source" in merge:
            merge["shared_source"] = Path(merge["shared_source"]).name
        lines += [f"base = {json.dumps(plan.src.path.name)}"] + [f"{k} = {json.dumps(v)}" for k, v in merge.items()]
    for key, value in settings_dict(plan.settings).items():
        lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


__all__ = ["UpcycleSettings", "UpcyclePlan", "plan_upcycle", "run_upcycle", "layer_experts", "recipe_toml"]
