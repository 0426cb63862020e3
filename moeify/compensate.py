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


def routed_output(act: torch.Tensor, scores: torch.Tensor, part: Partition, k: int, down: torch.Tensor) -> torch.Tensor:
    """(act * routing_mask(scores, part, k)) @ down.T, computed from the active blocks only: the shared neurons on
    every token, each expert's neurons on the tokens that chose it (top-k of N experts: ~k/N of the dense cost)."""
    out = torch.zeros(act.shape[0], down.shape[0], dtype=act.dtype, device=act.device)
    if part.n_shared:
        idx = part.shared_neurons.to(act.device)
        out += act[:, idx] @ down[:, idx].T
    chosen = scores.topk(k, dim=1).indices
    for e in range(part.n_experts):
        rows = (chosen == e).any(dim=1).nonzero().flatten()
        if rows.numel():
            idx = part.expert_neurons(e).to(act.device)
            out.index_add_(0, rows, act[rows][:, idx] @ down[:, idx].T)
    return out


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

    def t_matmul(self, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """Z[rows]^T @ x, x: (len(rows), m) -> (d_ff, m)."""
        if self.groups is None:
            return self.z[rows].T @ x
        lo = rows.start or 0
        out = torch.zeros(self.d_ff, x.shape[1], dtype=torch.float64, device=x.device)
        for r, cols, a in self.groups:
            keep = (r >= lo) & (r < (self.n if rows.stop is None else rows.stop))
            out[cols] = a[keep].T @ x[r[keep] - lo]
        return out

    def token_gram(self) -> torch.Tensor:
        """Z Z^T (n, n)."""
        if self.groups is None:
            return self.z @ self.z.T
        k = torch.zeros(self.n, self.n, dtype=torch.float64, device=self.groups[0][2].device)
        for rows, _, a in self.groups:
            k[rows.unsqueeze(1), rows.unsqueeze(0)] += a @ a.T  # rows are distinct: no repeated index
        return k

    def neuron_gram(self, rows: slice) -> torch.Tensor:
        """Z[rows]^T Z[rows] (d_ff, d_ff)."""
        if self.groups is None:
            z = self.z[rows]
            return z.T @ z
        lo, hi = rows.start or 0, self.n if rows.stop is None else rows.stop
        device = self.groups[0][2].device
        active = torch.zeros(len(self.groups), self.n, dtype=torch.bool, device=device)
        for g, (r, _, _) in enumerate(self.groups):
            active[g, r] = True
        active[:, :lo] = False
        active[:, hi:] = False
        pos = [torch.full((self.n,), -1, dtype=torch.long, device=device) for _ in self.groups]
        for g, (r, _, _) in enumerate(self.groups):
            pos[g][r] = torch.arange(r.numel(), device=device)
        out = torch.zeros(self.d_ff, self.d_ff, dtype=torch.float64, device=device)
        for g, (_, cols_g, a_g) in enumerate(self.groups):
            for h in range(g, len(self.groups)):
                both = (active[g] & active[h]).nonzero().flatten()
                if both.numel() == 0:
                    continue
                cols_h, a_h = self.groups[h][1], self.groups[h][2]
                block = a_g[pos[g][both]].T @ a_h[pos[h][both]]
                out[cols_g.unsqueeze(1), cols_h.unsqueeze(0)] = block
                if h != g:
                    out[cols_h.unsqueeze(1), cols_g.unsqueeze(0)] = block.T
        return out


def chol_solve(g: torch.Tensor, rhs: torch.Tensor, reg: torch.Tensor) -> torch.Tensor:
    """(g + reg I)^-1 rhs for symmetric positive semi-definite g (Cholesky; LU if it fails numerically)."""
    g = g.clone()
    g.diagonal().add_(reg)
    chol, bad = torch.linalg.cholesky_ex(g)
    return torch.linalg.solve(g, rhs) if bad.item() else torch.cholesky_solve(rhs, chol)


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
    only as many right-hand sides as held-back tokens. Z is block sparse (an expert's neurons are active on the
    same tokens), and the Gram matrices are built from its active blocks. Cholesky solves in float64: the same
    minimiser as the normal equations, at a fraction of their cost.
    """
    n, d_ff = act.shape
    n_fit = n - max(1, int(holdout * n))
    fit, hold = slice(0, n_fit), slice(n_fit, n)
    d_t = down.double().T  # (d_ff, d_model)
    z = _Masked(act, mask)
    y = act.double() @ d_t if dense_out is None else dense_out.double()  # (n, d_model) dense output
    r = y - z.matmul(d_t)  # (n, d_model) residual of the dense down_proj under this routing
    base = r[hold].square().sum().item()
    denom = max(y[hold].square().sum().item(), 1e-30)
    del y
    errors = {}
    if n <= d_ff:  # token space: K = Z Z^T; delta = Z^T (K + reg I)^-1 R
        k = z.token_gram()
        k_ff, k_fh = k[fit, fit], k[fit, hold]
        scale_fit = k_ff.diagonal().sum() / d_ff  # mean diagonal of Z_f^T Z_f
        for lam in strengths:
            pred = chol_solve(k_ff, k_fh, lam * scale_fit.clamp_min(1e-12)).T @ r[fit]
            errors[lam] = (r[hold] - pred).square().sum().item()

        def final(lam):
            return z.t_matmul(chol_solve(k, r, lam * (k.diagonal().sum() / d_ff).clamp_min(1e-12)))
    else:  # neuron space: G = Z^T Z; delta = (G + reg I)^-1 Z^T R
        g_f, b_f = z.neuron_gram(fit), z.t_matmul(r[fit], fit)
        scale_fit = g_f.diagonal().mean()
        hold_z = _Masked(act[hold], mask[hold])
        for lam in strengths:
            delta = chol_solve(g_f, b_f, lam * scale_fit.clamp_min(1e-12))
            errors[lam] = (r[hold] - hold_z.matmul(delta)).square().sum().item()

        def final(lam):
            g = g_f + z.neuron_gram(hold)
            return chol_solve(g, b_f + z.t_matmul(r[hold], hold), lam * g.diagonal().mean().clamp_min(1e-12))
    best = min(strengths, key=lambda lam: (errors[lam], -lam))
    info = {"ridge": best, "holdout_rel_error_before": base / denom, "holdout_rel_error_after": errors[best] / denom}
    if errors[best] >= base:  # no strength helps on held-back tokens: keep the dense down_proj
        info.update(ridge=float("inf"), holdout_rel_error_after=base / denom)
        return down.float().clone(), info
    return (d_t + final(best)).T.float(), info
