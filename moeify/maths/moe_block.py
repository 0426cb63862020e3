"""The student's MoE block: a carved FFN as the exported Mixtral / Qwen2-MoE block computes it, in the dense neuron
order, with trainable routing (moeify.training.distill trains it; moeify.tuning builds it).

Two exact ways to compute it (MaskedMoE.kernel):
- "masked": every neuron's products, the unchosen ones multiplied by 0 (masked_ffn). Simple, any dtype, and at the
  arithmetic limit of a CPU where the active share is large; it does the work of the dense FFN.
- "grouped": only the chosen experts' products, one grouped matrix product per projection over the tokens sorted by
  expert (torch._grouped_mm, as transformers' and torchtitan's MoE layers train), so a step costs the active share
  of the FFN's arithmetic, not all of it. bf16 only (the autocast dtype of a GPU or an AVX512-BF16 CPU), experts of
  one width that is a multiple of 8; elsewhere the block computes masked. The two agree to bf16 rounding
  (tests/test_moe_block.py), their router gradients too. No host synchronisation: the expert boundaries stay on the
  device (the offsets of the sorted pairs), and the output is summed per token without atomics (deterministic).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .layerfit import masked_ffn

KERNELS = ("masked", "grouped")


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class Routing(torch.nn.Module):
    """A MaskedMoE's router rows (E, d_model) and log temperature: the router logits, float32."""

    def __init__(self, router: torch.Tensor, scale: float):
        super().__init__()
        self.router = torch.nn.Parameter(router.detach().float().clone())
        self.log_scale = torch.nn.Parameter(torch.tensor([math.log(scale)], dtype=torch.float32))  # 1-d: FSDP2 shards it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ (self.router * self.log_scale.exp()).T


RENORMALISED = ("mixtral", "qwen3_moe")  # formats whose top-k weights are renormalised (read by families.renormalises)


class MaskedMoE(torch.nn.Module):
    """A carved FFN as the exported MoE block computes it, in the dense neuron order.

    gate/up: (d_ff, d_model), down: (d_model, d_ff) as carved (without the factor k / N of the export), router:
    (E, d_model) before the unit-gate scale, scale: that scale (> 0), labels: (d_ff,) expert of each neuron (-1:
    shared, always on with weight 1, or with shared_gate c: 2 sigmoid(c sum(x)), Qwen2-MoE's constant gate row c
    with the shared down_proj x 2 of the export). fmt "mixtral" (and "qwen3_moe", written with norm_topk_prob true):
    gate weights are the top-k softmax probabilities renormalised, times k; "qwen2_moe": the softmax probabilities
    over all experts (not renormalised), times N."""

    def __init__(self, gate, up, down, router: torch.Tensor, scale: float, labels: torch.Tensor, top_k: int,
                 fmt: str = "mixtral", shared_gate: float | None = None):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Parameter(t.detach().float().clone()) for t in (gate, up, down))
        self.routing = Routing(router, scale)  # a module of its own: its own FSDP2 group, always float32
        self.register_buffer("labels", labels.clone())
        self.top_k, self.fmt, self.shared_gate = top_k, fmt, shared_gate
        self.dense_grad = False  # DenseMixer: the router's gradient as if every expert ran (forward unchanged)
        self.kernel = "masked"  # or "grouped" (where it applies: grouped_applies)
        n_exp, lab = router.shape[0], labels.long()
        widths = torch.bincount(lab[lab >= 0], minlength=n_exp)
        self.width = int(widths[0]) if n_exp and bool((widths == widths[0]).all()) else 0  # 0: experts differ
        # the routed neurons expert by expert (the grouped kernel's weight order) and the shared neurons
        self.register_buffer("routed", torch.argsort(torch.where(lab >= 0, lab, n_exp), stable=True)[
            :n_exp * self.width], persistent=False)
        self.register_buffer("shared", torch.nonzero(lab < 0).flatten(), persistent=False)

    @property
    def router(self) -> torch.nn.Parameter:
        return self.routing.router

    @property
    def log_scale(self) -> torch.nn.Parameter:
        return self.routing.log_scale

    def exported_router(self) -> torch.Tensor:
        """The router rows the checkpoint stores (the scale folded in)."""
        return (self.router * self.log_scale.exp()).detach()

    def choice(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens x (n, d): (the top-k experts (n, k), every expert's weight were it chosen (n, E), float32: the
        format's softmax weights; the shared neurons' weight (n, 1): 1, or Qwen2-MoE's 2 sigmoid(c sum(x)))."""
        n_exp = self.router.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            logits = self.routing(x)
            probs = logits.softmax(-1)
            idx = logits.topk(self.top_k, dim=1).indices
            if self.fmt in RENORMALISED:  # every expert's weight were it chosen: renormalised over the top-k, times k
                w_all = probs / probs.gather(1, idx).sum(1, keepdim=True) * self.top_k
            else:
                w_all = probs * n_exp
            shared = (torch.ones_like(w_all[:, :1]) if self.shared_gate is None else  # Qwen2-MoE: 2 sigmoid(c sum(x))
                      2 * torch.sigmoid(self.shared_gate * x.float().sum(1, keepdim=True)))
        return idx, w_all, shared

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """(n, E + 1) weight of each expert for each token (0 when not chosen); the last column, the shared neurons,
        is 1 (or Qwen2-MoE's shared gate)."""
        n_exp = self.router.shape[0]
        idx, w_all, shared = self.choice(x)
        g = torch.zeros(x.shape[0], n_exp + 1, device=x.device, dtype=w_all.dtype)
        g = g.scatter(1, idx, w_all.gather(1, idx))
        if self.dense_grad and torch.is_grad_enabled():
            # straight-through: the value is the top-k gate, the gradient the dense one's, so the router learns
            # which experts it should have chosen (the unchosen neurons are computed anyway: masked FFN)
            g = g + F.pad(w_all - w_all.detach(), (0, 1))
        return torch.cat([g[:, :n_exp], shared], 1)

    def grouped_applies(self, dtype: torch.dtype) -> bool:
        """Whether the grouped kernel computes this block in `dtype` (the compute dtype: autocast's, or the input's)."""
        d = self.gate.shape[1]
        return (dtype == torch.bfloat16 and grouped_mm_available() and self.width > 0 and self.width % 8 == 0
                and d % 8 == 0 and not self.dense_grad)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        if self.kernel == "grouped" and self.grouped_applies(dtype):
            return self._grouped(h, dtype)
        mask = self.gates(h.reshape(-1, h.shape[-1]))[:, self.labels]
        # on h itself, not a flattened view of it: the output is then a tensor of its own, not a view (FSDP2 warns
        # that an in-place op on a wrapped module's view output would skip its all-gather)
        return masked_ffn(h, self.gate, self.up, self.down, mask.to(h.dtype).view(*h.shape[:-1], -1))

    def _grouped(self, h: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """The block with only the chosen experts' products: the (token, expert) pairs sorted by expert, one
        grouped product per projection, each pair's hidden activations times its gate weight (where masked_ffn
        multiplies the mask), and every token's k outputs summed in place of a scatter."""
        d, n_exp, k, w = h.shape[-1], self.router.shape[0], self.top_k, self.width
        x = h.reshape(-1, d)
        n = x.shape[0]
        idx, w_all, shared = self.choice(x)
        weight = w_all.gather(1, idx).reshape(-1)  # (n k,) the chosen experts' weights, token-major
        with torch.autocast(h.device.type, enabled=False):
            xc = x.to(dt)
            gate_c, up_c, down_c = self.gate.to(dt), self.up.to(dt), self.down.to(dt)  # cast once, for both parts
            gate = gate_c[self.routed].view(n_exp, w, d)
            up = up_c[self.routed].view(n_exp, w, d)
            down = down_c[:, self.routed].view(d, n_exp, w).permute(1, 2, 0)  # (E, w, d)
            flat = idx.reshape(-1)
            order = torch.argsort(flat, stable=True)  # the pairs grouped by expert
            offs = torch.cumsum(torch.bincount(flat, minlength=n_exp), 0).to(torch.int32)
            xs = xc.unsqueeze(1).expand(n, k, d).reshape(n * k, d)[order]
            act = F.silu(torch._grouped_mm(xs, gate.transpose(1, 2), offs=offs)) * torch._grouped_mm(
                xs, up.transpose(1, 2), offs=offs)
            ys = torch._grouped_mm(act * weight[order, None].to(dt), down, offs=offs)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            out = ys[inverse].view(n, k, d).float().sum(1)  # every token's k experts, in a fixed order
            if self.shared.numel():
                s = self.shared
                out = out + masked_ffn(xc, gate_c[s], up_c[s], down_c[:, s], shared.to(dt)).float()
        return out.to(dt).view(h.shape)
