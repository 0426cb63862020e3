"""The output being tuned (the base) and the tuned output written from it.

read_output reads what a moeify output says of itself (moeify.toml, report.json with each layer's neuron permutation,
config.json); check_source refuses a source that is not the dense model the output was carved from, before any work;
write_tuned writes the tuned output in the base's own shard layout (the base's tensors, with the student's experts,
routers and, where trained, attention), with the tuning run added to its report.json and moeify.toml.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats.checkpoint import CheckpointReader
from ..formats.output import write_metadata, write_shards
from ..formats.writer import ShardLayout
from ..formats.config import ConvertConfig, build_config, config_to_toml
from ..errors import MoeifyError
from ..formats.families import BIAS_TENSORS, SourceModel, attention_tensors, ffn_tensor_names
from ..maths.partition import Partition

@dataclass
class BaseOutput:
    """What a moeify output says of itself: its settings, report (layers with their permutations) and config."""

    path: Path
    cfg: ConvertConfig
    provenance: dict
    report: dict
    config_json: dict

    @property
    def fmt(self) -> str:
        return self.report["format"]

    @property
    def runs(self) -> list[dict]:
        return list(self.report.get("tuning", {}).get("runs", []))


def read_output(path: Path) -> BaseOutput:
    path = Path(path)
    if not path.is_dir():
        raise MoeifyError(f"{path} is not a directory", "pass the output directory of an earlier `moeify convert`")
    missing = [n for n in ("moeify.toml", "report.json", "config.json") if not (path / n).is_file()]
    if missing:
        raise MoeifyError(f"{path} is not a moeify output (no {missing[0]})",
                          "`moeify tune` tunes what `moeify convert` wrote; convert the dense checkpoint first")
    try:
        report = json.loads((path / "report.json").read_text())
        config_json = json.loads((path / "config.json").read_text())
        toml = tomllib.loads((path / "moeify.toml").read_text())
        cfg = build_config(path / "moeify.toml")
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise MoeifyError(f"{path}: report.json, config.json or moeify.toml cannot be read ({exc})",
                          "the output is damaged; convert again") from None
    layers = report.get("layers")
    if not isinstance(layers, list) or not all(isinstance(e, dict) for e in layers):
        raise MoeifyError(f"{path}/report.json has no per-layer record", "the output is damaged; convert again")
    for e in layers:
        if not e.get("dense") and not isinstance(e.get("perm"), list):
            raise MoeifyError(f"{path}/report.json: layer {e.get('layer')} has no neuron permutation",
                              "outputs of moeify 0.1 before the permutation was recorded cannot be tuned; convert again")
    return BaseOutput(path, cfg, toml.get("provenance", {}), report, config_json)


SAMPLED_ROWS = 8  # rows of each large tensor check_source compares, spread evenly over it


def check_source(src: SourceModel, base: BaseOutput, out_reader: CheckpointReader) -> None:
    """Refuse, before any work, a source that is not the dense model the base output was carved from.

    The student is the source's own model with the output's experts in its FFNs: it shares the source's embeddings,
    attention, norms and head, while the tuned output keeps its own. So the source must have the output's shape
    (else the experts do not fit it: a layer or neuron index out of range) and the same weights outside the FFNs
    (else the experts would be tuned inside another model than the one they are written into, and the output would
    not compute what the student learned). A fine-tuned model of the same shape differs there: to distil towards it,
    carve it (`moeify convert FINETUNE OUT2`) and tune that. Compared bit for bit in the output's dtype (convert's
    cast of the source's tensors), on SAMPLED_ROWS rows of each matrix and whole norms: cheap at any model size.
    Layers whose attention an earlier run tuned are compared by shape only."""
    out, prov = base.path, base.provenance.get("source")
    hint = f"pass the dense checkpoint {out} was converted from" + (f" ({prov}, its moeify.toml says)" if prov else "")
    carved = [e for e in base.report["layers"] if not e.get("dense")]
    facts = [("layers", src.n_layers, len(base.report["layers"])),
             ("FFN width (intermediate_size)", src.d_ff, len(carved[0]["perm"]) if carved else src.d_ff)]
    facts += [(k, getattr(src, a), base.config_json.get(k)) for k, a in (
        ("hidden_size", "hidden"), ("vocab_size", "vocab"), ("num_attention_heads", "heads"),
        ("num_key_value_heads", "kv_heads"))]
    for what, theirs, ours in facts:
        if ours is not None and theirs != ours:
            raise MoeifyError(f"{src.path} is not the model {out} was carved from: its {what} is {theirs}, the "
                              f"output's {ours}", hint)
    tuned = {e["layer"] for e in base.report["layers"] if e.get("attention_tuned")}
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(src.n_layers) if i not in tuned for n in src.attention_tensors] + [
        f"model.layers.{i}.{n}.bias" for i in range(src.n_layers) for n in BIAS_TENSORS if src.qkv_bias]
    shapes = src.expected_tensors()
    with contextlib.closing(CheckpointReader(src.path)) as reader:
        for name in names:
            info = out_reader.tensors.get(name)
            if info is None or tuple(info.shape) != shapes[name]:
                ours = "missing" if info is None else list(info.shape)
                raise MoeifyError(f"{src.path} is not the model {out} was carved from: its {name} is "
                                  f"{list(shapes[name])}, the output's {ours}", hint)
            rows = shapes[name][0]
            picks = sorted({rows * k // SAMPLED_ROWS for k in range(SAMPLED_ROWS)}) if len(shapes[name]) > 1 else [None]
            dtype = out_reader.tensors[name].dtype
            for r in picks:
                if r is None:
                    ours, theirs = out_reader.get(name), reader.get(name).to(dtype)
                else:
                    ours, theirs = out_reader.get_rows(name, r, r + 1), reader.get_rows(name, r, r + 1).to(dtype)
                if not torch.equal(ours, theirs):
                    raise MoeifyError(f"{src.path} is not the model {out} was carved from: its {name} differs from "
                                      "the output's (another model of the same shape, e.g. a fine-tune?)",
                                      hint + "; to distil towards another model, carve that model and tune its output")


def _partition(entry: dict, cfg: ConvertConfig) -> Partition:
    return Partition(torch.tensor(entry["perm"], dtype=torch.long), int(entry["shared_neurons"]), cfg.experts,
                     int(entry["expert_sizes"][0]))


def _base_layout(reader: CheckpointReader) -> ShardLayout:
    """The base output's shard layout (files and the order of their tensors), to write the tuned output alike."""
    files: dict[str, list[str]] = {}
    for name in sorted(reader.tensors, key=reader.location):
        files.setdefault(reader.location(name)[0], []).append(name)
    return ShardLayout([[reader.tensors[n] for n in files[f]] for f in sorted(files)])


def write_tuned(base: BaseOutput, reader: CheckpointReader, student, tmp: Path, train_attention: bool,
                report: dict, toml_tuning: dict) -> None:
    """The tuned output in `tmp`: the base's tensors, with every carved layer's experts and router (and, when
    trained, attention and norms) taken from the student, in the base's shard layout; config, tokenizer, and the
    base's report.json / moeify.toml with the tuning history (its card drawn from them; evaluation.json measured the
    untuned model and is not kept)."""
    layout = _base_layout(reader)
    if layout.file_names() != sorted({reader.location(n)[0] for n in reader.tensors}):
        raise MoeifyError(f"{base.path}: its weight files are not named as moeify names them",
                          "tune an output written by moeify convert")

    def fill(writer) -> None:
        new: dict[str, torch.Tensor] = {}
        pending_layer = None
        for t in (t for f in layout.files for t in f):
            if t.name.startswith("model.layers.") and int(t.name.split(".")[2]) != pending_layer:
                pending_layer = int(t.name.split(".")[2])
                new = _student_layer(base, reader, student, pending_layer, train_attention)
            value = new.pop(t.name, None)
            writer.write(t.name, (reader.get(t.name) if value is None else value).to(t.dtype))

    write_shards(tmp, layout, fill, background=False)
    toml = config_to_toml(base.cfg, base.provenance)
    toml += "\n[tuning]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in toml_tuning.items()) + "\n"
    write_metadata(tmp, base.path, report=report, toml=toml, config_json=base.config_json)


def _student_layer(base: BaseOutput, reader: CheckpointReader, student, i: int,
                   train_attention: bool) -> dict[str, torch.Tensor]:
    """Layer i's tensors taken from the student, by output name: its experts and router in the base's format when
    carved, its attention and norms when trained."""
    from ..formats.experts import ffn_output_tensors
    from ..maths.moe_block import MaskedMoE

    cfg, fmt = base.cfg, base.fmt
    new: dict[str, torch.Tensor] = {}
    entry = base.report["layers"][i]
    mlp = student.model.layers[i].mlp
    if isinstance(mlp, MaskedMoE):
        out_dtype = reader.tensors[ffn_tensor_names(fmt, i, cfg.experts, False, cfg.shared > 0)[1]].dtype
        new = ffn_output_tensors(fmt, i, _partition(entry, cfg), mlp.exported_router().float().cpu(),
                                 mlp.gate.detach().cpu(), mlp.up.detach().cpu(), mlp.down.detach().cpu(),
                                 cfg, out_dtype, entry.get("shared_gate", 0.0))
    if train_attention:
        for name in attention_tensors(student.config.model_type):
            new[f"model.layers.{i}.{name}.weight"] = student.get_submodule(f"model.layers.{i}.{name}").weight.detach().cpu()
    return new


def _check_written(tmp: Path, reader: CheckpointReader) -> None:
    written = CheckpointReader(tmp).tensors
    if {n: (t.shape, t.dtype) for n, t in written.items()} != {n: (t.shape, t.dtype) for n, t in reader.tensors.items()}:
        raise RuntimeError(f"output check failed: the tuned tensors in {tmp} differ in names, shapes or dtypes from the base")
    from ..evaluation.verify import check_structure

    problems, _, _ = check_structure(tmp)
    if problems:
        raise RuntimeError("output check failed: " + "; ".join(problems))


def _updated_report(base: BaseOutput, run: dict, opts) -> tuple[dict, dict]:
    """report.json and moeify.toml's tuning record after this run (opts: its TuneOptions): every run kept, each
    carved layer's list of tuned tensors grown by what this run trained."""
    train_router, train_attention = opts.train_router, opts.train_attention
    report = copy.deepcopy(base.report)
    report.get("calibration", {}).pop("tuning", None)
    runs = base.runs + [run]
    report["tuning"] = {"tokens": sum(r["tokens"] for r in runs), "seconds": round(sum(r["seconds"] for r in runs), 1),
                        "holdout_kl": run["holdout_kl_after"], "runs": runs}
    for entry in report["layers"]:
        if entry.get("dense"):
            if train_attention:
                entry["attention_tuned"] = True
            continue
        tuned = set(entry.get("tuned", [])) | ({"gate", "up", "down"} if opts.train_experts else set()) | (
            {"router"} if train_router else set())
        entry["tuned"] = [t for t in ("gate", "up", "down", "router") if t in tuned]
        if train_router:
            entry["router_scale"] = 1.0  # folded into the trained router rows
        if train_attention:
            entry["attention_tuned"] = True
    toml = {"tokens": report["tuning"]["tokens"], "runs": len(runs), "holdout_kl": round(run["holdout_kl_after"], 5),
            "seconds": report["tuning"]["seconds"]}
    return report, toml
