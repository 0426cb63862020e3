"""Routing statistics of MoE models, and the MoE layers of a loaded model.

Per layer: each expert's share of tokens (f_i) and mean router probability (P_i), the load-balancing loss, the load's
coefficient of variation, collapsed experts, and (oracle) how often the router's top-k is the top-k by true expert
output norm: pure functions the tests call directly. find_moe_layers finds a loaded model's sparse blocks by structure;
`moeify eval` (moeify.evaluation.perplexity) hooks their routers and feeds the statistics while it scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

COLLAPSE_SHARE = 0.01  # an expert that receives < 1% of tokens counts as collapsed


@dataclass
class LayerRouting:
    layer: int
    n_experts: int
    top_k: int
    tokens: int
    load: list[float]  # f_i: fraction of tokens with expert i among their top-k (sums to top_k)
    mean_prob: list[float]  # P_i: mean router probability of expert i
    aux_loss: float  # N · Σ f_i · P_i (Mixtral's load-balancing loss; top_k when the load is uniform)
    load_cv: float  # std / mean of the per-expert token counts (0 = perfectly balanced)
    collapsed: int  # experts that received < 1% of tokens
    oracle_agreement: float | None  # share of tokens whose top-k set equals the top-k by expert output norm


class RoutingAccumulator:
    """Running per-expert counts and probability sums of one layer, fed in chunks of tokens."""

    def __init__(self, layer: int, n_experts: int, top_k: int):
        self.layer, self.n_experts, self.top_k = layer, n_experts, top_k
        self.counts = torch.zeros(n_experts, dtype=torch.float64)
        self.prob_sum = torch.zeros(n_experts, dtype=torch.float64)
        self.tokens = 0
        self.oracle_hits = 0
        self.oracle_tokens = 0

    def add(self, logits: torch.Tensor, indices: torch.Tensor, oracle_indices: torch.Tensor | None = None) -> None:
        """logits (T, E), indices (T, k) as the router returned them; oracle_indices (T, k) or None."""
        probs = torch.softmax(logits.float(), dim=-1)
        self.prob_sum += probs.sum(0).double().cpu()
        self.counts += torch.bincount(indices.reshape(-1), minlength=self.n_experts).double().cpu()
        self.tokens += logits.shape[0]
        if oracle_indices is not None:
            self.oracle_hits += int(same_topk_sets(indices, oracle_indices).sum())
            self.oracle_tokens += indices.shape[0]

    def result(self) -> LayerRouting:
        n = max(self.tokens, 1)
        f, p = self.counts / n, self.prob_sum / n
        mean = self.counts.mean()
        cv = float(self.counts.std(unbiased=False) / mean) if mean > 0 else 0.0
        return LayerRouting(
            layer=self.layer, n_experts=self.n_experts, top_k=self.top_k, tokens=self.tokens,
            load=f.tolist(), mean_prob=p.tolist(), aux_loss=float(self.n_experts * (f * p).sum()), load_cv=cv,
            collapsed=int((f < COLLAPSE_SHARE).sum()),
            oracle_agreement=self.oracle_hits / self.oracle_tokens if self.oracle_tokens else None,
        )


def routing_stats(logits: torch.Tensor, indices: torch.Tensor, n_experts: int | None = None, layer: int = 0,
                  oracle_indices: torch.Tensor | None = None) -> LayerRouting:
    """Routing statistics of one layer from router logits (T, E) and the chosen experts (T, k)."""
    acc = RoutingAccumulator(layer, n_experts or logits.shape[-1], indices.shape[-1])
    acc.add(logits, indices, oracle_indices)
    return acc.result()


def same_topk_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T,) bool: row t of a and b (T, k) hold the same set of experts."""
    return (a.sort(-1).values == b.to(a.device).sort(-1).values).all(-1)


def expert_output_norms(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn,
                        chunk: int = 4096) -> torch.Tensor:
    """(T, E) float32: L2 norm of every expert's down_proj output (before its gate weight) on every token.

    hidden (T, H); gate_up_proj (E, 2I, H) with gate rows first; down_proj (E, H, I) — the transformers 5 layout.
    """
    out = torch.empty(hidden.shape[0], gate_up_proj.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk]
        for e in range(gate_up_proj.shape[0]):
            gate, up = F.linear(h, gate_up_proj[e]).chunk(2, dim=-1)
            out[start:start + chunk, e] = F.linear(act_fn(gate) * up, down_proj[e]).float().norm(dim=-1)
    return out


def oracle_topk(hidden, gate_up_proj, down_proj, act_fn, top_k: int) -> torch.Tensor:
    """(T, k): the experts with the largest true output norms on each token."""
    return expert_output_norms(hidden, gate_up_proj, down_proj, act_fn).topk(top_k, dim=-1).indices


# ------------------------------------------------------------------------------- the MoE layers of a model


@dataclass
class MoeLayer:
    layer_idx: int
    router: torch.nn.Module  # returns (router_logits, router_scores, router_indices)
    experts: torch.nn.Module  # gate_up_proj (E, 2I, H), down_proj (E, H, I)
    n_experts: int
    top_k: int

    @property
    def oracle_applies(self) -> bool:  # every expert active: nothing to choose; other layouts: not implemented
        return (self.top_k < self.n_experts and not getattr(self.experts, "is_transposed", False)
                and not getattr(self.experts, "has_bias", False) and hasattr(self.experts, "act_fn"))


def find_moe_layers(model) -> list[MoeLayer]:
    """Sparse blocks by structure (Mixtral, Qwen2-MoE, ...): a `gate` router with top_k next to fused `experts`.

    Dense layers (Llama MLPs, Qwen2-MoE `mlp_only_layers`) have gate_proj, not gate, and are skipped.
    """
    found = []
    for i, layer in enumerate(model.get_decoder().layers):
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        if (isinstance(router, torch.nn.Module) and hasattr(router, "top_k") and experts is not None
                and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
            found.append(MoeLayer(i, router, experts, int(experts.gate_up_proj.shape[0]), int(router.top_k)))
    return found


def count_params(model, moe_layers: list[MoeLayer]) -> tuple[int, int]:
    """(total, activated per token): every non-expert weight is active, plus top_k of each layer's experts."""
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    idle = sum((m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()) * (m.n_experts - m.top_k) // m.n_experts
               for m in moe_layers)
    return total, total - idle
