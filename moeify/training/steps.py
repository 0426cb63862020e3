"""What a training run is made of besides its loss and loop, shared by distillation (moeify.training.distill) and
an upcycle's next-token training (moeify.tuning.lm_loop): the models' final hidden states, the stream of training
windows, the kernel of the MoE block, a saved state's tensors produced one at a time, the best weights kept on disk,
and the student sharing the teacher's frozen modules.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from ..formats.families import attention_tensors


def final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids).last_hidden_state


class WindowStream:
    """Training windows drawn in a seeded random order without replacement, reshuffled when all were seen. Its
    position (generator state, order, offset, passes) is part of a tuning run's saved state."""

    def __init__(self, windows: torch.Tensor, seed: int):
        self.windows, self.gen, self.order, self.pos, self.passes = windows, torch.Generator().manual_seed(seed), None, 0, 0
        self._shuffle()

    def _shuffle(self):
        self.order, self.pos = torch.randperm(self.windows.shape[0], generator=self.gen), 0

    def take(self, n: int) -> torch.Tensor:
        return self.windows[self.take_indices(n)]

    def take_indices(self, n: int) -> torch.Tensor:
        out = []
        while n:
            if self.pos == len(self.order):
                self._shuffle()
                self.passes += 1
            m = min(n, len(self.order) - self.pos)
            out.append(self.order[self.pos:self.pos + m])
            self.pos, n = self.pos + m, n - m
        return torch.cat(out)

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return {"stream.gen": self.gen.get_state(), "stream.order": self.order.clone()}, {"pos": self.pos,
                                                                                          "passes": self.passes}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        if tensors["stream.order"].numel() != self.windows.shape[0]:
            raise ValueError("saved stream position is for another set of training windows")
        self.gen.set_state(tensors["stream.gen"])
        self.order, self.pos, self.passes = tensors["stream.order"].clone(), int(meta["pos"]), int(meta["passes"])


def eager_forwards(teacher, student) -> tuple[Callable, Callable]:
    """(teacher's final hidden states of a micro-batch, student's), uncompiled."""
    return (lambda ids: final_hidden(teacher, ids)), (lambda ids: final_hidden(student, ids))


def moe_kernel(kernel: str, device: torch.device) -> str:
    """The MoE block's kernel a run uses: "auto" is grouped on a GPU and masked on a CPU (measured there: torch's
    CPU grouped GEMM loses to the masked dense products at the presets' layouts; BENCHMARKS.md "Tuning speed"),
    MOEIFY_MOE_KERNEL set to masked or grouped overriding it. Blocks where grouped does not apply compute masked."""
    from ..maths.moe_block import KERNELS

    if kernel == "auto":
        kernel = os.environ.get("MOEIFY_MOE_KERNEL") or ("grouped" if torch.device(device).type == "cuda" else "masked")
    if kernel not in KERNELS:
        raise ValueError(f"moe kernel {kernel!r}: use one of {', '.join(KERNELS)} or auto")
    return kernel


@dataclass(frozen=True)
class Pending:
    """A tensor of a saved state, produced when it is written (moeify.tuning.TuningState writes one at a time, so the
    writer never holds the whole state in host memory): produce() gathers it (a collective across processes: every
    rank calls it, in the same order) and returns it whole on the writing rank, None on the others."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor | None]


def materialize(tensors: dict) -> dict[str, torch.Tensor]:
    """The tensors of a state, Pending ones produced (one process)."""
    return {k: v.produce() if isinstance(v, Pending) else v for k, v in tensors.items()}


class TempKeeper:
    """Where a run that saves no state (a library call without a state directory) keeps its best checked weights: a
    temporary file, on disk rather than in memory."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="moeify-distill-")
        self._file = f"{self._dir.name}/kept.safetensors"

    def keep(self, tensors: dict, step: int) -> None:
        save_file(materialize(tensors), self._file)

    def kept(self) -> dict[str, torch.Tensor]:
        return load_file(self._file)

    def checkpoint(self, step: int, total: int, snapshot) -> None:
        pass

    def close(self) -> None:
        self._dir.cleanup()


def share_frozen(teacher, student, train_attention: bool, lowp: torch.dtype | None = None,
                 own_attention: set[int] = frozenset()) -> int:
    """Make the student use the teacher's own modules for everything tuning leaves frozen (embeddings, output head,
    final norm, and unless train_attention each layer's attention and norms), so the model is not held twice; with
    lowp (bf16 when distill runs under bf16 autocast) also store the teacher's FFN weights in that dtype: autocast
    casts them to it at every call anyway, so the teacher's outputs are bit-identical and its FFNs take half the
    memory. Layers in own_attention keep the student's own attention and norms (an earlier run tuned them). Returns
    the bytes the student no longer holds."""
    def nbytes(m):
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in m.parameters()}.values())

    before = nbytes(student)
    for name, child in list(teacher.model.named_children()):
        if name != "layers":
            setattr(student.model, name, child)
    student.lm_head = teacher.lm_head
    if not train_attention:
        for i, (t_layer, s_layer) in enumerate(zip(teacher.model.layers, student.model.layers)):
            for name, child in list(t_layer.named_children()):
                if name != "mlp" and i not in own_attention:
                    setattr(s_layer, name, child)
    if lowp is not None:  # only the teacher's own FFNs: the shared modules are also run outside autocast
        for layer in teacher.model.layers:
            for m in layer.mlp.modules():
                if isinstance(m, torch.nn.Linear):
                    m.to(lowp)
    shared = {id(p) for p in teacher.parameters()}
    return before - sum(p.numel() * p.element_size() for p in
                        {id(p): p for p in student.parameters() if id(p) not in shared}.values())


def attention_params(model) -> list[torch.nn.Parameter]:
    """Each decoder layer's attention projections and its RMSNorm weights (Qwen3's q/k norms too; biases, where a model has them, stay
    fixed), in layer order: the tensors `train_attention` tunes besides the experts."""
    return [model.get_submodule(f"model.layers.{i}.{name}").weight
            for i in range(len(model.model.layers)) for name in attention_tensors(model.config.model_type)]


__all__ = ["final_hidden", "WindowStream", "eager_forwards", "moe_kernel", "Pending", "materialize", "TempKeeper",
           "share_frozen", "attention_params"]
