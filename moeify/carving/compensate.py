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

from ..maths.numerics import chol_solve
from ..maths.partition import Partition


def routing_mask(scores: torch.Tensor, part: Partition, k: int) -> torch.Tensor:
    """(n, d_ff) bool: which neurons each token uses (shared + the neurons of its top-k experts)."""
    n = scores.shape[0]
    labels = part.labels().to(scores.device)  # -1 for shared
    chosen = torch.zeros(n, part.n_experts + 1, dtype=torch.bool, device=scores.device)
    chosen[:, -1] = True  # index -1 (shared) is always on
    chosen.scatter_(1, scores.topk(k, dim=1).indices, True)
    return chosen[:, labels]


def routed_output(act: torch.Tensor, scores: torch.Tensor, part: Partition, k: int, down: torch.Tensor) -> torch.Tensor:
    """(act * routing_mask(scores, part, k)) @ down.T: the carved FFN's output. One dense masked product: for the
    narrow experts of a fine-grained carve it beats gathering each expert's active blocks (k/N of the flops, but
    a gather and a scatter per expert)."""
    return (act * routing_mask(scores, part, k)) @ down.T


class _Masked:
    """Z = act * mask in float64, stored by column groups: the columns with one mask pattern (an expert's neurons,
    or the shared ones) are active on the same tokens, so Z is block sparse; products touch only the active
    blocks (top-k of N experts: a (k/N)^2 share of the dense Gram cost). Falls back to the dense Z when the mask
    has no such structure."""

    MAX_GROUPS = 512

    def __init__(self, act: torch.Tensor, mask: torch.Tensor):
        self.n, self.d_ff = act.shape
        self.groups = self._groups(mask)
        if self.groups is None:
            self.z = (act * mask).double()
        else:  # (token rows, neuron cols, A[rows][:, cols]) per group
            self.groups = [(rows, cols, act[rows][:, cols].double()) for rows, cols in self.groups]

    def _groups(self, mask: torch.Tensor):
        gen = torch.Generator(device="cpu").manual_seed(0)
        key = mask.T.double() @ torch.rand(self.n, generator=gen, dtype=torch.float64).to(mask.device)  # (d_ff,)
        uniq, inverse = torch.unique(key, return_inverse=True)
        if uniq.numel() > self.MAX_GROUPS:
            return None
        groups = []
        for g in range(uniq.numel()):
            cols = (inverse == g).nonzero().flatten()
            if not torch.equal(mask[:, cols], mask[:, cols[:1]].expand(-1, cols.numel())):
                return None  # a hash collision (or an unstructured mask): use the dense form
            rows = mask[:, cols[0]].nonzero().flatten()
            if rows.numel():
                groups.append((rows, cols))
        dense_cost = self.n * self.n * self.d_ff
        if sum(r.numel() ** 2 * c.numel() for r, c in groups) * 2 > dense_cost:
            return None
        return groups

    def matmul(self, b: torch.Tensor) -> torch.Tensor:
        """Z @ b, b: (d_ff, m) -> (n, m)."""
        if self.groups is None:
            return self.z @ b
        out = torch.zeros(self.n, b.shape[1], dtype=torch.float64, device=b.device)
        for rows, cols, a in self.groups:
            out.index_add_(0, rows, a @ b[cols])
        return out

    def t_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Z^T @ x, x: (n, m) -> (d_ff, m)."""
        if self.groups is None:
            return self.z.T @ x
        out = torch.zeros(self.d_ff, x.shape[1], dtype=torch.float64, device=x.device)
        for r, cols, a in self.groups:
            out[cols] = a.T @ x[r]
        return out

    def token_gram(self) -> torch.Tensor:
        """Z Z^T (n, n)."""
        if self.groups is None:
            return self.z @ self.z.T
        k = torch.zeros(self.n, self.n, dtype=torch.float64, device=self.groups[0][2].device)
        for rows, _, a in self.groups:
            k[rows.unsqueeze(1), rows.unsqueeze(0)] += a @ a.T  # rows are distinct: no repeated index
        return k


def refit_down(act: torch.Tensor, mask: torch.Tensor, down: torch.Tensor, holdout: float = 0.1,
               strengths: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0),
               dense_out: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """act: (n, d_ff) activations, mask: (n, d_ff) bool, down: (d_model, d_ff). Returns (D' (d_model, d_ff), info).
    `dense_out`: act @ down.T when the caller has it (float32: saves a float64 product; the refit then agrees
    with the float64 one to ~1e-6 relative, the sensitivity of the solution to float32 activations anyway).

    Solved as a correction of D: with R = Y - Z D^T (the output of the dropped neurons), the ridge solution
    above is D'^T = D^T + (Z^T Z + lam I)^-1 Z^T R. With fewer tokens than neurons the push-through identity
    (Z^T Z + lam I)^-1 Z^T = Z^T (Z Z^T + lam I)^-1 solves it in token space (n x n instead of d_ff x d_ff),
    and the held-back prediction Z_h delta = K_hf (K_ff + lam I)^-1 R_f = ((K_ff + lam I)^-1 K_fh)^T R_f needs
    only as many right-hand sides as held-back tokens; there Z is block sparse (an expert's neurons are active on
    the same tokens) and the token Gram matrix is built from its active blocks. In neuron space (more tokens than
    neurons) the Gram matrices are dense float32 products of Z (BLAS, relative error ~1e-6, far below the ridge
    of >= 1e-4 of the mean diagonal). Cholesky solves in float64: the same minimiser as the normal equations.
    """
    n, d_ff = act.shape
    n_fit = n - max(1, int(holdout * n))
    fit, hold = slice(0, n_fit), slice(n_fit, n)
    d_t = down.double().T  # (d_ff, d_model)
    y = act.double() @ d_t if dense_out is None else dense_out.double()  # (n, d_model) dense output
    denom = max(y[hold].square().sum().item(), 1e-30)
    errors = {}
    if n <= d_ff:  # token space: K = Z Z^T; delta = Z^T (K + reg I)^-1 R
        z = _Masked(act, mask)
        r = y - z.matmul(d_t)  # (n, d_model) residual of the dense down_proj under this routing
        base = r[hold].square().sum().item()
        del y
        k = z.token_gram()
        k_ff, k_fh = k[fit, fit], k[fit, hold]
        scale_fit = k_ff.diagonal().sum() / d_ff  # mean diagonal of Z_f^T Z_f
        for lam in strengths:
            pred = chol_solve(k_ff, k_fh, lam * scale_fit.clamp_min(1e-12)).T @ r[fit]
            errors[lam] = (r[hold] - pred).square().sum().item()

        def final(lam):
            return z.t_matmul(chol_solve(k, r, lam * (k.diagonal().sum() / d_ff).clamp_min(1e-12)))
    else:  # neuron space: G = Z^T Z; delta = (G + reg I)^-1 Z^T R, Gram matrices as float32 products
        z = act * mask  # (n, d_ff) float32: dense BLAS products beat gathering many small expert blocks
        r = y - (z @ down.float().T).double()
        base = r[hold].square().sum().item()
        del y
        r32 = r.float()
        g_f, g_h = (z[fit].T @ z[fit]).double(), (z[hold].T @ z[hold]).double()
        b_f, b_h = (z[fit].T @ r32[fit]).double(), (z[hold].T @ r32[hold]).double()
        z_h = z[hold].double()
        scale_fit = g_f.diagonal().mean()
        for lam in strengths:
            delta = chol_solve(g_f, b_f, lam * scale_fit.clamp_min(1e-12))
            errors[lam] = (r[hold] - z_h @ delta).square().sum().item()

        def final(lam):
            g = g_f + g_h
            return chol_solve(g, b_f + b_h, lam * g.diagonal().mean().clamp_min(1e-12))
    best = min(strengths, key=lambda lam: (errors[lam], -lam))
    info = {"ridge": best, "holdout_rel_error_before": base / denom, "holdout_rel_error_after": errors[best] / denom}
    if errors[best] >= base:  # no strength helps on held-back tokens: keep the dense down_proj
        info.update(ridge=float("inf"), holdout_rel_error_after=base / denom)
        return down.float().clone(), info
    return (d_t + final(best)).T.float(), info
