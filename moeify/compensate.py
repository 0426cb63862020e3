"""Training-free compensation: refit down-projections so a carved FFN matches the dense FFN under its routing.

With routing fixed (shared neurons + the neurons of each token's top-k experts active, the rest dropped),
the carved output is D' (m * a) where a is the intermediate activation and m the mask. We choose D' by
ridge least squares towards the dense output y = D a, shrinking towards the dense D:

    D'^T = (Z^T Z + lam I)^-1 (Z^T Y + lam D^T),  Z = m * a.

With every expert active Z = A and the solution is D itself (exactness is preserved). The strength lam
(times the mean diagonal of Z^T Z) is chosen on held-back calibration tokens.
"""

from __future__ import annotations

import torch

from .partition import Partition


def routing_mask(scores: torch.Tensor, part: Partition, k: int) -> torch.Tensor:
    """(n, d_ff) bool: which neurons each token uses (shared + the neurons of its top-k experts)."""
    n = scores.shape[0]
    labels = part.labels().to(scores.device)  # -1 for shared
    chosen = torch.zeros(n, part.n_experts + 1, dtype=torch.bool, device=scores.device)
    chosen[:, -1] = True  # index -1 (shared) is always on
    chosen.scatter_(1, scores.topk(k, dim=1).indices, True)
    return chosen[:, labels]


def _sq_error(ztz, zty, yty, d_t):
    """sum ||Y - Z D'^T||^2 from Gram matrices; d_t = D'^T (d_ff, d_model)."""
    return (yty - 2 * (d_t * zty).sum() + (d_t * (ztz @ d_t)).sum()).item()


def refit_down(act: torch.Tensor, mask: torch.Tensor, down: torch.Tensor, holdout: float = 0.1,
               strengths: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)) -> tuple[torch.Tensor, dict]:
    """act: (n, d_ff) activations, mask: (n, d_ff) bool, down: (d_model, d_ff). Returns (D' (d_model, d_ff), info)."""
    n = act.shape[0]
    n_fit = n - max(1, int(holdout * n))
    d_t = down.double().T  # (d_ff, d_model)
    grams = []
    for rows in (slice(0, n_fit), slice(n_fit, n)):
        a = act[rows].double()
        z = a * mask[rows]
        y = a @ d_t
        grams.append((z.T @ z, z.T @ y, (y * y).sum()))
    (ztz_f, zty_f, _), (ztz_h, zty_h, yty_h) = grams

    def solve(ztz, zty, lam):
        g = ztz.clone()
        reg = lam * g.diagonal().mean().clamp_min(1e-12)
        g.diagonal().add_(reg)
        return torch.linalg.solve(g, zty + reg * d_t)

    errors = {lam: _sq_error(ztz_h, zty_h, yty_h, solve(ztz_f, zty_f, lam)) for lam in strengths}
    best = min(strengths, key=lambda lam: (errors[lam], -lam))
    base = _sq_error(ztz_h, zty_h, yty_h, d_t)
    denom = max(yty_h.item(), 1e-30)
    info = {"ridge": best, "holdout_rel_error_before": base / denom, "holdout_rel_error_after": errors[best] / denom}
    if errors[best] >= base:  # no strength helps on held-back tokens: keep the dense down_proj
        info.update(ridge=float("inf"), holdout_rel_error_after=base / denom)
        return down.float().clone(), info
    return solve(ztz_f + ztz_h, zty_f + zty_h, best).T.float(), info
