"""`moeify inspect`: the analyses of "A Closer Look into Mixture-of-Experts in LLMs", per MoE layer.

Static (weights only, read lazily one layer at a time):
- expert weight similarity: cosine between experts' flattened W_up / W_gate / W_down (matrix level) and between
  their neuron-averaged vectors (neuron level: mean of the rows of W_up/W_gate, of the columns of W_down);
  with a dense source the dense FFN is an extra row "F";
- router rows vs experts: cosine matrix of the router rows (X) against each neuron-level matrix (Y), linear regression
  over the strictly-lower-triangle pairs, R² per layer and averaged (the paper: 0.33 for Mixtral's (X, Y_gate)).

Dynamic (with a text file; one forward pass, hooks record every MoE block's input, then every expert is run on it,
i.e. the paper's "top-k = all" second pass):
- routing pattern: top-k experts and their gate weights per token, selection share per expert;
- counts of (output-norm rank, gate-score rank) pairs over tokens and experts;
- share of intermediate activations act(W_gate x) with |value| > 0.001.

Cosine similarity is scale invariant, so moeify's router scale (report.json `router_scale`) and the factor k on the
experts' down_proj do not change any number here. Only the routed experts are compared (a shared expert has another
width); qwen2_moe layers listed in `mlp_only_layers` are dense and skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..formats.checkpoint import CheckpointReader
from ..errors import MoeifyError
from ..formats.families import read_config

KINDS = ("up", "gate", "down")
ACTIVE_THRESHOLD = 1e-3
Progress = Callable[[str, int, int], None]  # (stage, done, total)

# ------------------------------------------------------------------------------------------------ pure maths


def cosine_matrix(vectors: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """(n, d) -> (n, n) cosine similarities, accumulated in float64 over column chunks. A zero vector has
    similarity 0 with everything (itself included)."""
    n, d = vectors.shape
    gram = torch.zeros(n, n, dtype=torch.float64)
    for start in range(0, d, chunk):
        c = vectors[:, start:start + chunk].double()
        gram += c @ c.T
    norms = gram.diagonal().clamp_min(0).sqrt()
    denom = torch.outer(norms, norms)
    return torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.zeros_like(gram))


def neuron_mean(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """Average neuron of one projection: mean of rows for up/gate (width, h), of columns for down (h, width)."""
    return weight.double().mean(dim=1 if kind == "down" else 0)


def lower_pairs(matrix: torch.Tensor) -> torch.Tensor:
    """The strictly-lower-triangle entries (each unordered pair once), row by row."""
    n = matrix.shape[0]
    i, j = torch.tril_indices(n, n, offset=-1)
    return matrix[i, j]


@dataclass(frozen=True)
class Fit:
    slope: float
    intercept: float
    r: float  # Pearson correlation
    r2: float

    def to_dict(self) -> dict:
        return {"slope": self.slope, "intercept": self.intercept, "r": self.r, "r2": self.r2}


def linear_fit(x: torch.Tensor, y: torch.Tensor) -> Fit | None:
    """Least-squares y ≈ slope·x + intercept; None when it is undefined (< 3 points or a constant x or y)."""
    x, y = x.double().flatten(), y.double().flatten()
    if x.numel() < 3:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy, sxy = (dx * dx).sum().item(), (dy * dy).sum().item(), (dx * dy).sum().item()
    scale = max(x.abs().max().item(), y.abs().max().item(), 1e-300) ** 2 * x.numel()
    if sxx <= 1e-24 * scale or syy <= 1e-24 * scale:
        return None
    r = max(-1.0, min(1.0, sxy / (sxx * syy) ** 0.5))
    slope = sxy / sxx
    return Fit(slope, y.mean().item() - slope * x.mean().item(), r, r * r)


def rank_desc(values: torch.Tensor) -> torch.Tensor:
    """(T, E) -> (T, E) rank of each entry within its row: 0 = largest."""
    order = values.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(values.shape[1]).expand_as(order).contiguous())
    return ranks


def rank_counts(norms: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(T, E) output norms and gate scores -> (E, E) counts: [i, j] = how often the expert with the (i+1)-th largest
    output norm got the (j+1)-th highest gate score. Each row sums to T; a diagonal matrix means norm order = score order."""
    e = norms.shape[1]
    pairs = rank_desc(norms) * e + rank_desc(scores)
    return torch.bincount(pairs.flatten(), minlength=e * e).reshape(e, e)


def live_neurons(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """(width,) bool: neurons that are not all-zero padding (moeify pads experts to a multiple of 8 with zero neurons)."""
    return (gate != 0).any(dim=1) | (up != 0).any(dim=1) | (down != 0).any(dim=0)


def active_share(acts: torch.Tensor, threshold: float = ACTIVE_THRESHOLD) -> float:
    return (acts.abs() > threshold).double().mean().item()


def mean_offdiag(matrix: torch.Tensor, n: int | None = None) -> float | None:
    """Mean similarity between distinct items among the first n rows/columns (the experts)."""
    m = matrix[:n, :n] if n else matrix
    return lower_pairs(m).mean().item() if m.shape[0] > 1 else None


# ----------------------------------------------------------------------------------------- reading a checkpoint


@dataclass(frozen=True)
class MoeLayout:
    """Where a Mixtral / Qwen2-MoE / Qwen3-MoE checkpoint keeps its routed experts and routers."""

    path: Path
    fmt: str  # mixtral | qwen2_moe | qwen3_moe
    n_experts: int
    top_k: int
    n_layers: int
    hidden: int
    hidden_act: str
    renormalize: bool  # top-k weights renormalised to sum to 1
    moe_layers: tuple[int, ...]

    def router_name(self, layer: int) -> str:
        block = "block_sparse_moe" if self.fmt == "mixtral" else "mlp"
        return f"model.layers.{layer}.{block}.gate.weight"

    def expert_name(self, layer: int, expert: int, kind: str) -> str:
        if self.fmt == "mixtral":
            w = {"gate": "w1", "down": "w2", "up": "w3"}[kind]
            return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
        return f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.weight"


def read_layout(path: str | Path, reader: CheckpointReader) -> MoeLayout:
    path = Path(path)
    raw = read_config(path)
    model_type = raw.get("model_type")
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        raise MoeifyError(f"{path}/config.json: model_type {model_type!r} cannot be inspected",
                          "inspect reads mixtral, qwen2_moe and qwen3_moe checkpoints (what moeify convert writes)")
    n_experts = raw.get("num_local_experts" if model_type == "mixtral" else "num_experts") or raw.get("num_local_experts")
    top_k = raw.get("num_experts_per_tok")
    n_layers, hidden = raw.get("num_hidden_layers"), raw.get("hidden_size")
    for key, value in (("num_experts", n_experts), ("num_experts_per_tok", top_k), ("num_hidden_layers", n_layers),
                       ("hidden_size", hidden)):
        if not isinstance(value, int) or value < 1:
            raise MoeifyError(f"{path}/config.json: {key} must be a positive integer, got {value!r}")
    layout = MoeLayout(path, model_type, n_experts, top_k, n_layers, hidden, raw.get("hidden_act", "silu"),
                       model_type == "mixtral" or bool(raw.get("norm_topk_prob")), ())
    moe = tuple(i for i in range(n_layers) if layout.router_name(i) in reader.tensors)
    if not moe:
        raise MoeifyError(f"{path} has no router tensors such as {layout.router_name(0)}",
                          "expected per-expert tensor names as moeify convert writes them (mixtral, qwen2_moe, qwen3_moe)")
    for i in moe:
        for e in range(n_experts):
            for kind in KINDS:
                if layout.expert_name(i, e, kind) not in reader.tensors:
                    raise MoeifyError(f"{path} lacks tensor {layout.expert_name(i, e, kind)}",
                                      "the checkpoint is incomplete or uses fused expert tensors, which inspect cannot read")
    return dataclasses.replace(layout, moe_layers=moe)


def parse_layers(text: str | None, layout: MoeLayout) -> tuple[int, ...]:
    if not text:
        return layout.moe_layers
    try:
        wanted = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise MoeifyError(f"--layers {text!r} is not a comma-separated list of layer indices", "e.g. 0,15,31") from None
    bad = [i for i in wanted if i not in layout.moe_layers]
    if bad:
        raise MoeifyError(f"--layers {bad[0]} is not an MoE layer of {layout.path}",
                          f"MoE layers: {_ranges(layout.moe_layers)}")
    return tuple(wanted)


def _ranges(items: tuple[int, ...]) -> str:
    return ", ".join(map(str, items)) if len(items) <= 12 else f"{items[0]}..{items[-1]} ({len(items)} layers)"


def load_experts(reader: CheckpointReader, layout: MoeLayout, layer: int, kind: str) -> list[torch.Tensor]:
    return [reader.get(layout.expert_name(layer, e, kind)).float() for e in range(layout.n_experts)]


# ------------------------------------------------------------------------------------------- static analyses


def weight_similarities(experts: list[torch.Tensor], kind: str, dense: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(matrix level, neuron level) cosine matrices for one projection kind. With `dense`, its row/column is last;
    at matrix level only when its shape equals the experts' (otherwise the flattened vectors are not comparable)."""
    same_shape = dense is not None and tuple(dense.shape) == tuple(experts[0].shape)
    flat = [w.flatten() for w in experts] + ([dense.flatten()] if same_shape else [])
    matrix = cosine_matrix(torch.stack(flat))
    means = [neuron_mean(w, kind) for w in experts] + ([neuron_mean(dense, kind)] if dense is not None else [])
    return matrix, cosine_matrix(torch.stack(means))


def router_fits(router: torch.Tensor, neuron: dict[str, torch.Tensor], n_experts: int) -> tuple[torch.Tensor, dict]:
    """Cosine matrix of the router rows, and its regression against each neuron-level matrix (experts only)."""
    x = cosine_matrix(router)
    fits = {}
    for kind, y in neuron.items():
        fit = linear_fit(lower_pairs(x), lower_pairs(y[:n_experts, :n_experts]))
        fits[kind] = fit.to_dict() if fit else None
    return x, fits


def static_analysis(path: str | Path, dense: str | Path | None = None, layers: str | None = None,
                    progress: Progress | None = None) -> dict:
    reader = CheckpointReader(path)
    layout = read_layout(path, reader)
    todo = parse_layers(layers, layout)
    dense_reader = _open_dense(dense, layout) if dense else None
    labels = [str(e) for e in range(layout.n_experts)]
    out_layers = []
    for done, i in enumerate(todo):
        matrix, neuron = {}, {}
        for kind in KINDS:
            experts = load_experts(reader, layout, i, kind)
            d = dense_reader.get(f"model.layers.{i}.mlp.{kind}_proj.weight").float() if dense_reader else None
            matrix[kind], neuron[kind] = weight_similarities(experts, kind, d)
            del experts, d
        router = reader.get(layout.router_name(i)).float()
        router_sim, fits = router_fits(router, neuron, layout.n_experts)
        e = layout.n_experts
        entry = {
            "layer": i,
            "matrix_labels": labels + (["F"] if matrix["up"].shape[0] > e else []),
            "neuron_labels": labels + (["F"] if dense_reader else []),
            "matrix": {k: v.tolist() for k, v in matrix.items()},
            "neuron": {k: v.tolist() for k, v in neuron.items()},
            "router": router_sim.tolist(),
            "router_fit": fits,
            "mean_expert_similarity": {
                "matrix": {k: mean_offdiag(v, e) for k, v in matrix.items()},
                "neuron": {k: mean_offdiag(v, e) for k, v in neuron.items()},
                "router": mean_offdiag(router_sim),
            },
        }
        if dense_reader:
            entry["mean_dense_similarity"] = {
                "matrix": {k: (v[e, :e].mean().item() if v.shape[0] > e else None) for k, v in matrix.items()},
                "neuron": {k: v[e, :e].mean().item() for k, v in neuron.items()},
            }
        out_layers.append(entry)
        if progress:
            progress("weights", done + 1, len(todo))
    reader.close()
    r2_avg = {}
    for kind in KINDS:
        vals = [entry["router_fit"][kind]["r2"] for entry in out_layers if entry["router_fit"][kind]]
        r2_avg[kind] = sum(vals) / len(vals) if vals else None
    return {"checkpoint": str(layout.path), "format": layout.fmt, "n_experts": layout.n_experts, "top_k": layout.top_k,
            "moe_layers": list(layout.moe_layers), "dense": str(dense) if dense else None, "layers": out_layers,
            "router_r2_avg": r2_avg}


def _open_dense(dense: str | Path, layout: MoeLayout) -> CheckpointReader:
    from ..formats.families import load_source

    src = load_source(dense)
    if src.hidden != layout.hidden or src.n_layers != layout.n_layers:
        raise MoeifyError(f"--dense {dense} has hidden {src.hidden} and {src.n_layers} layers; {layout.path} has hidden "
                          f"{layout.hidden} and {layout.n_layers} layers", "pass the dense model the MoE was built from")
    return CheckpointReader(src.path)


# ------------------------------------------------------------------------------------------ dynamic analyses


def expert_dynamics(x: torch.Tensor, router: torch.Tensor, experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    top_k: int, act: Callable, renormalize: bool, threshold: float = ACTIVE_THRESHOLD) -> dict:
    """Run every expert on the MoE block input x (T, h). experts: (gate, up, down) per expert.
    Returns gate scores (T, E), top-k indices/weights (T, k), output norms (T, E), routed output (T, h)
    (what the block's routed part computes) and the active share of act(W_gate x) per expert (E,), counted over
    its non-padding neurons."""
    x = x.float()
    logits = x @ router.float().T  # (T, E)
    scores = torch.softmax(logits, dim=-1)
    top_w, top_i = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    norms, shares = [], []
    routed = torch.zeros_like(x)
    for e, (g, u, d) in enumerate(experts):
        a = act(x @ g.float().T)  # (T, width)
        y = (a * (x @ u.float().T)) @ d.float().T  # (T, h)
        norms.append(y.norm(dim=-1))
        live = live_neurons(g, u, d)
        shares.append(active_share(a[:, live], threshold) if live.any() else 0.0)
        w = (top_w * (top_i == e)).sum(dim=-1, keepdim=True)  # (T, 1), zero where not selected
        routed += w * y
    return {"logits": logits, "scores": scores, "top_k_index": top_i, "top_k_weight": top_w,
            "norms": torch.stack(norms, dim=1), "active_share": torch.tensor(shares), "routed_output": routed}


def capture_moe_inputs(model, layers: tuple[int, ...], ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """One forward pass; returns each listed layer's MoE block input (T, h) (post-attention-norm hidden states)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in layers:
        def hook(module, args, i=i):
            captured[i] = args[0].detach().reshape(-1, args[0].shape[-1]).float().clone()
        handles.append(model.model.layers[i].mlp.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return captured


def read_text(data: Path, max_tokens: int) -> str:
    """--data of `inspect` (moeify.formats.text.read_text), after --max-tokens is checked."""
    from ..formats.text import read_text as read_data

    if max_tokens < 2:
        raise MoeifyError(f"--max-tokens must be ≥ 2, got {max_tokens}")
    return read_data(data)[0]


def dynamic_analysis(path: str | Path, data: str | Path, max_tokens: int = 512, layers: str | None = None,
                     progress: Progress | None = None) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.activations import ACT2FN

    from ..formats.text import encode_text, load_tokenizer

    path, data = Path(path), Path(data)
    reader = CheckpointReader(path)
    layout = read_layout(path, reader)
    todo = parse_layers(layers, layout)
    text = read_text(data, max_tokens)
    tok = load_tokenizer(path)
    ids = torch.tensor([encode_text(tok, text)[:max_tokens]], dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit:
        ids = ids[:, :limit]
    inputs = capture_moe_inputs(model, todo, ids)
    del model
    act = ACT2FN[layout.hidden_act]
    out_layers = []
    for done, i in enumerate(todo):
        experts = [tuple(reader.get(layout.expert_name(i, e, k)) for k in ("gate", "up", "down"))
                   for e in range(layout.n_experts)]
        dyn = expert_dynamics(inputs.pop(i), reader.get(layout.router_name(i)), experts, layout.top_k, act,
                              layout.renormalize)
        del experts
        top_i, norms, scores = dyn["top_k_index"], dyn["norms"], dyn["scores"]
        counts = rank_counts(norms, dyn["logits"])  # logits rank like the scores, without softmax rounding ties
        k = layout.top_k
        norm_top = torch.topk(norms, k, dim=-1).indices
        overlap = (norm_top[:, :, None] == top_i[:, None, :]).any(-1).double().sum(-1) / k
        selected = torch.bincount(top_i.flatten(), minlength=layout.n_experts).double() / top_i.shape[0]
        out_layers.append({
            "layer": i,
            "top_k_index": top_i.tolist(),
            "top_k_weight": dyn["top_k_weight"].tolist(),
            "gate_scores": scores.tolist(),
            "selection_share": selected.tolist(),
            "output_norms_mean": norms.mean(0).tolist(),
            "norm_score_rank_counts": counts.tolist(),
            "top1_norm_is_top1_score": (counts[0, 0].item() / top_i.shape[0]),
            "topk_norm_overlap": overlap.mean().item(),
            "active_share": dyn["active_share"].tolist(),
            "active_share_mean": dyn["active_share"].mean().item(),
        })
        if progress:
            progress("experts on data", done + 1, len(todo))
    reader.close()
    return {"file": str(data), "n_tokens": int(ids.shape[1]), "active_threshold": ACTIVE_THRESHOLD,
            "tokens": [tok.decode([t]) for t in ids[0].tolist()], "layers": out_layers}


# ------------------------------------------------------------------------------------------------- the command


def run_inspect(path: str | Path, *, dense: str | Path | None = None, data: str | Path | None = None,
                max_tokens: int = 512, layers: str | None = None, out_dir: str | Path | None = None,
                plots: bool = True, progress: Progress | None = None) -> dict:
    """All analyses; writes inspect.json (and PNGs when matplotlib is installed) into out_dir (default OUT/inspect)."""
    path = Path(path)
    if data is not None:
        read_text(Path(data), max_tokens)  # fail before the weight analyses
    result = static_analysis(path, dense, layers, progress)
    if data is not None:
        result["data"] = dynamic_analysis(path, data, max_tokens, layers, progress)
    out_dir = Path(out_dir) if out_dir else path / "inspect"
    out_dir.mkdir(parents=True, exist_ok=True)
    result["plots"] = []
    if plots and importlib.util.find_spec("matplotlib") is None:
        result["plots_skipped"] = "matplotlib is not installed (pip install 'moeify[plot]')"
    elif plots:
        from .inspect_plots import save_plots

        result["plots"] = [str(p) for p in save_plots(result, out_dir)]
    json_path = out_dir / "inspect.json"
    json_path.write_text(json.dumps(result) + "\n")
    result["json"] = str(json_path)
    return result
