"""The pipeline: plan (config + headers only, every check up front) -> per layer carve -> stream out -> verify.

Only this module touches both the reader and the writer.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from ..version import __version__
from ..maths.budget import Budget, carve_budget, padded_width
from ..formats.checkpoint import DTYPE_NAMES, SPILL_DIR, CheckpointReader, TensorInfo, check_links
from ..formats.config import ConvertConfig, config_to_dict, config_to_toml
from ..errors import MoeifyError
from ..maths.numerics import release_memory
from .carve import CarvedLayer, carve_weight_only
from ..formats.experts import ffn_output_tensors
from ..maths.router import SHARED_GATE_MIN, shared_gate_value
from ..formats.families import (TOKENIZER_FILES, SourceModel, attention_infos, check_source_tensors,
                       ffn_tensor_names, load_source, target_format, target_config)
from ..maths.partition import valid_expert_counts
from ..formats.output import LOCK_NAME, commit_output, staged_output, write_metadata, write_shards
from ..formats.writer import ShardLayout, ShardWriter, write_attention, write_head

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class ConversionPlan:
    src: SourceModel
    cfg: ConvertConfig
    fmt: str
    out_dtype: torch.dtype
    expert_width: int  # neurons per routed expert
    shared_width: int
    tied_out: bool  # whether the output keeps tie_word_embeddings
    tensors: list[TensorInfo]  # output tensors in write order
    layout: ShardLayout
    config_json: dict
    budget: Budget
    reader: CheckpointReader = field(repr=False)

    @property
    def padded_width(self) -> int:
        return padded_width(self.expert_width, self.cfg.pad_experts_to)

    @property
    def output_bytes(self) -> int:
        return self.layout.total_bytes()

    @property
    def engine_notes(self):
        """What transformers, vLLM and llama.cpp say of this layout (moeify.formats.engines)."""
        from ..formats.engines import engine_notes

        s = self.src
        n_dense = len(self.cfg.dense_layers) or self.cfg.dense_auto
        return engine_notes(self.fmt, self.cfg.top_k, self.cfg.experts, self.shared_width, self.padded_width,
                            self.tied_out, n_dense, s.head_dim, s.hidden, s.heads, s.qkv_bias)

    def tuning_memory(self):
        """(moeify.maths.memory.TuneMemory, device, the device's memory or None) of this plan's recovery tuning."""
        from ..maths.numerics import tuning_autocast
        from ..maths.memory import choose_offload, device_memory, source_tuning_memory
        from ..maths.numerics import resolve_device

        dev = resolve_device(self.cfg.device)
        seq = min(self.cfg.calib_seq_len, int(self.src.raw.get("max_position_embeddings") or self.cfg.calib_seq_len))
        kw = dict(seq=seq, bf16=tuning_autocast(dev, "auto")[1], train_attention=self.cfg.tune_attention)
        dense = len(self.cfg.dense_layers) or self.cfg.dense_auto
        have = device_memory(dev)
        plain, offloaded = (source_tuning_memory(self.src, self.cfg.experts, dense, device=dev, offload=o, **kw)
                            for o in (False, True))
        return (offloaded if choose_offload(plain, offloaded, dev, have) else plain), dev, have  # as `tune` will

    def summary(self) -> dict:
        """The plan as `convert --dry-run --json` writes it: settings, widths, budget, output size, serving fit."""
        from ..evaluation.planning import serving_json

        b = self.budget
        return {"source": str(self.src.path), "format": self.fmt, "output_dtype": str(self.out_dtype).removeprefix("torch."),
                "settings": config_to_dict(self.cfg),
                "expert_width": self.expert_width, "padded_expert_width": self.padded_width,
                "shared_width": self.shared_width, "total_params": b.total_params, "active_params": b.active_params,
                "ffn_flops_ratio": b.flops_ratio, "output_bytes": self.output_bytes, "shards": len(self.layout.files),
                "serving": serving_json(self.padded_width),
                "tuning_memory": (self.tuning_memory()[0].to_dict()
                                  if self.cfg.tune_tokens and self.cfg.top_k < self.cfg.experts else None),
                "engines": [{"engine": n.engine, "fails": n.fails, "what": n.what, "fix": n.fix}
                            for n in self.engine_notes]}


def plan_conversion(src_path: str | Path, cfg: ConvertConfig, *, allow_pickle: bool = False,
                    allow_nonfinite: bool = False, force: bool = False) -> ConversionPlan:
    """Read config and shard headers only; check everything that can be checked before heavy work.

    allow_pickle: read pytorch_model*.bin weights (torch.load(weights_only=True)) when there are no safetensors.
    allow_nonfinite: convert tensors with NaN/Inf (recorded in plan.reader.nonfinite) instead of refusing them.
    force: plan a layout that an engine named in cfg.targets cannot run (otherwise an error).
    """
    cfg.validate()
    src = load_source(src_path)
    check_links(src.path, ("config.json", *TOKENIZER_FILES))
    reader = CheckpointReader(src.path, allow_pickle=allow_pickle, allow_nonfinite=allow_nonfinite)
    check_source_tensors(src, reader.tensors)
    fmt = target_format(src, cfg.format, shared=cfg.shared > 0,
                        dense_layers=bool(cfg.dense_layers or cfg.dense_auto), shared_fix=_qwen3_layout_hint(src, cfg) if src.qk_norm and cfg.shared else "")

    units = cfg.experts + cfg.shared
    if src.d_ff % units:
        valid = [n for n in range(1, src.d_ff + 1) if src.d_ff % (n + cfg.shared) == 0 and n <= 256]
        raise MoeifyError(
            f"--experts {cfg.experts} with --shared {cfg.shared} does not divide intermediate_size {src.d_ff} "
            f"into {units} equal experts",
            f"valid --experts for --shared {cfg.shared}: {', '.join(map(str, valid[:40]))}",
        )
    width = src.d_ff // units
    bad = [i for i in cfg.dense_layers if i >= src.n_layers]
    if bad:
        raise MoeifyError(f"--dense-layers {bad[0]} is out of range: the model has {src.n_layers} layers (0..{src.n_layers - 1})")
    if len(cfg.dense_layers) == src.n_layers:
        raise MoeifyError("--dense-layers lists every layer: nothing would be converted")

    out_dtype = DTYPE_NAMES[cfg.dtype] if cfg.dtype != "auto" else reader.tensors["model.embed_tokens.weight"].dtype
    plan = _derive_plan(src, reader, cfg, fmt, width, out_dtype)
    from ..formats.engines import refuse_blocked

    refuse_blocked(plan.engine_notes, cfg.targets, force)
    return plan


def _qwen3_layout_hint(src: SourceModel, cfg: ConvertConfig) -> str:
    """The flags of the same active share without a shared expert (Qwen3-MoE has none), within llama.cpp's top-k."""
    from ..formats.engines import same_share_layout

    share = (cfg.top_k + cfg.shared) / (cfg.experts + cfg.shared)
    n, k = same_share_layout(src.d_ff, share)
    return (f"pass --format qwen3_moe --shared 0 --experts {n} --top-k {k} (the same {share:.0%} active, within "
            "llama.cpp's top-k)")


def _derive_plan(src: SourceModel, reader: CheckpointReader, cfg: ConvertConfig, fmt: str, width: int,
                 out_dtype: torch.dtype) -> ConversionPlan:
    """Everything that follows from the settings: output tensors, shard layout, config.json, budget."""
    tied_out = src.tied and not cfg.untie_embeddings
    n_dense = len(cfg.dense_layers) or cfg.dense_auto
    tensors = _output_tensors(src, reader, fmt, cfg, width, out_dtype, tied_out)
    layout = ShardLayout.plan(tensors, cfg.max_shard_bytes)
    stored = padded_width(width, cfg.pad_experts_to)
    config_json = target_config(src, fmt, experts=cfg.experts, top_k=cfg.top_k, expert_width=stored,
                                shared_width=cfg.shared * width, dense_layers=cfg.dense_layers, dtype=out_dtype,
                                tied=tied_out)
    expected = src.expected_tensors()
    other = sum(math.prod(shape) for n, shape in expected.items() if ".mlp." not in n)
    budget = carve_budget(hidden=src.hidden, d_ff=src.d_ff, n_layers=src.n_layers, other_params=other,
                          experts=cfg.experts, top_k=cfg.top_k, expert_width=stored, shared_width=cfg.shared * width,
                          dense_layers=n_dense)  # zero padding is stored and computed: counted
    return ConversionPlan(src, cfg, fmt, out_dtype, width, cfg.shared * width, tied_out, tensors, layout, config_json,
                          budget, reader)


def with_dense_layers(plan: ConversionPlan, layers: tuple[int, ...]) -> ConversionPlan:
    """The same plan with the FFNs of `layers` kept dense (used by --dense-layers auto:M after calibration)."""
    cfg = dataclasses.replace(plan.cfg, dense_layers=tuple(sorted(layers)), dense_auto=0)
    return _derive_plan(plan.src, plan.reader, cfg, plan.fmt, plan.expert_width, plan.out_dtype)


def _output_tensors(src: SourceModel, reader: CheckpointReader, fmt: str, cfg: ConvertConfig, width: int,
                    dtype: torch.dtype, tied_out: bool) -> list[TensorInfo]:
    h = src.hidden
    out = [TensorInfo("model.embed_tokens.weight", dtype, (src.vocab, h))]
    for i in range(src.n_layers):
        out += attention_infos(src, reader.tensors, fmt, i, dtype)
        dense = i in cfg.dense_layers
        for name in ffn_tensor_names(fmt, i, cfg.experts, dense, shared=cfg.shared > 0):
            out.append(TensorInfo(name, dtype, _ffn_shape(name, src, cfg, width, dense)))
    out.append(TensorInfo("model.norm.weight", dtype, (h,)))
    if not tied_out:
        out.append(TensorInfo("lm_head.weight", dtype, (src.vocab, h)))
    return out


def _ffn_shape(name: str, src: SourceModel, cfg: ConvertConfig, width: int, dense: bool) -> tuple[int, ...]:
    h = src.hidden
    if name.endswith("shared_expert_gate.weight"):
        return (1, h)
    if name.endswith(".gate.weight"):
        return (cfg.experts, h)
    if dense:
        w = src.d_ff
    else:
        w = cfg.shared * width if ".shared_expert." in name else padded_width(width, cfg.pad_experts_to)
    return (h, w) if name.endswith(("w2.weight", "down_proj.weight")) else (w, h)


# ------------------------------------------------------------------------------------------------ running


def run_conversion(plan: ConversionPlan, out: str | Path, *, overwrite: bool = False,
                   progress: Progress | None = None, memory_check: bool = True) -> dict:
    """Carve every layer and write OUT atomically. Returns the report (also written to OUT/report.json).

    With calibration, a first pass runs the calibration tokens through the model layer by layer and carves
    each layer (refit down_proj spilled to OUT's temporary directory); the second pass streams the output.
    With --tune-tokens the carve is written to OUT.moeify-tune/carved instead of OUT, and the tuning stage
    (moeify.tuning, the code `moeify tune` runs) tunes it and writes OUT; an interrupted tuning resumes there.
    """
    from ..tuning import options_from_config, refuse_leftover_state, state_dir, tune_output

    out = Path(out)
    src = plan.src
    tune = bool(plan.cfg.tune_tokens) and plan.cfg.top_k < plan.cfg.experts
    refuse_leftover_state(out, src.path, overwrite)
    if tune and memory_check:  # before calibration, not after it
        from ..maths.memory import check_fits

        mem, dev, have = plan.tuning_memory()
        check_fits(mem, dev, have, src, plan.cfg.experts, len(plan.cfg.dense_layers) or plan.cfg.dense_auto,
                   min(plan.cfg.calib_seq_len, int(src.raw.get("max_position_embeddings") or plan.cfg.calib_seq_len)))
    spill = src.n_layers * src.hidden * src.d_ff * plan.out_dtype.itemsize if plan.cfg.compensate else 0
    # tuning holds the carve and writes the tuned output beside it
    with staged_output(out, overwrite, src.path, plan.output_bytes * (2 if tune else 1) + spill) as tmp:
        try:
            plan, report = _write_carve(plan, tmp, progress)
        finally:
            plan.reader.close()
        if tune:
            carved_dir = state_dir(out) / "carved"
            carved_dir.parent.mkdir(parents=True, exist_ok=True)
            (tmp / LOCK_NAME).unlink(missing_ok=True)
            tmp.rename(carved_dir)
        else:
            commit_output(tmp, out)
    if tune:
        release_memory()
        report = tune_output(src.path, out, options_from_config(plan.cfg), base=state_dir(out) / "carved",
                             device=plan.cfg.device, progress=progress, memory_check=False)  # checked above
    return report


def _write_carve(plan: ConversionPlan, tmp: Path, progress: Progress | None) -> tuple[ConversionPlan, dict]:
    """Calibrate and carve, and write the carve into the temporary directory `tmp`, checked. Returns the plan (its
    dense layers fixed by calibration) and the report."""
    t0 = time.time()
    carved: dict[int, CarvedLayer] = {}
    calib_info = {}
    if plan.cfg.needs_calibration:
        from .calibrate import calibrate_and_carve

        carved, calib_info, _ = calibrate_and_carve(plan, tmp, progress)
        if plan.cfg.dense_auto:
            plan = with_dense_layers(plan, calib_info["dense_layers"])
    layers_report = write_shards(tmp, plan.layout, lambda writer: _write_tensors(plan, writer, carved, tmp, progress))
    plan.reader.close()
    shutil.rmtree(tmp / SPILL_DIR, ignore_errors=True)
    report = _write_metadata(plan, tmp, layers_report, time.time() - t0, calib_info)
    _verify_structure(tmp)
    return plan, report


def _write_tensors(plan: ConversionPlan, writer: ShardWriter, carved: dict[int, CarvedLayer], tmp: Path,
                   progress: Progress | None) -> list[dict]:
    src, cfg, dtype, reader = plan.src, plan.cfg, plan.out_dtype, plan.reader
    layers_report = []
    # A reader thread reads the next layer while this one is carved and the writer thread writes the last one,
    # so the disk never waits for the clustering; one layer is read ahead (memory stays bounded).
    reader.prefetch(reader.layer_tensors(0))
    writer.write("model.embed_tokens.weight", reader.get("model.embed_tokens.weight").to(dtype))
    for i in range(src.n_layers):
        p = f"model.layers.{i}."
        if i + 1 < src.n_layers:
            reader.prefetch(reader.layer_tensors(i + 1))
        attn_file = tmp / SPILL_DIR / f"{i}.attention.safetensors"  # tuned (--tune-attention)
        tuned_attn = load_file(str(attn_file)) if attn_file.is_file() else {}
        write_attention(writer, reader, src, plan.fmt, i, dtype, tuned_attn)
        gate, up, down = (reader.get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
        if i in cfg.dense_layers:
            for name, t in zip(ffn_tensor_names(plan.fmt, i, cfg.experts, True, cfg.shared > 0), (gate, up, down)):
                writer.write(name, t.to(dtype))
            layers_report.append({"layer": i, "dense": True, **(carved[i].metrics if i in carved else {}),
                                  **({"attention_tuned": True} if tuned_attn else {})})
        else:
            norm = reader.get(p + "post_attention_layernorm.weight")
            layer = carved.get(i) or carve_weight_only(gate, up, down, norm, cfg)
            if layer.spilled:  # refit / tuned weights made during calibration
                new = load_file(str(tmp / SPILL_DIR / f"{i}.safetensors"))
                gate, up, down = new.get("gate", gate), new.get("up", up), new.get("down", down)
            # k = N: as close to exactly 1/2 as llama.cpp allows (its sigmoid is NaN at 0), like the zero router
            tol = cfg.gate_tolerance if cfg.top_k < cfg.experts else 0.0
            shared_gate = (SHARED_GATE_MIN if tol == 0 else shared_gate_value(norm, tol)) if plan.fmt == "qwen2_moe" else None
            tensors = ffn_output_tensors(plan.fmt, i, layer.part, layer.router * layer.scale, gate, up, down, cfg, dtype,
                                         shared_gate)
            for name, t in tensors.items():
                writer.write(name, t)
            extra = ({} if shared_gate is None else {"shared_gate": shared_gate}) | (
                {"attention_tuned": True} if tuned_attn else {})
            layers_report.append({"layer": i, "dense": False, **layer.report(), **extra})
        del gate, up, down
        if progress:
            progress("writing", i + 1, src.n_layers)
    write_head(writer, reader, src, plan.tied_out, dtype)
    return layers_report


def _write_metadata(plan: ConversionPlan, tmp: Path, layers_report: list[dict], seconds: float,
                    calib_info: dict) -> dict:
    provenance = {"moeify_version": __version__, "source": str(plan.src.path), "format": plan.fmt,
                  "expert_width": plan.expert_width, "padded_expert_width": plan.padded_width,
                  "shared_width": plan.shared_width,
                  "output_dtype": str(plan.out_dtype).removeprefix("torch.")}
    if calib_info:
        provenance["calib_tokens_used"] = calib_info["tokens"]
    b = plan.budget
    report = {**provenance, "settings": config_to_dict(plan.cfg),
              "total_params": b.total_params, "active_params": b.active_params, "ffn_flops_ratio": b.flops_ratio,
              "seconds": round(seconds, 3), "calibration": calib_info, "layers": layers_report}
    write_metadata(tmp, plan.src.path, report=report, toml=config_to_toml(plan.cfg, provenance),
                   config_json=plan.config_json)
    return report


def _verify_structure(out_dir: Path) -> None:
    """The cheap part of `moeify verify` (config, index, headers, report.json) on the output before committing it."""
    from ..evaluation.verify import check_structure

    problems, _, _ = check_structure(out_dir)
    if problems:
        raise RuntimeError("output check failed: " + "; ".join(problems))


__all__ = ["ConversionPlan", "plan_conversion", "run_conversion", "valid_expert_counts"]
