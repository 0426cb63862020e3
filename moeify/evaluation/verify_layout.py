"""What `moeify verify` reads of OUT itself before any check: the tensors config.json implies (read_layout, written
from the config, not from the converter's own tables), report.json, and the cap on how many problems a check lists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import MoeifyError
from ..formats.checkpoint import DTYPE_NAMES

MAX_LISTED = 20  # problems listed per check before "... and N more"
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class MoeLayout:
    """What config.json of a Mixtral / Qwen2-MoE checkpoint implies about its tensors."""

    fmt: str
    n_layers: int
    hidden: int
    n_experts: int
    top_k: int
    expert_width: int
    shared_width: int  # 0 for mixtral
    dense_width: int  # qwen2_moe intermediate_size (dense layers)
    dense_layers: tuple[int, ...]
    dtype: torch.dtype | None
    tied: bool
    shapes: dict[str, tuple[int, ...]]  # every tensor name -> shape, in layer order
    renormalize: bool = True  # top-k weights renormalised (Mixtral; Qwen2-MoE with norm_topk_prob)

    @property
    def routed_factor(self) -> int:
        """The routed experts' down_proj factor for unit gates: top_k when renormalised, else n_experts."""
        return self.top_k if self.renormalize else self.n_experts

    def is_dense(self, layer_idx: int) -> bool:
        return layer_idx in self.dense_layers

    def expert_names(self, layer_idx: int, expert_idx: int) -> tuple[str, str, str]:
        return expert_names(self.fmt, layer_idx, expert_idx)

    def router_name(self, layer_idx: int) -> str:
        return f"model.layers.{layer_idx}.{'block_sparse_moe' if self.fmt == 'mixtral' else 'mlp'}.gate.weight"


def expert_names(fmt: str, layer_idx: int, expert_idx: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one routed expert."""
    if fmt == "mixtral":
        p = f"model.layers.{layer_idx}.block_sparse_moe.experts.{expert_idx}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer_idx}.mlp.experts.{expert_idx}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def read_layout(out: Path) -> MoeLayout:
    """Parse OUT/config.json (MoeifyError if it cannot be read at all)."""
    from ..formats.families import read_config

    raw = read_config(out)
    fmt = raw.get("model_type")
    if fmt not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        raise MoeifyError(f"{out}/config.json: model_type {fmt!r} is not a format moeify writes",
                          "verify checks mixtral, qwen2_moe and qwen3_moe checkpoints")
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    cls = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[fmt]
    try:
        cfg = cls.from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    except Exception as exc:  # transformers raises many types for bad values
        raise MoeifyError(f"{out}/config.json could not be read as a {fmt} config: {exc}") from None
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok",
            "intermediate_size", "num_local_experts" if fmt == "mixtral" else "num_experts"]
    if fmt == "qwen2_moe":
        keys += ["moe_intermediate_size", "shared_expert_intermediate_size"]
    for key in keys:
        value = getattr(cfg, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MoeifyError(f"{out}/config.json: {key} must be a non-negative integer, got {value!r}")
    h, n_layers, heads, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size
    kv = cfg.num_key_value_heads or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    tied = bool(cfg.tie_word_embeddings)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    dtype = DTYPE_NAMES.get(dtype_name) if isinstance(dtype_name, str) else None
    if fmt == "mixtral":
        n_experts, width, shared, dense_width, dense_layers = cfg.num_local_experts, cfg.intermediate_size, 0, 0, ()
    else:
        n_experts, width = cfg.num_experts, cfg.moe_intermediate_size
        shared = cfg.shared_expert_intermediate_size if fmt == "qwen2_moe" else 0
        dense_width = cfg.intermediate_size
        step = cfg.decoder_sparse_step or 1
        dense_layers = tuple(i for i in range(n_layers) if i in (cfg.mlp_only_layers or []) or n_experts == 0
                             or (i + 1) % step != 0)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    q, kvd = heads * head_dim, kv * head_dim
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kvd, h), p + "self_attn.v_proj.weight": (kvd, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)})
        if fmt == "qwen2_moe" and cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,)})
        if fmt == "qwen3_moe":
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
        if i in dense_layers:
            m = p + "mlp."
            shapes.update({m + "gate_proj.weight": (dense_width, h), m + "up_proj.weight": (dense_width, h),
                           m + "down_proj.weight": (h, dense_width)})
            continue
        m = p + ("block_sparse_moe." if fmt == "mixtral" else "mlp.")
        shapes[m + "gate.weight"] = (n_experts, h)
        for e in range(n_experts):
            g, u, d = expert_names(fmt, i, e)
            shapes.update({g: (width, h), u: (width, h), d: (h, width)})
        if fmt == "qwen2_moe":
            shapes.update({m + "shared_expert.gate_proj.weight": (shared, h), m + "shared_expert.up_proj.weight": (shared, h),
                           m + "shared_expert.down_proj.weight": (h, shared), m + "shared_expert_gate.weight": (1, h)})
    shapes["model.norm.weight"] = (h,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    return MoeLayout(fmt, n_layers, h, n_experts, cfg.num_experts_per_tok, width, shared, dense_width, dense_layers,
                     dtype, tied, shapes, renormalize=fmt == "mixtral" or bool(cfg.norm_topk_prob))


def read_report(out: Path) -> dict | None:
    path = out / "report.json"
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MoeifyError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("layers"), list):
        raise MoeifyError(f"{path} has no 'layers' list")
    return report


def real_width(report: dict | None, layout: MoeLayout) -> int:
    """Neurons per routed expert; moeify pads experts with zero neurons (report.json has the unpadded width)."""
    width = (report or {}).get("expert_width")
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else layout.expert_width


def listed(problems: list[str], what: str) -> list[str]:
    """The first MAX_LISTED problems, then one line saying how many more."""
    if len(problems) <= MAX_LISTED:
        return problems
    return problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more {what}"]
