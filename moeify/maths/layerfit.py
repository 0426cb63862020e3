"""Layer-local fitting of a carved FFN (`--fit-epochs`; "tuning" in moeify means the whole-model recovery tuning of
moeify/tuning/): gradient steps on its experts' weights towards a target output.

Layer-local distillation: the carved layer (its neurons' gate_proj / up_proj / down_proj, in source neuron order,
with the routing fixed by its router) is fitted to the output the dense model wants from it on cached calibration
inputs: the dense FFN's output, or (calib_feed = "corrected") whatever restores the dense model's residual stream.
Data in, tensors out; no I/O and nothing about checkpoints.

Why these choices:
- The routing (which neurons each token uses) is held fixed at the router's choice, so the tuned experts are
  trained for exactly the routing the exported model computes; the router and the routing semantics are unchanged.
- The objective is the relative squared error ||out - target||^2 / ||target||^2, a scale-free loss, and the step
  size of every tensor is proportional to its own RMS (Adam's updates have the size of the learning rate, so a
  relative learning rate means the same thing for every tensor and every model).
- The last `holdout` share of the tokens is never trained on; the weights of the epoch with the best held-out
  loss are kept (the carved weights if no epoch beats them), so tuning never makes the layer worse on held-out
  tokens.
- Deterministic under a seed (the minibatch order is the only randomness).
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FitSettings:
    epochs: int = 2  # passes over the training tokens
    lr: float = 0.01  # Adam step size relative to each tensor's RMS
    batch_tokens: int = 1024
    holdout: float = 0.1
    seed: int = 0


def masked_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """(act(x gate^T) * (x up^T) * mask) down^T: the carved FFN with the neurons each token does not use dropped."""
    return ((F.silu(x @ gate.T) * (x @ up.T)) * mask) @ down.T


def _rel_error(x, target, gate, up, down, mask, batch: int = 8192) -> float:
    err, norm = 0.0, 0.0
    for s in range(0, x.shape[0], batch):
        out = masked_ffn(x[s:s + batch], gate, up, down, mask[s:s + batch])
        err += (out - target[s:s + batch]).square().sum().item()
        norm += target[s:s + batch].square().sum().item()
    return err / max(norm, 1e-30)


def fit_layer(x: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor, settings: FitSettings = FitSettings(),
               tensors: tuple[str, ...] = ("gate", "up", "down")) -> tuple[dict[str, torch.Tensor], dict]:
    """Fit the carved FFN to `target` on its cached inputs.

    x: (n, d_model) FFN inputs, target: (n, d_model), mask: (n, d_ff) bool (the routing), gate/up: (d_ff, d_model),
    down: (d_model, d_ff), all on one device. `tensors`: which of gate/up/down are trained.
    Returns ({name: tuned tensor} for the names in `tensors`, float32, info) where info has the held-out relative
    error before and after, the epoch kept (0 = the carved weights) and the number of optimizer steps.
    """
    n = x.shape[0]
    n_fit = n - max(1, int(settings.holdout * n))
    x, target = x.float(), target.float()
    maskf = mask.to(x.dtype)
    params = {"gate": gate, "up": up, "down": down}
    trained = {k: torch.nn.Parameter(params[k].detach().float().clone()) for k in tensors}
    weights = {k: trained.get(k, params[k].float()) for k in params}
    hold = slice(n_fit, n)

    def held_out() -> float:
        with torch.no_grad():
            return _rel_error(x[hold], target[hold], weights["gate"], weights["up"], weights["down"], maskf[hold])

    before = best = held_out()
    best_state, best_epoch = {k: p.detach().clone() for k, p in trained.items()}, 0
    groups = [{"params": [p], "lr": settings.lr * p.detach().pow(2).mean().sqrt().item()} for p in trained.values()]
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
    steps_per_epoch = max(1, n_fit // settings.batch_tokens)
    total = steps_per_epoch * settings.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    gen = torch.Generator().manual_seed(settings.seed)
    # Normalise by the target's mean square over the training tokens (one constant: the loss is the relative error)
    scale = 1.0 / target[:n_fit].square().sum(1).mean().clamp_min(1e-30)
    steps = 0
    with torch.enable_grad():  # callers run under no_grad
        for epoch in range(1, settings.epochs + 1):
            steps += _epoch(x, target, maskf, weights, opt, sched, gen, n_fit, settings.batch_tokens, scale)
            err = held_out()
            if err < best:
                best, best_epoch = err, epoch
                best_state = {k: p.detach().clone() for k, p in trained.items()}
    info = {"holdout_rel_error_before": before, "holdout_rel_error_after": best, "epoch_kept": best_epoch,
            "steps": steps, "tokens": n_fit, "tensors": list(tensors)}
    return best_state, info


def _epoch(x, target, maskf, weights, opt, sched, gen, n_fit: int, batch: int, scale) -> int:
    """One pass over the training tokens in a seeded random order. Returns the number of steps."""
    order = torch.randperm(n_fit, generator=gen).to(x.device)
    steps = max(1, n_fit // batch)
    for s in range(steps):
        idx = order[s * batch:(s + 1) * batch]
        out = masked_ffn(x[idx], weights["gate"], weights["up"], weights["down"], maskf[idx])
        loss = (out - target[idx]).square().sum(1).mean() * scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return steps
