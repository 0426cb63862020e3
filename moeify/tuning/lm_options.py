"""What a next-token training run of an upcycled or merged output is asked to do (TrainOptions, checked before any
work), which outputs it trains, and what it measures of the routing: Mixtral's load-balancing loss and the expert
load (moeify.tuning.lm runs it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MoeifyError

CONSTRUCTIONS = ("upcycle", "merge")  # report.json's construction of the outputs this run trains
STARVED = 0.1  # an expert routed under this share of the uniform load is starved
HOLD_OUT = 8  # at most this many windows of the text held out (the last ones), at least one in twenty


@dataclass(frozen=True)
class TrainOptions:
    """What a next-token training run is asked to do (`moeify tune OUT --tune-text ...` on an upcycle or merge)."""

    tokens: int  # training tokens of this run
    text: tuple[str, ...]  # the training text (.txt / .jsonl); its last windows are held out
    lr: float = 0.003  # Adam step relative to each trained tensor's RMS at the start of the run
    train_router: bool = True
    train_experts: bool = True  # the routed experts and the shared expert (False: --router-only)
    train_attention: bool = False  # also attention projections and norms
    aux_loss_coef: float | None = None  # α of the load-balancing loss; None: the output's router_aux_loss_coef
    seq_len: int = 512  # tokens a window (capped at the model's max_position_embeddings)
    step_tokens: int = 4096  # tokens an optimizer step
    seed: int = 0  # the order of the windows

    def validate(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise MoeifyError(f"--tokens must be a positive integer (training tokens), got {self.tokens!r}")
        if not self.text:
            raise MoeifyError("an upcycled or merged output trains on text: none given",
                              "pass the training text with --tune-text FILE (repeatable; .txt or .jsonl)")
        for f in self.text:
            if not Path(f).is_file():
                raise MoeifyError(f"training text {f} not found", "pass existing .txt/.jsonl files to --tune-text")
        if not 0.0 < self.lr < 1.0:
            raise MoeifyError(f"--lr must be in (0, 1) (a step size relative to each weight's RMS), got {self.lr}")
        if not (self.train_router or self.train_experts or self.train_attention):
            raise MoeifyError("--router-only with --freeze-router leaves nothing to train",
                              "drop one of them")
        if self.aux_loss_coef is not None and not 0.0 <= self.aux_loss_coef < 1.0:
            raise MoeifyError(f"--aux-loss-coef must be in [0, 1), got {self.aux_loss_coef}",
                              "the literature uses 1e-3 to 1e-2")
        for name in ("seq_len", "step_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                flag = "--step-tokens" if name == "step_tokens" else name  # seq_len: the Python API's
                raise MoeifyError(f"{flag} must be an integer of at least 2, got {v!r}")


def is_trainable_output(out: Path) -> bool:
    """Whether OUT is an output of `moeify upcycle` or `moeify merge` (trained on text, not distilled)."""
    try:
        return json.loads((Path(out) / "report.json").read_text()).get("construction") in CONSTRUCTIONS
    except (OSError, ValueError, AttributeError):
        return False


def _counts(config) -> tuple[int, int]:
    n = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return int(n), int(config.num_experts_per_tok)


def moe_shape(config: dict) -> dict:
    """The shape moeify.maths.memory.train_memory takes, from a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    return {"hidden": h, "n_layers": int(config["num_hidden_layers"]), "heads": heads,
            "kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or h // heads), "vocab": int(config["vocab_size"]),
            "tied": bool(config.get("tie_word_embeddings", False)), "experts": int(experts),
            "top_k": int(config["num_experts_per_tok"]),
            "expert_width": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
            "shared_width": int(config.get("shared_expert_intermediate_size") or 0)}


def balance(router_logits, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's load-balancing loss of one forward, averaged over the layers (N · Σᵢ fᵢ Pᵢ a layer, k when the
    load is uniform), and each layer's top-k counts per expert, (layers, N)."""
    losses, counts = [], []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, k, dim=-1).indices
        count = torch.zeros(n, device=probs.device).scatter_add_(0, chosen.reshape(-1),
                                                                 torch.ones(chosen.numel(), device=probs.device))
        losses.append(n * (count / probs.shape[0] * probs.mean(0)).sum())
        counts.append(count.detach())
    return torch.stack(losses).mean(), torch.stack(counts)


def load_summary(counts: torch.Tensor) -> dict:
    """What the top-k counts (layers, N) say about the load: per layer the largest expert's share over the
    uniform share, and how many experts (in all layers) got under STARVED of it."""
    share = counts / counts.sum(1, keepdim=True).clamp_min(1) * counts.shape[1]  # 1 = uniform
    worst = int(share.max(1).values.argmax())
    return {"max_load": round(float(share.max()), 3), "max_load_layer": worst,
            "min_load": round(float(share.min()), 3), "starved": int((share < STARVED).sum()),
            "per_layer_max": [round(float(v), 3) for v in share.max(1).values]}


__all__ = ["CONSTRUCTIONS", "HOLD_OUT", "STARVED", "TrainOptions", "balance", "is_trainable_output", "load_summary",
           "moe_shape"]
