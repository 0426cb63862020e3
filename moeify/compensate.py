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
    """act: (n, d_ff) activations, mask: (n, d_ff) bool, down: (d_model, d_ff). Returns (D' (d_model, d_ff), info).

    Solved as a correction of D: with R = Y - Z D^T = ((1 - m) * a) D^T (the output of the dropped neurons),
    the ridge solution above is D'^T = D^T + (Z^T Z + lam I)^-1 Z^T R. With fewer tokens than neurons the
    push-through identity (Z^T Z + lam I)^-1 Z^T = Z^T (Z Z^T + lam I)^-1 solves it in token space (n x n
    instead of d_ff x d_ff). Each strength is a Cholesky solve; its held-back error is ||R_h - Z_h delta||^2.
    The same minimiser as the normal equations, in float64, a fraction of their cost.
    """
    n, d_ff = act.shape
    n_fit = n - max(1, int(holdout * n))
    d_t = down.double().T  # (d_ff, d_model)
    z = (act * mask).double()  # (n, d_ff) kept activations
    r = (act * ~mask).double() @ d_t  # (n, d_model) residual of the dense down_proj under this routing
    y_h = act[n_fit:].double() @ d_t
    base = r[n_fit:].square().sum().item()
    denom = max(y_h.square().sum().item(), 1e-30)

    def chol_solve(g: torch.Tensor, rhs: torch.Tensor, reg: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.diagonal().add_(reg)
        chol, bad = torch.linalg.cholesky_ex(g)
        return torch.linalg.solve(g, rhs) if bad.item() else torch.cholesky_solve(rhs, chol)

    if n <= d_ff:  # token space: K = Z Z^T; delta = Z^T (K + reg I)^-1 R
        k = z @ z.T
        k_ff, k_hf = k[:n_fit, :n_fit], k[n_fit:, :n_fit]
        scale_fit = k_ff.diagonal().sum() / d_ff  # mean diagonal of Z_f^T Z_f
        errors = {}
        for lam in strengths:
            x = chol_solve(k_ff, r[:n_fit], lam * scale_fit.clamp_min(1e-12))
            errors[lam] = (r[n_fit:] - k_hf @ x).square().sum().item()

        def final(lam):
            return z.T @ chol_solve(k, r, lam * (k.diagonal().sum() / d_ff).clamp_min(1e-12))
    else:  # neuron space: G = Z^T Z; delta = (G + reg I)^-1 Z^T R
        z_f, z_h = z[:n_fit], z[n_fit:]
        g_f, g_h = z_f.T @ z_f, z_h.T @ z_h
        b_f, b_h = z_f.T @ r[:n_fit], z_h.T @ r[n_fit:]
        scale_fit = g_f.diagonal().mean()
        errors = {}
        for lam in strengths:
            delta = chol_solve(g_f, b_f, lam * scale_fit.clamp_min(1e-12))
            errors[lam] = (r[n_fit:] - z_h @ delta).square().sum().item()

        def final(lam):
            g = g_f + g_h
            return chol_solve(g, b_f + b_h, lam * g.diagonal().mean().clamp_min(1e-12))
    best = min(strengths, key=lambda lam: (errors[lam], -lam))
    info = {"ridge": best, "holdout_rel_error_before": base / denom, "holdout_rel_error_after": errors[best] / denom}
    if errors[best] >= base:  # no strength helps on held-back tokens: keep the dense down_proj
        info.update(ridge=float("inf"), holdout_rel_error_after=base / denom)
        return down.float().clone(), info
    return (d_t + final(best)).T.float(), info
