"""The merge stage: one MoE from several fine-tunes of one base (Branch-Train-MiX, mergekit-moe's merges). Each
source's FFN becomes one copy (G fine-grained slices of it), attention, norms and embeddings are the base's or the
sources' average, and each layer's router rows come from each source's text, computed on the router's real input
(the post-attention-norm hidden states of every token, the base model run one decoder layer at a time), or are
random. Written and checked by the upcycle stage (moeify.upcycling): a merge is an upcycle whose copies come from
different checkpoints. With every expert the base's FFN the model computes the base (checked at the end of every
run when the attention is the base's); the KL of the merge as written to the base is reported.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import CheckpointReader, check_links
from .errors import MoeifyError
from .families import TOKENIZER_FILES, SourceModel, check_source_tensors, load_source
from .upcycling import UpcyclePlan, UpcycleSettings, plan_upcycle

ATTENTION = ("base", "average")
ROUTERS = ("text", "random")
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
               allow_pickle: bool = False, force: bool = False) -> UpcyclePlan:
    """Check every source against the base (headers only) and plan the merged MoE: copies = the sources."""
    if len(sources) < 2:
        raise MoeifyError(f"merge needs at least 2 sources, got {len(sources)}", "name each fine-tune to merge")
    if attention not in ATTENTION:
        raise MoeifyError(f"--attention {attention!r} is not one of {', '.join(ATTENTION)}")
    models = [load_source(s) for s in sources]
    plan = plan_upcycle(base, dataclasses.replace(settings, copies=len(models)), allow_pickle=allow_pickle,
                        force=force)
    check_compatible(plan.src, models)
    readers = []
    for m in models:
        check_links(m.path, ("config.json", *TOKENIZER_FILES))
        reader = CheckpointReader(m.path, allow_pickle=allow_pickle)
        check_source_tensors(m, reader.tensors)
        readers.append(reader)
    return dataclasses.replace(plan, sources=models, readers=readers, attention=attention)


@torch.no_grad()
def router_rows(plan: UpcyclePlan, source_ids: list[torch.Tensor],
                progress: Callable[[str, int, int], None] | None = None) -> dict[int, torch.Tensor]:
    """{layer: (E, d_model)} router rows: the mean router input of each source's text (its (n, seq) token windows,
    through the base model one decoder layer at a time), centred on the sources' mean so a row says what sets its
    source apart, scaled to unit length."""
    from .calibrate import LayerwiseModel

    means = []  # per source: (n_layers, d_model)
    for s, ids in enumerate(source_ids):
        model = LayerwiseModel(plan.src, plan.reader, ids)
        rows = []
        for i in range(plan.src.n_layers):
            layer = model.load_layer(i)
            h_mid, x = model.attention(layer)
            rows.append(x.reshape(-1, x.shape[-1]).mean(0))
            model.advance(h_mid, layer.mlp(x))
            del layer
            if progress:
                progress(f"router text {s + 1}/{len(source_ids)}", i + 1, plan.src.n_layers)
        means.append(torch.stack(rows))
    stacked = torch.stack(means, dim=1)  # (n_layers, E, d_model)
    centred = stacked - stacked.mean(dim=1, keepdim=True)
    unit = centred / centred.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return {i: unit[i] for i in range(plan.src.n_layers)}


__all__ = ["ATTENTION", "ROUTERS", "check_compatible", "plan_merge", "router_rows"]
