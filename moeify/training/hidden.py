"""The tuning objective's optional second term: each decoder layer's output matched to the dense teacher's
(DistillSettings.hidden_weight; `moeify tune --hidden-weight`). Forward hooks record both models' layer outputs (the
residual stream after each layer) while a micro-batch goes through them, and layer_match turns them into one
scale-free number: per layer, each token's squared error relative to the teacher's squared norm at that token,
averaged over tokens and then over layers (0 when every layer reproduces the teacher's residual stream; 1 for a
student whose layers output zeros). The logit KL alone lets the layers drift anywhere that keeps the last layer's
distribution; this term keeps every layer's output near the one the rest of the dense model was trained on.
"""

from __future__ import annotations

import torch

EPS = 1e-12  # a token whose teacher state is all zeros (never, in a trained model) divides by this, not by 0


class LayerOutputs:
    """With-block: `outputs`, the outputs of model.model.layers in layer order, as the block's forward computes them
    (the tensors themselves: the student's keep their autograd graph). The hooks are removed when the block ends."""

    def __init__(self, model):
        self.layers = list(model.model.layers)
        self.outputs: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> LayerOutputs:
        self.outputs = []
        self._handles = [layer.register_forward_hook(self._keep) for layer in self.layers]
        return self

    def _keep(self, module, args, out) -> None:
        self.outputs.append(out[0] if isinstance(out, tuple) else out)

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def layer_match(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """The mean over layers of each layer's mean over tokens of |h_s - h_t|² / |h_t|² (float32; a 0-dim tensor with
    the students' gradient). student, teacher: each layer's (batch, seq, d) outputs, in the same order."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"layer outputs of {len(student)} student and {len(teacher)} teacher layers: one forward each")
    total = None
    for s, t in zip(student, teacher):
        t = t.detach().float()
        err = ((s.float() - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(EPS)).mean()
        total = err if total is None else total + err
    return total / len(student)


__all__ = ["LayerOutputs", "layer_match"]
