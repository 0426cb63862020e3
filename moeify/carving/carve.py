"""Carving one layer: partition -> router -> (compensation), from weights alone or with calibration data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compensate import refit_down, routed_output, routing_mask
from ..maths.numerics import ffn_activations, neuron_stats, resolve_device
from ..maths.partition import Partition, partition_from_stats, partition_neurons, perm_hash
from ..maths.layerfit import FitSettings, fit_layer
from ..maths.router import (build_router, expert_output_norms, fit_router, observed_gate_scale, routing_ties,
                     topk_agreement, unit_gate_scale)

WEIGHT_METHODS = ("contiguous", "random", "gate-cluster")
STATS_METHODS = ("activation", "coactivation")
WEIGHT_ROUTERS = ("mean-gate", "representative")


@dataclass
class CarvedLayer:
    part: Partition
    router: torch.Tensor  # (n_experts, d_model) float32, before the unit-gate scale
    scale: float  # unit-gate router scale
    # replacement FFN weights in source neuron order, by name ("gate", "up": (d_ff, d_model), "down": (d_model, d_ff)):
    # the refit down_proj (--compensate) and the tuned tensors (--tune); the source's where absent
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    spilled: tuple[str, ...] = ()  # names of `weights` moved to the spill file (calibrate.py) to keep memory flat
    tuned: tuple[str, ...] = ()  # which of gate/up/down were tuned
    metrics: dict = field(default_factory=dict)

    def report(self) -> dict:
        return {"expert_sizes": [self.part.expert_width] * self.part.n_experts, "shared_neurons": self.part.n_shared,
                "router_scale": self.scale, "compensated": "refit_ridge" in self.metrics, "tuned": list(self.tuned),
                "perm_sha256": perm_hash(self.part.perm), "perm": self.part.perm.tolist(), **self.metrics}


def gate_scale(router: torch.Tensor, norm_weight: torch.Tensor, cfg) -> float:
    """The unit-gate router scale. With every expert active (top_k == experts) the router's order does not matter,
    so the scale is 0: a zero router gives every token gates of exactly 1/N, i.e. the dense FFN to float precision
    whatever --gate-tolerance says."""
    return 0.0 if cfg.top_k == cfg.experts else unit_gate_scale(router, norm_weight, cfg.gate_tolerance)


def shared_count(d_ff: int, experts: int, shared: int) -> int:
    return shared * (d_ff // (experts + shared))


def carve_weight_only(gate, up, down, norm_weight, cfg) -> CarvedLayer:
    """Partition + router from the weights alone; gate-cluster's k-means runs on `cfg.device` (a GPU when
    there is one and the device is auto or cuda: the similarities are float32 matrix products there)."""
    part = partition_neurons(cfg.method, gate, up, down, n_experts=cfg.experts,
                             n_shared=shared_count(gate.shape[0], cfg.experts, cfg.shared),
                             seed=cfg.seed, kmeans_iters=cfg.kmeans_iters, device=resolve_device(cfg.device))
    router = build_router(cfg.router, gate, part)
    return CarvedLayer(part, router, gate_scale(router, norm_weight, cfg))


@torch.no_grad()
def carve_calibrated(x: torch.Tensor, gate, up, down, norm_weight, cfg, stats=None, act=None,
                     target: torch.Tensor | None = None) -> tuple[CarvedLayer, torch.Tensor, torch.Tensor]:
    """Carve one FFN using its calibration inputs x (n_tokens, d_model), all float32 on one device.
    `act`: ffn_activations(x, gate, up) when the caller has already computed them. `target`: the output the carved
    FFN should produce (n_tokens, d_model); default the dense FFN's output on x. With calib_feed = "corrected" it is
    what restores the dense model's residual stream after this layer (the dense trajectory).

    Returns the carved layer, the carved FFN's output on x (n_tokens, d_model), which the next layer is fed
    with when calibrating on carved outputs, and the dense FFN's output on x (the dense feed; summed by expert).
    """
    act = ffn_activations(x, gate, up) if act is None else act  # (n, d_ff)
    if stats is None and cfg.method in STATS_METHODS:
        stats = neuron_stats(act, seed=cfg.seed)
    n_shared = shared_count(gate.shape[0], cfg.experts, cfg.shared)
    if cfg.method in STATS_METHODS:
        part = partition_from_stats(cfg.method, stats, n_experts=cfg.experts, n_shared=n_shared, seed=cfg.seed,
                                    kmeans_iters=cfg.kmeans_iters, device=x.device,
                                    down_norms=down.norm(dim=0).cpu() if cfg.shared_by == "contribution" else None)
    else:
        part = partition_neurons(cfg.method, gate.cpu(), up.cpu(), down.cpu(), n_experts=cfg.experts,
                                 n_shared=n_shared, seed=cfg.seed, kmeans_iters=cfg.kmeans_iters, device=x.device)
    part = Partition(part.perm.to(x.device), part.n_shared, part.n_experts, part.expert_width)
    norms, dense_out = expert_output_norms(act, down, part)  # (n, E) the oracle's ranking signal; act @ down.T
    n_hold = max(1, x.shape[0] // 10)
    metrics = {}
    for kind in WEIGHT_ROUTERS:  # report every router's agreement with the oracle on held-back tokens
        rows = build_router(kind, gate, part)
        metrics[f"agreement_{kind}"] = topk_agreement(x[-n_hold:] @ rows.T, norms[-n_hold:], cfg.top_k)
    if cfg.router == "fitted":
        router, info = fit_router(x, norms, cfg.top_k)
        metrics["agreement_fitted"] = info["holdout_agreement"]
        metrics["router_ridge"] = info["ridge"]
    else:
        router = build_router(cfg.router, gate, part)
    scores = x @ router.T
    y = dense_out if target is None else target
    weights = {}
    if cfg.compensate and cfg.top_k < cfg.experts:  # with every expert active there is nothing to compensate
        weights["down"], info = refit_down(act, routing_mask(scores, part, cfg.top_k), down, dense_out=y)
        metrics.update(refit_ridge=info["ridge"], rel_error_before=info["holdout_rel_error_before"],
                       rel_error_after=info["holdout_rel_error_after"])
    tuned = ()
    if cfg.fit_epochs > 0 and cfg.top_k < cfg.experts:
        settings = FitSettings(epochs=cfg.fit_epochs, lr=cfg.fit_lr, seed=cfg.seed)
        tuned = ("gate", "up", "down")
        new, info = fit_layer(x, y, routing_mask(scores, part, cfg.top_k), gate, up, weights.get("down", down),
                               settings, tuned)
        weights.update(new)
        metrics.update(tune_rel_error_before=info["holdout_rel_error_before"],
                       tune_rel_error_after=info["holdout_rel_error_after"], tune_epoch_kept=info["epoch_kept"],
                       tune_steps=info["steps"])
        act = ffn_activations(x, weights["gate"], weights["up"])
    out = routed_output(act, scores, part, cfg.top_k, weights.get("down", down))
    metrics["rel_error"] = ((out - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30)).item()
    cpu_part = Partition(part.perm.cpu(), part.n_shared, part.n_experts, part.expert_width)
    # the unit-gate scale from the spread of the calibration tokens' logits (router.observed_gate_scale)
    scale = 0.0 if cfg.top_k == cfg.experts else observed_gate_scale(scores, cfg.gate_tolerance)
    if scale:
        exported = scores * scale
        metrics["router_spread"] = (exported.max(1).values - exported.min(1).values).max().item()
        metrics["routing_ties"] = routing_ties(exported, cfg.top_k)
    layer = CarvedLayer(cpu_part, router.cpu(), scale,
                        weights={k: v.cpu() for k, v in weights.items()}, tuned=tuned, metrics=metrics)
    return layer, out, dense_out
