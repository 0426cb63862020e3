"""The teacher: the dense source loaded for tuning (whole in one process, sharded across processes), its pass over
the real windows the run will draw (the tuning targets, computed once before the loop and saved), and the freeing
of its FFNs once every target is kept, before the student is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..formats.checkpoint import CheckpointReader
from ..errors import MoeifyError
from .data import SAMPLE_BATCH, TeacherTargets, drawn_windows
from .options import Progress
from .output import BaseOutput
from .state import _atomic_save

def load_teacher(src: Path, dev: str, par=None):
    """The dense source as the tuning teacher, float32 on `dev`, frozen, in eval mode.

    One process: transformers' from_pretrained. Across processes (torchrun): the teacher is sharded, never held
    whole by any process: the model is built on the meta device, every decoder layer's attention and FFN become
    FSDP2 groups of their own (moeify.training.parallel.Parallel.shard_frozen: gathered for each forward, resharded after
    it), and each rank reads from SRC's safetensors only its own rows of those weights (CheckpointReader.get_rows);
    the embeddings, norms and output head (small beside the layers; the KL reads the head whole) are read whole on
    every rank. The student shares these modules with the teacher (share_frozen), so the FSDP2 groups are the
    teacher's attention and FFN modules themselves: whoever calls them gathers them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..training.parallel import Parallel
    from .lm_weights import materialise

    par = par or Parallel()
    if not par.on:
        try:
            return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True,
                                                        use_safetensors=True, trust_remote_code=False).to(dev).eval()
        except OSError as exc:
            raise MoeifyError(f"tuning cannot load {src} ({exc.__class__.__name__})",
                              "tuning needs the source's safetensors weights") from None
    from torch.distributed.tensor import DTensor

    reader = CheckpointReader(src)  # refuses pickled weights, as from_pretrained(use_safetensors=True) does
    config = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    for layer in teacher.model.layers:
        par.shard_frozen(layer.self_attn)
        par.shard_frozen(layer.mlp)
    materialise(teacher, dev, src, "tune it in one process")
    try:
        with torch.no_grad():
            for name, p in teacher.named_parameters():
                if isinstance(p, DTensor):
                    local = p.to_local()
                    a, b = par.rows(p.shape[0])
                    if local.shape[0] != b - a:
                        raise RuntimeError(f"{name}: FSDP2 holds {local.shape[0]} rows on rank {par.rank}, "
                                           f"expected {b - a}")
                    local.copy_(reader.get_rows(name, a, b).to(local.dtype))
                else:
                    p.copy_(reader.get(name).to(p.dtype))
    finally:
        reader.close()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


TARGET_BATCH = 16  # windows per file of the teacher pass
def teacher_pass(root: Path, teacher, train: torch.Tensor, held: torch.Tensor, targets: TeacherTargets | None,
                 settings, progress: Progress | None, par=None) -> tuple[TeacherTargets | None, torch.Tensor]:
    """The teacher's final hidden states (float32) of every real training window the run will draw and of the
    held-out windows, computed once before tuning (saved batch by batch in the state directory, so a resumed run
    reads them back), so that the tuning loop never runs the teacher: a window seen in several passes costs one
    teacher forward, and the teacher's FFNs can be freed before the student is built. Returns (the targets of
    every drawn window, the held-out windows' targets)."""
    from ..training.steps import final_hidden
    from ..maths.numerics import tuning_autocast
    from ..training.parallel import Parallel

    par = par or Parallel()
    folder = root / "targets"
    folder.mkdir(exist_ok=True)
    seq = train.shape[1]
    per_step = max(1, settings.batch_tokens // seq)
    steps = max(1, -(-settings.tokens // (per_step * seq)))
    first = targets.first if targets is not None else train.shape[0]
    real = [int(i) for i in drawn_windows(train.shape[0], settings.seed, per_step, steps) if i < first]
    jobs = [("held", torch.arange(held.shape[0]))] + [
        ("train", torch.tensor(real[s:s + TARGET_BATCH])) for s in range(0, len(real), TARGET_BATCH)]
    dev = next(teacher.parameters()).device
    ctx = tuning_autocast(str(dev), settings.autocast)[0]
    done_tokens, total_tokens = 0, sum(len(idx) for _, idx in jobs) * seq
    for start in range(0, len(jobs), par.world):  # rounds of one job a rank, in step (the teacher may be sharded)
        b = start + par.rank
        kind, idx = jobs[b] if b < len(jobs) else ("none", torch.empty(0, dtype=torch.long))
        f = folder / f"batch-{b:05d}.safetensors"
        # float32, and batched as the loop would run them (held-out windows a step's worth at a time, training
        # windows one micro-batch at a time): the targets are the very values the teacher in the loop computes
        size = per_step if kind == "held" else max(1, settings.micro_windows)
        todo = [] if f.is_file() or not len(idx) else list(range(0, len(idx), size))
        rounds = par.most(len(todo))
        with torch.no_grad(), ctx:
            windows = (held if kind == "held" else train)[idx] if todo else None
            hidden = [final_hidden(teacher, windows[s:s + size].to(dev)).float().cpu() for s in todo]
            for _ in range(rounds - len(todo)):  # as many forwards as the busiest rank (one token each)
                final_hidden(teacher, train[:1, :1].to(dev))
        if todo:
            _atomic_save({"index": idx.contiguous(), "hidden": torch.cat(hidden).contiguous()}, f)
        done_tokens += sum(len(j[1]) for j in jobs[start:start + par.world]) * seq
        if progress:
            progress("teacher targets", done_tokens, total_tokens)
    if par.main:
        (folder / "complete.json").write_text(json.dumps({"real_windows": len(real), "held_out": int(held.shape[0])}))
    par.arrive("the end of the teacher pass")  # every rank's target files are written
    if targets is None:
        targets = TeacherTargets(root / "sampled", first, 0, SAMPLE_BATCH)
    held_t = torch.empty(0)
    for b, (kind, _) in enumerate(jobs):
        f = folder / f"batch-{b:05d}.safetensors"
        if not f.is_file():
            continue
        if kind == "held":
            held_t = load_file(str(f))["hidden"]
        else:
            handle = safe_open(str(f), "pt")
            for row, i in enumerate(handle.get_tensor("index").tolist()):
                targets.real[int(i)] = (handle, row)
    return targets, held_t


def free_teacher_ffns(teacher, base: BaseOutput) -> None:
    """Drop the teacher's FFN weights of the layers the base output carved, once tuning reads all its targets from
    the teacher pass (what the student shares with the teacher, its attention, embeddings, norms and head, stays;
    so do the FFNs of layers kept dense, which the student copies)."""
    for entry in base.report["layers"]:
        if not entry.get("dense"):
            teacher.model.layers[entry["layer"]].mlp = _FreedFFN()


class _FreedFFN(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("the teacher's FFNs were freed after the teacher pass; tuning reads its targets")
