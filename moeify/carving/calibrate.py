"""Layer-sequential calibration: calibration tokens through the dense model, one decoder layer resident.

Each decoder layer is a real transformers LlamaDecoderLayer/MistralDecoderLayer/Qwen2DecoderLayer (rotary embeddings,
causal or sliding-window mask and GQA exactly as the model computes them), built on the meta device and
loaded with only that layer's weights by the one layer-by-layer runner, moeify.evaluation.layerwise. The FFN input
of every calibration token (post-attention RMSNorm output) is what the carving statistics, router fitting and
down-projection refit are computed from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..evaluation.layerwise import ResidentRun, source_stack
from ..formats.checkpoint import SPILL_DIR, CheckpointReader
from ..errors import MoeifyError
from ..formats.families import SourceModel
from ..formats.text import calibration_tokens
from ..maths.numerics import (NeuronStats, ffn_activations, neuron_stats, release_memory,  # noqa: F401 (re-exported)
                              resolve_device)

# ------------------------------------------------------------------------------------- layer-by-layer forward


class LayerwiseModel(ResidentRun):
    """The dense source on the calibration windows, one decoder layer at a time on `device`: the shared runner
    (moeify.evaluation.layerwise.ResidentRun: every window's hidden states resident, a layer's FFN input exposed for
    the carve) built from the source as calibration sees it."""

    def __init__(self, src: SourceModel, reader: CheckpointReader, tokens: torch.Tensor, device: str = "cpu",
                 batch_size: int = 8):
        super().__init__(source_stack(src, reader, device=device), tokens, batch_size)
        self.src, self.reader = src, reader


# ------------------------------------------------------------------------------------ the calibration pass


def calibrate_and_carve(plan, tmp: Path, progress=None) -> tuple[dict, dict, torch.Tensor]:
    """Run the calibration tokens through the model layer by layer and carve every layer from them.

    Per layer: build the real decoder layer, run attention on all hidden states, compute the FFN input x,
    carve (partition / router / refit / tuning) from x, and pass the dense (or, with calib_feed="moe" or
    "corrected", the carved) FFN output on. With "corrected" the dense model's hidden states are carried along
    too, and each carved layer is fitted to the output that brings the residual stream back to the dense one
    (h_dense_next - h_mid_carved), so the error of earlier carved layers is corrected instead of compounded.
    Refit and tuned FFN weights are spilled to tmp/.carve/{layer}.safetensors. Returns ({layer: CarvedLayer},
    info, tokens) where info names the dense layers chosen by --dense-layers auto:M and tokens are the calibration
    windows (n_windows, seq_len), which whole-model tuning trains on.
    """
    from safetensors.torch import save_file

    from .carve import carve_calibrated

    cfg, src, reader = plan.cfg, plan.src, plan.reader
    device = resolve_device(cfg.device)
    seq_len = min(cfg.calib_seq_len, int(src.raw.get("max_position_embeddings") or cfg.calib_seq_len))
    tokens, text_tokens = calibration_tokens(src.path, list(cfg.calib), cfg.calib_tokens, seq_len)
    stats_in = _load_stats(cfg.stats) if cfg.stats else None
    model = LayerwiseModel(src, reader, tokens, device=device)
    corrected = cfg.calib_feed == "corrected"
    dense_hidden = model.hidden.clone() if corrected else None  # the dense trajectory, when it is the target
    (tmp / SPILL_DIR).mkdir(exist_ok=True)
    stats_files: list[Path] = []  # per-layer statistics, spilled as they are made (memory stays flat over layers)
    carved = {}
    for i in range(src.n_layers):
        layer = model.load_layer(i)
        if i + 1 < src.n_layers:
            reader.prefetch(reader.layer_tensors(i + 1))  # read from disk while this layer computes
        h_mid, x = model.attention(layer)
        x = x.reshape(-1, x.shape[-1])
        mlp = layer.mlp
        gate, up, down = mlp.gate_proj.weight.data, mlp.up_proj.weight.data, mlp.down_proj.weight.data
        stats = NeuronStats.from_dict(stats_in, i) if stats_in is not None else None
        with torch.no_grad():
            act = ffn_activations(x, gate, up)  # (n, d_ff), computed once for the statistics, the carving and the feed
            if stats is None and cfg.method in ("activation", "coactivation"):
                stats = neuron_stats(act, seed=cfg.seed)
            if stats is not None:
                (tmp / "calibration").mkdir(exist_ok=True)
                stats_files.append(tmp / "calibration" / f"layer-{i}.safetensors")
                save_file(stats.to_dict(i), str(stats_files[-1]))
            target = None
            if corrected:
                h_mid_d, x_d = model.attention(layer, dense_hidden)
                dense_hidden = h_mid_d + mlp(x_d)
                target = (dense_hidden - h_mid).reshape(x.shape)  # what restores the dense residual stream
                del h_mid_d, x_d
            carved_layer, carved_out, dense_out = carve_calibrated(x, gate, up, down, layer.post_attention_layernorm.weight.data,
                                                                   cfg, stats, act=act, target=target)
            if carved_layer.weights:
                save_file({k: v.to(plan.out_dtype).contiguous() for k, v in carved_layer.weights.items()},
                          str(tmp / SPILL_DIR / f"{i}.safetensors"))
                carved_layer.spilled, carved_layer.weights = tuple(sorted(carved_layer.weights)), {}  # read back when writing
            carved[i] = carved_layer
            model.advance(h_mid, dense_out if cfg.calib_feed == "dense" else carved_out)  # dense: = mlp(x)
        del layer, h_mid, x, act, carved_out, dense_out, target
        release_memory()
        if progress:
            progress("calibrating", i + 1, src.n_layers)
    info = {"tokens": int(tokens.numel()), "windows": int(tokens.shape[0]), "seq_len": seq_len,
            "text_tokens": text_tokens, "requested_tokens": cfg.calib_tokens or None, "device": device,
            "feed": cfg.calib_feed}
    if cfg.dense_auto:
        sensitivity = {i: c.metrics["rel_error"] for i, c in carved.items()}
        info["dense_layers"] = sorted(sorted(sensitivity, key=lambda i: -sensitivity[i])[: cfg.dense_auto])
    if stats_files:
        _merge_stats(stats_files, tmp / "calibration" / "stats.safetensors",
                     {"tokens": str(int(tokens.numel())), "seq_len": str(seq_len)})
    return carved, info, tokens


def _merge_stats(files: list[Path], out: Path, metadata: dict[str, str]) -> None:
    """Stream the per-layer statistics files into one safetensors file, one tensor in memory at a time."""
    from safetensors import safe_open

    from ..formats.checkpoint import ST_DTYPES, TensorInfo
    from ..formats.writer import ShardLayout, ShardWriter

    infos = []
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                infos.append(TensorInfo(key, ST_DTYPES[sl.get_dtype()], tuple(sl.get_shape())))
    writer = ShardWriter(out.parent, ShardLayout([infos]), metadata=metadata)
    try:
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():
                    writer.write(key, fh.get_tensor(key))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    (out.parent / "model.safetensors").replace(out)
    for f in files:
        f.unlink()


def _load_stats(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        p = p / "calibration" / "stats.safetensors"
    if not p.is_file():
        raise MoeifyError(f"--stats {path}: no statistics file found", "pass OUT/calibration/stats.safetensors of an earlier run")
    try:
        return load_file(str(p))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
        raise MoeifyError(f"--stats {p} is not a readable safetensors file ({exc.__class__.__name__})") from None
