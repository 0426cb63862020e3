"""The merge stage: one MoE from several fine-tunes of one base (Branch-Train-MiX, mergekit-moe's merges). Each
source's FFN becomes one copy (G fine-grained slices of it), attention, norms and embeddings are the base's or the
sources' average, and each layer's router rows are made by a gate mode (moeify.merging.spec.GATE_MODES, dispatched
by gate_rows): from each expert's prompts or text through the base, run one decoder layer at a time (mergekit-moe's
hidden states entering each layer, or moeify's router input: the post-attention-norm hidden state of every token),
from the prompts' token embeddings, or random. The arguments come over a mergekit-moe YAML's keys (merge_request;
moeify.merging.spec reads it). Written and checked by the upcycle stage (moeify.upcycling.upcycle): a merge is an upcycle
whose copies come from different checkpoints. With every expert the base's FFN the model computes the base (checked
at the end of every run when the attention is the base's); the KL of the merge as written to the base is reported.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable

import torch

from ..formats.checkpoint import CheckpointReader, check_links
from ..errors import MoeifyError
from ..formats.families import TOKENIZER_FILES, SourceModel, check_source_tensors, load_source
from ..formats.hub import resolve
from .spec import GATE_MODES, ExpertSpec, check_prompts, output_format, read_merge_spec
from ..upcycling.upcycle import UpcyclePlan, UpcycleSettings, plan_upcycle

UNPROMPTED = ("random", "uniform_random")  # gate modes that need no prompts or text

ATTENTION = ("base", "average")
SHAPE_KEYS = ("model_type", "hidden", "d_ff", "n_layers", "heads", "kv_heads", "head_dim", "vocab", "tied",
              "qkv_bias", "qk_norm", "sliding_window")


def _tokenizer_digest(path: Path) -> str | None:
    h = hashlib.sha256()
    found = False
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
        f = path / name
        if f.is_file():
            found = True
            h.update(name.encode() + f.read_bytes())
    return h.hexdigest() if found else None


def check_compatible(base: SourceModel, sources: list[SourceModel]) -> None:
    """Every source has the base's shapes, family and tokenizer (one line naming the first difference)."""
    want = _tokenizer_digest(base.path)
    for s in sources:
        for key in SHAPE_KEYS:
            a, b = getattr(base, key), getattr(s, key)
            if a != b:
                raise MoeifyError(f"{s.path} does not fit the base {base.path}: {key} {b} against {a}",
                                  "merge fine-tunes of one base model (same family, shapes and tokenizer)")
        if dict(s.rope_parameters) != dict(base.rope_parameters):
            raise MoeifyError(f"{s.path} does not fit the base {base.path}: rope {s.rope_parameters} against "
                              f"{base.rope_parameters}", "merge fine-tunes of one base model")
        got = _tokenizer_digest(s.path)
        if got != want:
            raise MoeifyError(f"{s.path} has another tokenizer than the base {base.path}",
                              "merge fine-tunes that share the base's tokenizer files")


def plan_merge(base: str | Path, sources: list[str | Path], settings: UpcycleSettings, *, attention: str = "base",
               allow_pickle: bool = False, force: bool = False, shared: str | Path | None = None,
               shared_scale: float = 1.0) -> UpcyclePlan:
    """Check every source against the base (headers only) and plan the merged MoE: copies = the sources. shared: a
    source whose whole FFN is an always-on shared expert (Qwen2-MoE), its output × shared_scale."""
    if len(sources) < 2:
        raise MoeifyError(f"merge needs at least 2 sources, got {len(sources)}", "name each fine-tune to merge")
    if attention not in ATTENTION:
        raise MoeifyError(f"--attention {attention!r} is not one of {', '.join(ATTENTION)}")
    models = [load_source(s) for s in sources]
    extra = [load_source(shared)] if shared is not None else []
    if extra:
        if settings.shared_width:
            raise MoeifyError("a shared source and --shared-width both ask for the shared expert",
                              "give one of them")
        settings = dataclasses.replace(settings, shared_width=extra[0].d_ff)
    plan = plan_upcycle(base, dataclasses.replace(settings, copies=len(models)), allow_pickle=allow_pickle,
                        force=force, shared_apart=bool(extra))
    check_compatible(plan.src, models + extra)
    readers, opened = [], {plan.src.path: plan.reader}  # one reader a checkpoint: a source named twice is read once
    for m in models + extra:
        if m.path not in opened:
            check_links(m.path, ("config.json", *TOKENIZER_FILES))
            opened[m.path] = CheckpointReader(m.path, allow_pickle=allow_pickle)
            check_source_tensors(m, opened[m.path].tensors)
        readers.append(opened[m.path])
    return dataclasses.replace(plan, sources=models, readers=readers[:len(models)], attention=attention,
                               shared_source=extra[0] if extra else None, shared_reader=readers[-1] if extra else None,
                               shared_scale=shared_scale)


def token_groups(plan: UpcyclePlan, prompts: list[list[str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each group of prompts as (ids (n, longest), lengths (n,)): right-padded with 0, which a causal model's real
    tokens never see (the padding comes after them); each prompt tokenized as mergekit does, its tokenizer's BOS
    text before it and no other special tokens."""
    from ..formats.text import source_tokenizer

    tok = source_tokenizer(plan.src.path)
    bos = tok.bos_token or ""
    groups = []
    for group in prompts:
        ids = [tok(bos + p, add_special_tokens=False)["input_ids"] or [0] for p in group]
        padded = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
        for r, row in enumerate(ids):
            padded[r, :len(row)] = torch.tensor(row)
        groups.append((padded, torch.tensor([len(r) for r in ids])))
    return groups


@torch.no_grad()
def layer_states(plan: UpcyclePlan, groups: list[tuple[torch.Tensor, torch.Tensor]],
                 progress: Callable[[str, int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """Every group's token sequences (ids (n, seq), lengths (n,)) through the base, one decoder layer at a time
    (all groups in one pass), reduced per group and layer to (n_layers, groups, d_model):
    "last": the hidden state entering the layer at each sequence's last token, averaged over its sequences;
    "avg": the hidden state entering the layer averaged over each sequence's tokens, then over its sequences;
    "router_input": the post-attention-norm hidden state (the router's input), averaged over all its tokens."""
    from ..evaluation.layerwise import ResidentRun, source_stack

    seq = max(ids.shape[1] for ids, _ in groups)
    ids = torch.cat([torch.nn.functional.pad(g, (0, seq - g.shape[1])) for g, _ in groups])
    lengths = torch.cat([n for _, n in groups])
    owner = torch.cat([torch.full((len(n),), j) for j, (_, n) in enumerate(groups)])
    real = (torch.arange(seq)[None, :] < lengths[:, None]).float()  # (N, seq)
    member = (owner[None, :] == torch.arange(len(groups))[:, None]).float()  # (groups, N)
    seqs = member / member.sum(1, keepdim=True)  # a group's mean over its sequences
    toks = member * lengths[None, :].float()
    toks = toks / toks.sum(1, keepdim=True)  # a group's mean over its tokens, from each sequence's mean

    model = ResidentRun(source_stack(plan.src, plan.reader), ids)
    out: dict[str, list] = {"last": [], "avg": [], "router_input": []}
    for i in range(plan.src.n_layers):
        h = model.hidden
        out["last"].append(seqs @ h[torch.arange(len(ids)), lengths - 1])
        out["avg"].append(seqs @ ((h * real[..., None]).sum(1) / lengths[:, None]))
        layer = model.load_layer(i)
        h_mid, x = model.attention(layer)
        out["router_input"].append(toks @ ((x * real[..., None]).sum(1) / lengths[:, None]))
        model.advance(h_mid, layer.mlp(x))
        del layer
        if progress:
            progress("router inputs", i + 1, plan.src.n_layers)
    return {k: torch.stack(v) for k, v in out.items()}


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-8)


def cheap_embed_rows(plan: UpcyclePlan, prompts: list[tuple[list[str], list[str]]]) -> dict[int, torch.Tensor]:
    """mergekit's cheap_embed: each expert's prompt tokens' embeddings summed and scaled to unit length (minus its
    negative prompts' the same way, again unit length), one row for every layer."""
    embed = plan.reader.get("model.embed_tokens.weight").float()
    rows = []
    for pos, neg in prompts:
        ids, n = token_groups(plan, [pos])[0]
        v = _unit(embed[ids][torch.arange(ids.shape[1])[None, :] < n[:, None]].sum(0))
        if neg:
            ids, n = token_groups(plan, [neg])[0]
            v = _unit(v - _unit(embed[ids][torch.arange(ids.shape[1])[None, :] < n[:, None]].sum(0)))
        rows.append(v)
    return {i: torch.stack(rows) for i in range(plan.src.n_layers)}


def gate_rows(plan: UpcyclePlan, mode: str, *, prompts: list[tuple[list[str], list[str]]] | None = None,
              texts: list[torch.Tensor] | None = None, seed: int = 0,
              progress: Callable[[str, int, int], None] | None = None) -> dict[int, torch.Tensor] | None:
    """{layer: (E, d_model)} router rows by gate mode (moeify.merging.spec.GATE_MODES), from each expert's (positive,
    negative) prompts or, for router_input, from each source's text windows (texts: (n, seq) ids each); None for
    random (moeify.upcycling.copies.random_router draws them as an upcycle does)."""
    n_layers, d = plan.src.n_layers, plan.src.hidden
    copies = len(texts) if texts is not None else len(prompts) if prompts is not None else plan.layout.copies
    if mode == "random":  # UNPROMPTED
        return None
    if mode == "uniform_random":
        gen = torch.Generator().manual_seed(seed)
        return {i: (torch.rand(copies, d, generator=gen) * 2 - 1) / d ** 0.5 for i in range(n_layers)}
    if mode == "cheap_embed":
        return cheap_embed_rows(plan, prompts)
    if texts is not None:
        groups, negatives = [(t, torch.full((t.shape[0],), t.shape[1])) for t in texts], []
    else:
        groups = token_groups(plan, [pos for pos, _ in prompts])
        negatives = [j for j, (_, neg) in enumerate(prompts) if neg]
        groups += token_groups(plan, [prompts[j][1] for j in negatives])
    key = {"hidden": "last", "hidden_last": "last", "hidden_avg": "avg", "router_input": "router_input"}[mode]
    states = layer_states(plan, groups, progress)[key]  # (n_layers, groups, d)
    rows = states[:, :copies].clone()
    for g, j in enumerate(negatives):  # mergekit subtracts the negative prompts' state, then normalises
        rows[:, j] -= states[:, copies + g]
    if mode == "router_input" and copies > 1:  # centred on the experts' mean: what sets each one apart
        rows = rows - rows.mean(dim=1, keepdim=True)
    rows = _unit(rows)
    return {i: rows[i] for i in range(n_layers)}


@dataclasses.dataclass
class MergeRequest:
    """What a merge is asked for: the arguments given, over a mergekit-moe YAML's keys (moeify.merging.spec)."""

    sources: list[str]
    base: str | None
    top_k: int | None
    gate_mode: str
    settings: dict
    prompts: list[tuple[list[str], list[str]]] | None = None  # (positive, negative) per expert
    scales: list[float] | None = None  # residual_scale per expert
    shared: ExpertSpec | None = None


def merge_request(sources, *, config=None, base=None, granularity: int = 1, top_k: int | None = None,
                  gate_mode: str | None = None, router_text=None, settings: dict) -> MergeRequest:
    """The arguments folded over the config's keys (an argument given wins), the gate mode chosen and checked."""
    req = MergeRequest([str(s) for s in sources or []], None if base is None else str(base), top_k, gate_mode,
                       dict(settings))
    if config is not None:
        spec = read_merge_spec(config)
        if req.sources:
            raise MoeifyError(f"sources named both on the command line and in --config {config}",
                              "name them in one place (the config's experts)")
        req.sources, req.prompts, req.shared = [e.source for e in spec.experts], spec.prompts, spec.shared
        req.base = spec.base if base is None else req.base
        req.top_k = spec.experts_per_token * granularity if top_k is None else top_k
        req.gate_mode = gate_mode or spec.gate_mode
        if req.settings.get("dtype") in (None, "auto"):
            req.settings["dtype"] = spec.dtype
        if req.settings.get("format") in (None, "auto"):
            req.settings["format"] = output_format(spec.formats, load_source(resolve(req.base)).model_type,
                                                   spec.shared is not None)
        if any(e.residual_scale is not None for e in spec.experts):
            req.scales = [1.0 if e.residual_scale is None else e.residual_scale for e in spec.experts]
    if not req.sources:
        raise MoeifyError("no sources to merge", "name two or more fine-tunes, or a mergekit-moe YAML (--config)")
    req.gate_mode = req.gate_mode or ("router_input" if router_text is not None else "random")
    if req.gate_mode not in GATE_MODES:
        raise MoeifyError(f"--gate-mode {req.gate_mode!r} is not one of {', '.join(GATE_MODES)}")
    if router_text is not None:
        if len(router_text) != len(req.sources):
            raise MoeifyError(f"--router-text names {len(router_text)} file(s) for {len(req.sources)} sources",
                              "give one text per source, in the order of the sources")
        if req.gate_mode != "router_input":
            raise MoeifyError(f"--router-text makes router_input rows, not gate mode {req.gate_mode}",
                              "leave out --gate-mode (or give router_input)")
    elif req.prompts is None and req.gate_mode not in UNPROMPTED:
        raise MoeifyError(f"--gate-mode {req.gate_mode} needs each expert's prompts or text",
                          "give --router-text (one file per source) or a mergekit-moe YAML with prompts (--config)")
    else:
        check_prompts(req.prompts or [], req.gate_mode, config)
    if req.top_k is None:
        req.top_k = granularity * min(2, len(req.sources))
    return req


def prepare_merge(sources, out: str | Path, *, config=None, base=None, granularity: int = 1, top_k: int | None = None,
                  attention: str = "base", gate_mode: str | None = None, router_text=None, router_tokens: int = 2048,
                  overwrite: bool = False, allow_pickle: bool = False, force: bool = False,
                  progress: Callable[[str, int, int], None] | None = None, **settings) -> UpcyclePlan:
    """The merge planned and its router rows made (moeify.api.merge's arguments): every check before any writing."""
    from ..formats.text import read_texts, first_windows
    from ..formats.config import parse_size
    from ..formats.output import check_output_path

    req = merge_request(sources, config=config, base=base, granularity=granularity, top_k=top_k,
                        gate_mode=gate_mode, router_text=router_text, settings=settings)
    given = {k: v for k, v in req.settings.items() if v is not None}
    given.setdefault("symmetry", "none")
    if "max_shard_size" in given:
        given["max_shard_bytes"] = parse_size(given.pop("max_shard_size"))
    shared = req.shared
    plan = plan_merge(resolve(req.base or req.sources[0]), [resolve(s) for s in req.sources],
                      UpcycleSettings(granularity=granularity, top_k=req.top_k, **given), attention=attention,
                      allow_pickle=allow_pickle, force=force, shared=None if shared is None else resolve(shared.source),
                      shared_scale=1.0 if shared is None or shared.residual_scale is None else shared.residual_scale)
    check_output_path(Path(out), overwrite, plan.src.path)
    texts = None if router_text is None else [first_windows(plan.src.path, read_texts([f]), router_tokens,
                                                              f"--router-text {f}") for f in router_text]
    plan.router_rows = gate_rows(plan, req.gate_mode, prompts=req.prompts, texts=texts, seed=plan.settings.seed,
                                 progress=progress)
    if shared is not None and shared.positive and req.gate_mode not in UNPROMPTED:
        plan.shared_rows = gate_rows(plan, req.gate_mode, prompts=[(shared.positive, shared.negative)],
                                     progress=progress)
    plan.gate_mode, plan.scales = req.gate_mode, req.scales
    return plan


__all__ = ["ATTENTION", "UNPROMPTED", "check_compatible", "plan_merge", "token_groups", "layer_states",
           "cheap_embed_rows", "gate_rows", "MergeRequest", "merge_request", "prepare_merge"]
