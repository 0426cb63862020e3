"""What bounds carving quality, on one layer of a real model: the relative squared error of the FFN output
(dense down_proj, held-back tokens) for each token's own best neurons (per-neuron oracle) against expert
partitions with the oracle router (top-k experts by true output norm) and with the fitted router.

    python scripts/bench_layer_bound.py models/smollm2-135m --layer 10 --tokens 16384 --active 0.25 --experts 8,64,256

The layer's inputs come from the dense model run layer by layer on WikiText-2 training text (moeify's calibration
forward); partitions are moeify's `activation` method, routers its `fitted` router.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.carving.calibrate import LayerwiseModel  # noqa: E402
from moeify.formats.text import calibration_tokens  # noqa: E402
from moeify.formats.checkpoint import CheckpointReader  # noqa: E402
from moeify.carving.compensate import routed_output  # noqa: E402
from moeify.formats.families import load_source  # noqa: E402
from moeify.maths.numerics import ffn_activations, neuron_stats  # noqa: E402
from moeify.maths.partition import partition_from_stats  # noqa: E402
from moeify.maths.router import expert_output_norms, fit_router  # noqa: E402

CORPUS = ROOT.parent / "shared" / "corpora" / "wikitext2" / "calib_train_200k.txt"


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--active", type=float, default=0.25, help="share of the FFN neurons active per token")
    ap.add_argument("--experts", default="8,64,256")
    ap.add_argument("--layouts", default="", help="comma-separated [sS]eEkK layouts (S shared experts' width, always "
                    "on, E routed, top-K; as scripts/bench_quality.py) scored like --experts, instead of --active")
    ap.add_argument("--calib", type=Path, default=CORPUS)
    a = ap.parse_args()
    src = load_source(a.model)
    tokens, _ = calibration_tokens(src.path, [a.calib], a.tokens, 512)
    model = LayerwiseModel(src, CheckpointReader(src.path), tokens)
    for i in range(a.layer + 1):
        layer = model.load_layer(i)
        h_mid, x = model.attention(layer)
        if i < a.layer:
            model.advance(h_mid, layer.mlp(x))
    x = x.reshape(-1, x.shape[-1])
    gate, up, down = (getattr(layer.mlp, f"{n}_proj").weight for n in ("gate", "up", "down"))
    act = ffn_activations(x, gate, up)
    dense = act @ down.T
    hold = slice(act.shape[0] - act.shape[0] // 10, act.shape[0])

    def rel(out):
        return ((out[hold] - dense[hold]).square().sum() / dense[hold].square().sum()).item()

    k_n = int(a.active * act.shape[1])
    contrib = act.abs() * down.norm(dim=0)
    mask = torch.zeros_like(act, dtype=torch.bool).scatter_(1, contrib.topk(k_n, dim=1).indices, True)
    print(f"layer {a.layer}, {a.active:.1%} active: per-neuron oracle {rel((act * mask) @ down.T):.4f}")
    stats = neuron_stats(act)
    if a.layouts:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_quality import active_fraction, parse_config

        layouts = [parse_config(lay) | {"name": lay} for lay in a.layouts.split(",")]
    else:
        layouts = [{"name": f"{e} experts", "experts": int(e), "top_k": int(a.active * int(e)), "shared": 0}
                   for e in a.experts.split(",")]
    for lay in layouts:
        n_e, k, s = lay["experts"], lay["top_k"], lay["shared"]
        n_shared = act.shape[1] * s // (n_e + s)
        part = partition_from_stats("activation", stats, n_experts=n_e, n_shared=n_shared, seed=0, kmeans_iters=8)
        norms, _ = expert_output_norms(act, down, part)
        router, _ = fit_router(x, norms, k)
        share = ""
        if a.layouts:  # this layout's share of neurons active, and the per-neuron oracle at that share
            k_n = round(active_fraction(lay) * act.shape[1])
            m = torch.zeros_like(act, dtype=torch.bool).scatter_(1, contrib.topk(k_n, dim=1).indices, True)
            share = f" ({active_fraction(lay):.1%} active) per-neuron oracle {rel((act * m) @ down.T):.4f}"
        print(f"{lay['name']:>12s} top-{k:<3d}{share} oracle router {rel(routed_output(act, norms, part, k, down)):.4f}"
              f"  fitted router {rel(routed_output(act, x @ router.T, part, k, down)):.4f}", flush=True)


if __name__ == "__main__":
    main()
