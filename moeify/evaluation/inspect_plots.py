"""PNG figures for `moeify inspect` (matplotlib, the optional `plot` extra). Reads the inspect result dict only."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

KINDS = ("up", "gate", "down")
MAX_ROUTING_TOKENS = 64  # the paper's routing figure shows a ~64-token prompt


def _heatmap(ax, matrix, labels, title, vmin=None, vmax=None):
    m = np.asarray(matrix, dtype=float)
    im = ax.imshow(m, cmap="viridis", vmin=vmin, vmax=vmax)
    ax.set_title(title, fontsize=9)
    if len(labels) <= 16:
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)


def _weights_figure(entry: dict, path: Path) -> None:
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5))
    for col, kind in enumerate(KINDS):
        _heatmap(axes[0, col], entry["matrix"][kind], entry["matrix_labels"], f"matrix level W_{kind}")
        _heatmap(axes[1, col], entry["neuron"][kind], entry["neuron_labels"], f"neuron level (averaged) W_{kind}")
    n = len(entry["router"])
    _heatmap(axes[0, 3], entry["router"], [str(e) for e in range(n)], "router rows")
    ax = axes[1, 3]
    rows, cols = np.tril_indices(n, k=-1)
    x = np.asarray(entry["router"])[rows, cols]
    y = np.asarray(entry["neuron"]["gate"])[:n, :n][rows, cols]
    ax.scatter(x, y, s=12)
    fit = entry["router_fit"]["gate"]
    if fit:
        xs = np.linspace(x.min(), x.max(), 2)
        ax.plot(xs, fit["slope"] * xs + fit["intercept"], color="C1")
        ax.set_title(f"router vs averaged W_gate: R² = {fit['r2']:.2f}", fontsize=9)
    else:
        ax.set_title("router vs averaged W_gate: R² undefined", fontsize=9)
    ax.set_xlabel("router-row cosine", fontsize=8)
    ax.set_ylabel("averaged W_gate cosine", fontsize=8)
    fig.suptitle(f"layer {entry['layer']}: expert similarity (cosine)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _r2_figure(layers: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = [e["layer"] for e in layers]
    for kind in KINDS:
        ys = [e["router_fit"][kind]["r2"] if e["router_fit"][kind] else np.nan for e in layers]
        ax.plot(xs, ys, marker="o", label=f"(router, W_{kind})")
    ax.set_xlabel("layer")
    ax.set_ylabel("R²")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("router-row similarity vs neuron-averaged expert similarity")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _routing_figure(entry: dict, tokens: list[str], n_experts: int, path: Path) -> None:
    t = min(len(entry["top_k_index"]), MAX_ROUTING_TOKENS)
    grid = np.zeros((n_experts, t))
    for pos in range(t):
        for e, w in zip(entry["top_k_index"][pos], entry["top_k_weight"][pos]):
            grid[e, pos] = w
    fig, ax = plt.subplots(figsize=(max(6, t * 0.22), 0.4 * n_experts + 1.8))
    im = ax.imshow(grid, cmap="Blues", aspect="auto", vmin=0)
    ax.set_yticks(range(n_experts), [str(e) for e in range(n_experts)], fontsize=7)
    ax.set_xticks(range(t), [repr(s)[1:-1][:8] for s in tokens[:t]], rotation=90, fontsize=6)
    ax.set_ylabel("expert")
    ax.set_title(f"layer {entry['layer']}: top-k gate weights per token", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _norm_score_figure(layers: list[dict], path: Path) -> None:
    counts = np.sum([np.asarray(e["norm_score_rank_counts"]) for e in layers], axis=0)
    n = counts.shape[0]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    im = ax.imshow(counts, cmap="magma")
    ax.set_xticks(range(n), [str(i + 1) for i in range(n)], fontsize=7)
    ax.set_yticks(range(n), [str(i + 1) for i in range(n)], fontsize=7)
    ax.set_xlabel("gate score rank (1 = highest)")
    ax.set_ylabel("output norm rank (1 = largest)")
    ax.set_title("expert output norm rank vs gate score rank\n(counts over tokens, all analysed layers)", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _active_figure(layers: list[dict], threshold: float, path: Path) -> None:
    grid = np.asarray([e["active_share"] for e in layers])
    fig, ax = plt.subplots(figsize=(6, 0.25 * len(layers) + 2))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0, vmax=1)
    ax.set_yticks(range(len(layers)), [str(e["layer"]) for e in layers], fontsize=7)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"share of |act(W_gate x)| > {threshold:g}", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save_plots(result: dict, out_dir: Path) -> list[Path]:
    """Write the figures into out_dir; returns their paths."""
    written = []
    for entry in result["layers"]:
        p = out_dir / f"weights_layer{entry['layer']:03d}.png"
        _weights_figure(entry, p)
        written.append(p)
    p = out_dir / "router_r2.png"
    _r2_figure(result["layers"], p)
    written.append(p)
    data = result.get("data")
    if data:
        for entry in data["layers"]:
            p = out_dir / f"routing_layer{entry['layer']:03d}.png"
            _routing_figure(entry, data["tokens"], result["n_experts"], p)
            written.append(p)
        for name, fn in (("norm_vs_score.png", lambda q: _norm_score_figure(data["layers"], q)),
                         ("active_share.png", lambda q: _active_figure(data["layers"], data["active_threshold"], q))):
            fn(out_dir / name)
            written.append(out_dir / name)
    return written
