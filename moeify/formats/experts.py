"""One carved FFN's tensors in a target format, and back: the export `convert` writes and the un-permutation
`tune` reads its student from (ffn_output_tensors and unpermute_ffn are each other's inverse; tests/test_convert.py
checks the round trip bit for bit).

Below both stages (convert and tune import it; it imports neither): a carved layer's experts are rows of the dense
gate/up_proj and columns of down_proj in permuted order, cut into experts, padded to the format's width and scaled
for the format's gates (families.routed_factor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..maths.budget import padded_width
from .config import ConvertConfig
from .families import ffn_tensor_names, routed_factor
from ..maths.partition import Partition



def ffn_output_tensors(fmt: str, layer_idx: int, part: Partition, router: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor, down: torch.Tensor, cfg: ConvertConfig, dtype: torch.dtype,
                       shared_gate: float) -> dict[str, torch.Tensor]:
    """The target tensors of one carved FFN. router: (n_experts, d_model) already scaled for unit gates; down: dense
    or refit (d_model, d_ff). Selected experts get weight ~1/k (Mixtral) or ~1/N (Qwen2-MoE, not renormalised), so
    down_proj is multiplied by k or N (`routed_factor`); the Qwen2-MoE shared expert gets sigmoid(~0) ~ 1/2 from the
    constant gate row `shared_gate` (router.shared_gate_value), so its down_proj is multiplied by 2."""
    k = routed_factor(fmt, cfg.experts, cfg.top_k)
    pad = padded_width(part.expert_width, cfg.pad_experts_to) - part.expert_width
    names = iter(ffn_tensor_names(fmt, layer_idx, cfg.experts, dense=False, shared=cfg.shared > 0))
    out = {next(names): router.to(dtype)}
    for e in range(cfg.experts):
        idx = part.expert_neurons(e)
        out[next(names)] = _pad(gate[idx].to(dtype), (0, 0, 0, pad))
        out[next(names)] = _pad(up[idx].to(dtype), (0, 0, 0, pad))
        out[next(names)] = _pad(_scaled(down[:, idx], k, dtype), (0, pad))
    if fmt == "qwen2_moe":
        idx = part.shared_neurons
        out[next(names)] = gate[idx].to(dtype)
        out[next(names)] = up[idx].to(dtype)
        out[next(names)] = _scaled(down[:, idx], 2, dtype)
        out[next(names)] = torch.full((1, gate.shape[1]), float(shared_gate), dtype=dtype)
    return out


def _pad(t: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    return F.pad(t, pad) if any(pad) else t  # F.pad copies even when there is nothing to pad


def _scaled(t: torch.Tensor, factor: int, dtype: torch.dtype) -> torch.Tensor:
    """(t.float() * factor).to(dtype) of a freshly gathered t (scaled in place), without the float32 round trip
    when t already has `dtype`: bf16/fp16 arithmetic computes in float32 and rounds once, so the bits are the
    same (tests/test_scale.py checks)."""
    if t.dtype == dtype and dtype in (torch.bfloat16, torch.float16, torch.float32):
        return t.mul_(factor)
    return (t.float() * factor).to(dtype)


def unpermute_ffn(out_tensors: dict[str, torch.Tensor], part: Partition, fmt: str, layer_idx: int, cfg: ConvertConfig,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuild the dense gate/up/down of one layer from its expert tensors (inverse of ffn_output_tensors)."""
    names = ffn_tensor_names(fmt, layer_idx, cfg.experts, dense=False, shared=cfg.shared > 0)[1:]
    chunks_g, chunks_u, chunks_d = [], [], []
    groups = [(names[3 * e: 3 * e + 3], routed_factor(fmt, cfg.experts, cfg.top_k)) for e in range(cfg.experts)]
    if fmt == "qwen2_moe":
        groups.insert(0, (names[3 * cfg.experts: 3 * cfg.experts + 3], 2))
    for n, ((g, u, d), factor) in enumerate(groups):
        w = part.n_shared if (fmt == "qwen2_moe" and n == 0) else part.expert_width  # drop zero padding
        chunks_g.append(out_tensors[g][:w])
        chunks_u.append(out_tensors[u][:w])
        chunks_d.append((out_tensors[d][:, :w].float() / factor).to(out_tensors[d].dtype))
    inv = torch.argsort(part.perm)
    return torch.cat(chunks_g)[inv], torch.cat(chunks_u)[inv], torch.cat(chunks_d, dim=1)[:, inv]
