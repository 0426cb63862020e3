"""Pure maths: router rows from gate_proj rows, and the unit-gate router scale.

Unit gates: training-free carving wants every selected expert to add its full output, but Mixtral
(and Qwen2-MoE with norm_topk_prob) weight the top-k experts by renormalised softmax probabilities.
Scaling the router by a tiny positive factor `alpha` keeps the top-k order and makes the selected
weights w_i = exp(alpha*s_i) / sum_j exp(alpha*s_j) all close to 1/k; each expert's down_proj is
multiplied by k. If every logit lies within a spread D of the others, w_i * k lies in
[exp(-alpha*D), exp(alpha*D)], so the relative error of every gate is at most exp(alpha*D) - 1.

The logit spread is bounded without data: the router input is RMSNorm output x = g * u with
||u|| = sqrt(d_model), so |s_e| = |r_e . x| <= ||r_e * g|| * sqrt(d_model), and D <= 2 max_e ||r_e * g|| sqrt(d).
alpha = tol / that bound guarantees a relative gate error <= exp(tol) - 1 ~ tol for every input.
"""

from __future__ import annotations

import math

import torch

from .numerics import chol_solve
from .partition import Partition


def group_centers(x: torch.Tensor, part: Partition) -> torch.Tensor:
    """(n_experts, d) mean of the L2-normalised rows of x over each expert's neurons."""
    xn = torch.nn.functional.normalize(x.float(), dim=1)
    return torch.stack([xn[part.expert_neurons(e)].mean(0) for e in range(part.n_experts)])


def mean_gate_router(gate: torch.Tensor, part: Partition) -> torch.Tensor:
    """EMoE: router row of expert e = mean of its neurons' gate_proj rows. (n_experts, d_model) float32."""
    return torch.stack([gate[part.expert_neurons(e)].float().mean(0) for e in range(part.n_experts)])


def representative_router(gate: torch.Tensor, part: Partition) -> torch.Tensor:
    """CMoE: router row of expert e = gate_proj row of the member nearest (cosine) the cluster centre."""
    rows = []
    for e in range(part.n_experts):  # per expert: small temporaries, the same numbers as group_centers(gate, part)
        members = part.expert_neurons(e)
        gn = torch.nn.functional.normalize(gate[members].float(), dim=1)
        best = members[(gn @ gn.mean(0)).argmax()]
        rows.append(gate[best].float())
    return torch.stack(rows)


def build_router(kind: str, gate: torch.Tensor, part: Partition) -> torch.Tensor:
    if kind == "mean-gate":
        return mean_gate_router(gate, part)
    if kind == "representative":
        return representative_router(gate, part)
    raise ValueError(f"unknown router {kind!r}")


def unit_gate_scale(router: torch.Tensor, norm_weight: torch.Tensor, tolerance: float) -> float:
    """alpha such that every selected gate is within a relative exp(tolerance)-1 of 1/k, for any input."""
    d_model = router.shape[1]
    bound = 2.0 * (router.float() * norm_weight.float()).norm(dim=1).max().item() * math.sqrt(d_model)
    return tolerance / bound if bound > 0 else 1.0


def observed_gate_scale(scores: torch.Tensor, tolerance: float) -> float:
    """alpha from the logit spread the router shows on real tokens: scores (n_tokens, E) = x @ router.T on the
    calibration inputs. The bound of unit_gate_scale holds for any input, but real inputs use a small part of it (on
    SmolLM2 1/10 to 1/130 of it), and logits that small tie: a probability near 1/E is resolved to ~1e-7 relative in
    float32, and engines that rank experts by softmax probabilities (transformers, llama.cpp) then break ties by
    index while those that rank by logits (vLLM's CPU router, moeify's tuning) do not, so they pick other experts.
    Scaling the largest spread seen to the tolerance keeps every gate of the calibration tokens within it and moves
    the logit gaps ~100x above float32's resolution; a token with a wider spread than any calibration token has a
    proportionally larger gate error (tuning trains with the exported gates, so a tuned output carries no error)."""
    spread = (scores.max(1).values - scores.min(1).values).max().item() if scores.numel() else 0.0
    return tolerance / spread if spread > 0 else 1.0


def routing_ties(logits: torch.Tensor, k: int) -> float:
    """Share of tokens whose top-k experts by float32 softmax probability (transformers, llama.cpp) differ from
    their top-k by logit (vLLM's CPU router, moeify's tuning): ties in the probabilities, broken by index."""
    lg = logits.float()
    if k >= lg.shape[1] or not lg.shape[0]:
        return 0.0
    by_logit = torch.zeros_like(lg, dtype=torch.bool).scatter_(1, lg.topk(k, 1).indices, True)
    by_prob = torch.zeros_like(lg, dtype=torch.bool).scatter_(1, lg.softmax(-1).topk(k, 1).indices, True)
    return (by_logit != by_prob).any(1).float().mean().item()


SHARED_GATE_MIN = 2.0 ** -24  # the smallest float16 subnormal: the gate survives a float16 cast (ours or a GGUF's)


def shared_gate_value(norm_weight: torch.Tensor, tolerance: float) -> float:
    """c for Qwen2-MoE's shared_expert_gate row (c, ..., c), so that sigmoid(gate(x)) is within exp(±tolerance) of 1/2.

    The gate's input is RMSNorm output x = n * g with ||n|| = sqrt(d), so |c * sum(x)| <= c * ||g|| * sqrt(d) = m and
    sigmoid(z) / (1/2) = 2 / (1 + exp(-z)) lies in [exp(-m/2), exp(m/2)]: m = 2 * tolerance suffices. A zero gate
    (exactly 1/2) is not used because llama.cpp computes the sigmoid as silu(z)/z, which is NaN at z = 0. c is a power
    of two (exact in every float dtype) and at least SHARED_GATE_MIN (where that floor applies, the bound is
    m = SHARED_GATE_MIN * ||g|| * sqrt(d) instead)."""
    bound = norm_weight.float().norm().item() * math.sqrt(norm_weight.numel())
    if bound <= 0:
        return SHARED_GATE_MIN
    return 2.0 ** max(math.log2(SHARED_GATE_MIN), math.floor(math.log2(2.0 * tolerance / bound)))


def expert_output_norms(act: torch.Tensor, down: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's output norm on every token, and the dense FFN output act @ down.T.
    Returns ((n_tokens, n_experts) L2 norms of the expert outputs (its neurons' down_proj contribution), (n_tokens,
    d_model) the dense output). ||D_e a_e||^2 = a_e^T (D_e^T D_e) a_e with a (width x width) Gram matrix per expert:
    n * width * d_ff flops in all, a width/d_model share of computing every expert's output."""
    act_p = act[:, part.perm]  # (n, d_ff) experts' neurons contiguous (shared first)
    down_p = down[:, part.perm]
    w, s, n_e = part.expert_width, part.n_shared, part.n_experts
    a = act_p[:, s:].reshape(-1, n_e, w).transpose(0, 1)  # (E, n, w)
    d = down_p[:, s:].reshape(-1, n_e, w).transpose(0, 1)  # (E, d_model, w)
    norms = (torch.bmm(a, d.transpose(1, 2) @ d) * a).sum(-1).clamp_min(0).sqrt().T  # (n, E)
    return norms, act_p @ down_p.T


def topk_agreement(scores: torch.Tensor, oracle: torch.Tensor, k: int) -> float:
    """Mean share of each token's top-k (by scores) that is in its top-k by the oracle (true output norms)."""
    if k >= scores.shape[1]:
        return 1.0
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    best = torch.zeros_like(oracle, dtype=torch.bool).scatter_(1, oracle.topk(k, dim=1).indices, True)
    return (picked & best).sum().item() / (k * scores.shape[0])


def fit_router(x: torch.Tensor, norms: torch.Tensor, k: int, holdout: float = 0.1,
               strengths: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)) -> tuple[torch.Tensor, dict]:
    """Ridge least-squares router that ranks experts by their true output norm.

    x: (n, d_model) router inputs, norms: (n, n_experts) true expert output norms. The target is each token's
    norms relative to its mean norm, centred per token (a per-token offset does not change the ranking, so it
    need not be modelled). The ridge strength (times mean diag of X^T X) is chosen by top-k agreement with
    the oracle on the last `holdout` share of tokens; the final fit uses all tokens. Returns ((E, d), info).
    """
    # Gram matrices in float32 (a product of float32 activations; accumulated in float32 by the BLAS, relative
    # error ~1e-6 with ridge >= 1e-4 of the mean diagonal), solved in float64
    target = norms.double() / norms.double().mean(1, keepdim=True).clamp_min(1e-12)
    target = target - target.mean(1, keepdim=True)
    n_fit = x.shape[0] - max(1, int(holdout * x.shape[0]))

    def solve(g, b, lam):
        return chol_solve(g, b, lam * g.diagonal().mean()).T  # (E, d)

    # Gram matrices once (not once per strength): fit rows, held-back rows, and their sum for the final fit
    x = x.float()
    x_f, x_h = x[:n_fit], x[n_fit:]
    g_f, b_f = (x_f.T @ x_f).double(), x_f.double().T @ target[:n_fit]
    scores = {}
    for lam in strengths:
        w = solve(g_f, b_f, lam)
        scores[lam] = topk_agreement(x_h.double() @ w.T, norms[n_fit:], k)
    best = max(strengths, key=lambda lam: (scores[lam], lam))
    g, b = g_f + (x_h.T @ x_h).double(), b_f + x_h.double().T @ target[n_fit:]
    return solve(g, b, best).float(), {"ridge": best, "holdout_agreement": scores[best]}
