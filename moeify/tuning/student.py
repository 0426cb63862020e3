"""The student: the dense model with every carved layer's FFN replaced by a MaskedMoE holding the output's experts
and router, built on the teacher's own frozen modules (nothing copied), sharded as it is built across processes
(FSDP2), and gathered back into whole tensors after a sharded run so the output is written from plain tensors.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from ..formats.checkpoint import CheckpointReader
from ..formats.families import attention_tensors, ffn_tensor_names
from ..maths.numerics import release_memory
from .output import BaseOutput, _partition

def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object with the same children, parameters and buffers (none of them copied)."""
    twin = copy.copy(module)
    for k, v in module.__dict__.items():  # its own registries (children, parameters, buffers, hooks): a hook
        if isinstance(v, (dict, set)):    # registered on one (FSDP2's, say) is not registered on the other
            twin.__dict__[k] = copy.copy(v)
    return twin


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters this process holds (its shards of sharded ones)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _own_attention(layer, i: int, config, device: str) -> None:
    """Give the student's decoder layer its own attention and norms, copies of the teacher's (which the layer holds
    until now). A sharded attention (load_teacher across processes) is gathered into a fresh module: the copy is
    then sharded with the student's layer."""
    from ..training.parallel import full

    for name in ("input_layernorm", "post_attention_layernorm"):
        setattr(layer, name, copy.deepcopy(getattr(layer, name)))
    attn = layer.self_attn
    if not _is_sharded(attn):
        layer.self_attn = copy.deepcopy(attn)
        return
    with torch.device("meta"):
        fresh = type(layer)(config, i).self_attn
    fresh.to_empty(device=device)
    theirs = dict(attn.named_parameters())
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(full(theirs[name].detach()))  # a collective: every rank gathers the same tensors in order
    layer.self_attn = fresh


def build_student(teacher, base: BaseOutput, reader: CheckpointReader, device: str, train_attention: bool = False,
                  shard_moe: Callable | None = None, shard_layer: Callable | None = None):
    """The dense model with every carved layer's FFN replaced by a MaskedMoE holding OUT's experts (un-permuted to
    the dense neuron order) and router (its scale folded in: log scale 0); layers whose attention an earlier run
    tuned take OUT's attention and norms. The student is the teacher's module tree down to its decoder layers, new
    objects holding the teacher's own modules (nothing is copied: the model is not held twice, even for a moment),
    except the FFNs it replaces and, where it trains or an earlier run tuned them, its own attention and norms.
    shard_moe / shard_layer (a sharded run): called on each MaskedMoE as it is built, and on each decoder layer with
    its own attention at the end (its MaskedMoE already a group). Returns (student, the layers whose attention an
    earlier run tuned)."""
    from ..formats.experts import unpermute_ffn
    from ..maths.moe_block import MaskedMoE

    cfg, fmt = base.cfg, base.fmt
    student = _shallow(teacher)
    student.model = _shallow(teacher.model)
    student.model.layers = torch.nn.ModuleList([_shallow(layer) for layer in teacher.model.layers])
    own_attention = set()
    for entry in base.report["layers"]:
        i = entry["layer"]
        if train_attention or entry.get("attention_tuned"):
            _own_attention(student.model.layers[i], i, teacher.config, device)
        if entry.get("attention_tuned"):
            own_attention.add(i)
            with torch.no_grad():
                for name in attention_tensors(teacher.config.model_type):
                    w = student.get_submodule(f"model.layers.{i}.{name}").weight
                    w.copy_(reader.get(f"model.layers.{i}.{name}.weight").to(w.dtype))
        if entry.get("dense"):
            if not _is_sharded(teacher.model.layers[i].mlp):  # its own frozen copy: share_frozen may store the
                student.model.layers[i].mlp = copy.deepcopy(teacher.model.layers[i].mlp)  # teacher's in bf16
            continue
        names = ffn_tensor_names(fmt, i, cfg.experts, False, cfg.shared > 0)
        tensors = {n: reader.get(n) for n in names}
        gate, up, down = unpermute_ffn(tensors, _partition(entry, cfg), fmt, i, cfg)
        c = entry.get("shared_gate") if fmt == "qwen2_moe" else None
        moe = MaskedMoE(gate, up, down, tensors[names[0]].float(), 1.0, _partition(entry, cfg).labels(), cfg.top_k,
                        fmt, c)
        del tensors, gate, up, down
        student.model.layers[i].mlp = moe
        if shard_moe is not None:  # sharded as it is built (FSDP2 moves it to the device, then each rank keeps
            shard_moe(moe)         # its shard): no rank ever holds the whole student
        else:
            moe.to(device)
    if shard_layer is not None:
        for layer in student.model.layers:
            shard_layer(layer)
    return student, own_attention


def gather_student(student, teacher, keep: bool = True) -> None:
    """After a sharded run: every sharded tensor of the student's own (the MaskedMoEs', and with --tune-attention
    each layer's attention and norms; not the teacher's modules it shares) replaced by the whole one in host memory
    (a collective, one tensor at a time), so the output is written from plain tensors. keep False (the ranks that do
    not write the output): the gathered tensors are dropped as they come."""
    from torch.distributed.tensor import DTensor

    from ..training.parallel import full

    theirs = {id(p) for p in teacher.parameters()}
    for m in student.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if isinstance(p, DTensor) and id(p) not in theirs:
                whole = full(p.detach())
                value = whole.cpu().clone() if keep else torch.empty(0)
                del whole
                m._parameters[name] = torch.nn.Parameter(value, requires_grad=False)


def tuning_student(teacher, bo: BaseOutput, reader: CheckpointReader, par, train_attention: bool, bf16: bool):
    """The student as the run trains it: built from OUT's tensors (each MaskedMoE an FSDP2 group as it is built when
    par shards, and each decoder layer with its own attention one more), sharing the teacher's frozen modules (in
    bf16 under autocast, except a sharded teacher's, which stay as loaded)."""
    from ..training.steps import share_frozen

    student, own_attention = build_student(
        teacher, bo, reader, par.device, train_attention,
        shard_moe=(lambda m: par.shard_moe(m, torch.bfloat16 if bf16 else None)) if par.sharded else None,
        shard_layer=par.shard if par.sharded and train_attention else None)
    share_frozen(teacher, student, train_attention, torch.bfloat16 if bf16 and not par.on else None,
                 own_attention=own_attention)
    release_memory()
    return student
