"""The weights of a next-token training run (moeify.tuning.lm) read from OUT and written back, a tensor at a time.

Reading: the output's transformers model is built on the meta device, sharded by FSDP2 there when the run is
(moeify.training.parallel.Parallel.shard: each decoder layer a group, then the rest), and only then given memory: each rank
reads from OUT's safetensors only its own rows of every sharded parameter (CheckpointReader.get_rows, plain reads:
no memory-mapped file whose touched pages would count in the process's memory), one process every parameter. No
process holds the whole model unless it trains it whole; transformers' from_pretrained would load it whole on every
rank, beside the mapped checkpoint.

transformers 5 fuses each layer's experts into two parameters, `mlp.experts.gate_up_proj` (E, 2I, H: expert e's
gate rows, then its up rows) and `mlp.experts.down_proj` (E, H, I), where the checkpoint (Mixtral's
`block_sparse_moe.experts.e.w1 / w3 / w2`, Qwen2-MoE's and Qwen3-MoE's `mlp.experts.e.gate_proj / up_proj /
down_proj`) holds one tensor per expert and projection, as transformers' own conversion mapping says
(transformers/conversion_mapping.py: "mixtral", "qwen2_moe"). A rank's rows of a fused parameter are whole experts.

Writing: every parameter gathered whole in turn (a collective: every rank calls it, in the same order), split into
the checkpoint's tensors on rank 0 and streamed to the output files in OUT's dtype and names (moeify.formats.writer): the
process writing holds one parameter whole at a time (one layer's experts), never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ..formats.checkpoint import CheckpointReader, TensorInfo
from ..errors import MoeifyError

_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))  # Mixtral's; Qwen2/3-MoE's


def parts(name: str, experts: int, known) -> tuple[str, list]:
    """How model parameter `name` is stored in the checkpoint whose tensor names are `known`: ("plain", [name]),
    ("gate_up", [(gate, up) per expert]) or ("down", [down per expert])."""
    renamed = [name, name.replace(".mlp.", ".block_sparse_moe.")]
    fused = next((f for f in ("gate_up_proj", "down_proj") if name.endswith(".experts." + f)), None)
    if fused is None:
        found = next((n for n in renamed if n in known), None)
        if found is None:
            raise MoeifyError(f"the model's parameter {name} is not in the checkpoint",
                              "the output is not one moeify upcycle or merge wrote; train it in transformers")
        return "plain", [found]
    for prefix in (n[: -len(fused)] for n in renamed):
        for gate, up, down in _EXPERT_NAMES:
            if f"{prefix}0.{gate}.weight" in known:
                if fused == "down_proj":
                    return "down", [f"{prefix}{e}.{down}.weight" for e in range(experts)]
                return "gate_up", [(f"{prefix}{e}.{gate}.weight", f"{prefix}{e}.{up}.weight") for e in range(experts)]
    raise MoeifyError(f"the experts of {name} are not in the checkpoint under any name transformers reads",
                      "the output is not one moeify upcycle or merge wrote; train it in transformers")


def read_rows(reader: CheckpointReader, name: str, shape: tuple, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop (dim 0) of model parameter `name` of this shape, read from the checkpoint."""
    kind, names = parts(name, shape[0], reader.tensors)
    if kind == "plain":
        return reader.get_rows(names[0], start, stop)
    if start >= stop:
        return torch.empty((0, *shape[1:]), dtype=reader.tensors[names[0][0] if kind == "gate_up" else names[0]].dtype)
    if kind == "down":
        return torch.stack([reader.get(n) for n in names[start:stop]])
    return torch.stack([torch.cat([reader.get(g), reader.get(u)]) for g, u in names[start:stop]])


def split(kind: str, names: list, whole: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole parameter as the checkpoint's tensors (the inverse of read_rows)."""
    if kind == "plain":
        yield names[0], whole
    elif kind == "down":
        yield from ((n, whole[e]) for e, n in enumerate(names))
    else:
        half = whole.shape[1] // 2
        for e, (g, u) in enumerate(names):
            yield g, whole[e, :half]
            yield u, whole[e, half:]


def materialise(model, dev: str, src: Path, hint: str, params_on: str | None = None) -> None:
    """Memory for a model built on the meta device (FSDP2-sharded or not), uninitialised: its parameters on
    params_on (default dev), tied weights tied again (to_empty gives them separate storage), the rotary
    embedding's buffers computed from the config on dev; refused when another buffer would be left uninitialised."""
    model.to_empty(device=params_on or dev)
    model.tie_weights()
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(model.config).to(dev)
    others = [n for n, _ in model.named_buffers() if not n.startswith("model.rotary_emb.")]
    if others:
        raise MoeifyError(f"{src}: cannot build this model's buffers from its config ({', '.join(others)})", hint)


def load_weights(model, out: Path, dev: str, par) -> None:
    """Give a meta-device model (sharded or not) its memory on `dev` (host memory for FSDP2's offloaded shards) and
    OUT's weights: each rank its own rows of every sharded parameter."""
    from torch.distributed.tensor import DTensor

    materialise(model, dev, out, "train it in transformers", params_on="cpu" if par.offload else dev)
    reader = CheckpointReader(out)
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                start, stop = par.rows(p.shape[0]) if isinstance(p, DTensor) else (0, p.shape[0])
                if local.shape[0] != stop - start:
                    raise RuntimeError(f"{name}: FSDP2 holds {local.shape[0]} rows on rank {par.rank}, "
                                       f"expected {stop - start}")
                local.copy_(read_rows(reader, name, tuple(p.shape), start, stop).to(local.dtype))
    finally:
        reader.close()


def planned(model, base: dict[str, TensorInfo]) -> list[TensorInfo]:
    """The output's tensors in the order write_weights makes them, in the base's dtypes; refused unless they are
    exactly the base's names and shapes."""
    order = []
    for name, p in model.named_parameters():
        kind, names = parts(name, p.shape[0], base)
        for n, t in split(kind, names, torch.empty(p.shape, device="meta")):
            if n not in base or tuple(t.shape) != tuple(base[n].shape):
                raise RuntimeError(f"output check failed: the trained {n} {tuple(t.shape)} is not the base's")
            order.append(TensorInfo(n, base[n].dtype, tuple(t.shape)))
    missing = sorted(set(base) - {t.name for t in order})
    if missing:
        raise RuntimeError(f"output check failed: the trained model has no {missing[:3]}")
    return order


def write_weights(model, writer, known, dtype: torch.dtype, par) -> None:
    """Every parameter gathered whole in turn (every rank calls it), written by rank 0 (`writer`, a ShardWriter
    planned by `planned`; None elsewhere) as the checkpoint's tensors (`known`: its names) in OUT's dtype."""
    from ..training.parallel import full

    for name, p in model.named_parameters():
        whole = full(p.detach())
        if par.main:
            kind, names = parts(name, p.shape[0], known)
            for n, t in split(kind, names, whole):
                writer.write(n, t.to("cpu", dtype))
        del whole


__all__ = ["load_weights", "materialise", "planned", "read_rows", "split", "write_weights"]
