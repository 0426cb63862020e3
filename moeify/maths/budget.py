"""Parameter and FLOP accounting for a carved model (pure arithmetic, shared by convert --dry-run and plan)."""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_ALIGN = 8  # transformers' grouped_mm experts kernel needs 16-byte rows: 8 bf16/fp16 (4 fp32) elements


def padded_width(width: int, multiple: int = EXPERT_ALIGN) -> int:
    """Routed experts are padded with zero neurons to a multiple of `multiple` (--pad-experts-to, default
    EXPERT_ALIGN). A zero neuron (zero gate/up rows, zero down column) adds silu(0) * 0 = 0 to the output, so
    padding is exact; it only costs the padded rows."""
    return -(-width // multiple) * multiple


@dataclass(frozen=True)
class Budget:
    total_params: int
    active_params: int  # parameters touched per token (all non-FFN weights + shared + top-k experts + routers)
    ffn_flops: int  # FFN multiply-adds x2 per token, summed over layers, routers included
    dense_total_params: int
    dense_ffn_flops: int

    @property
    def active_ratio(self) -> float:
        return self.active_params / self.dense_total_params

    @property
    def flops_ratio(self) -> float:
        return self.ffn_flops / self.dense_ffn_flops

    @property
    def total_ratio(self) -> float:
        return self.total_params / self.dense_total_params


def active_neuron_share(*, d_ff: int, n_layers: int, top_k: int, expert_width: int, shared_width: int,
                        dense_layers: int = 0) -> float:
    """Share of the dense FFNs' neurons a token uses: the shared expert and top_k routed experts of each MoE layer,
    every neuron of a dense layer. Real neurons only: the zero padding of stored experts (padded_width) is not
    counted here; carve_budget's FLOPs, which count what is computed, include it."""
    moe = shared_width + top_k * expert_width
    return (dense_layers * d_ff + (n_layers - dense_layers) * moe) / (n_layers * d_ff)


def carve_budget(*, hidden: int, d_ff: int, n_layers: int, other_params: int, experts: int, top_k: int,
                 expert_width: int, shared_width: int, dense_layers: int = 0) -> Budget:
    """other_params: everything that is not an FFN (embeddings, attention, norms, lm_head) in the dense model."""
    dense_ffn = 3 * hidden * d_ff
    moe_layers = n_layers - dense_layers
    expert = 3 * hidden * expert_width
    shared = 3 * hidden * shared_width
    router = experts * hidden
    moe_total = experts * expert + shared + router
    moe_active = top_k * expert + shared + router
    return Budget(
        total_params=other_params + dense_layers * dense_ffn + moe_layers * moe_total,
        active_params=other_params + dense_layers * dense_ffn + moe_layers * moe_active,
        ffn_flops=2 * (dense_layers * dense_ffn + moe_layers * moe_active),
        dense_total_params=other_params + n_layers * dense_ffn,
        dense_ffn_flops=2 * n_layers * dense_ffn,
    )
