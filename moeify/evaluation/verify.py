"""`moeify verify OUT [--against SRC]`: is a converted checkpoint complete, consistent and faithful?

Cheap checks (headers only; `convert` runs them on its own output before committing it):
- config.json is a mixtral / qwen2_moe / qwen3_moe config, and every tensor it implies is in the shards with the right shape
  and dtype, nothing else is;
- the index agrees with the shard headers (every entry in the named file, every tensor indexed, total_size right,
  no stray shards);
- report.json (when present) has one entry per layer, dense where config.json says so, and a true permutation.

Full checks (read every tensor once): no NaN/Inf anywhere.

Against the source (`--against SRC`): moeify.evaluation.verify_carve for a converted output (the weights bit for
bit, the logits with every expert active), moeify.evaluation.verify_upcycle for an upcycled or merged one.

Written from the config, not from the converter's own tables, so a bug in one is not hidden by the other.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..formats.checkpoint import INDEX_NAME, CheckpointReader
from ..errors import MoeifyError
from .verify_carve import check_weights_against, compare_logits
from .verify_layout import MoeLayout, Progress, listed, read_layout, read_report, real_width

LOGIT_RTOL = 1e-3


@dataclass
class VerifyResult:
    path: Path
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # one line per check that ran
    skipped: list[str] = field(default_factory=list)  # one line per check that could not run, and why
    max_logit_diff: float | None = None
    logit_scale: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"path": str(self.path), "ok": self.ok, "problems": self.problems, "checked": self.checked,
                "skipped": self.skipped, "max_logit_diff": self.max_logit_diff, "logit_scale": self.logit_scale}


# ------------------------------------------------------------------------------------------- cheap checks


def check_structure(out: str | Path) -> tuple[list[str], MoeLayout | None, CheckpointReader | None]:
    """Config, index, shard headers and report.json, without reading tensor data. Returns (problems, layout, reader)."""
    out = Path(out)
    try:
        layout = read_layout(out)
    except MoeifyError as exc:
        return [str(exc)], None, None
    try:
        reader = CheckpointReader(out, allow_nonfinite=True)
    except MoeifyError as exc:
        return [str(exc)], layout, None
    problems = _check_index(out, reader) + _check_tensors(layout, reader) + _check_report(out, layout)
    return problems, layout, reader


def _check_index(out: Path, reader: CheckpointReader) -> list[str]:
    problems = []
    index_path = out / INDEX_NAME
    shards = {p.name for p in out.glob("*.safetensors")}
    if not index_path.is_file():
        return problems  # a single model.safetensors (the reader refuses several without an index)
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    for name, file in weight_map.items():
        got = reader.file_of.get(name)
        if got is None:
            problems.append(f"{INDEX_NAME} lists {name} in {file}, but that shard has no such tensor")
        elif got.name != file:
            problems.append(f"{INDEX_NAME} says {name} is in {file}, but it is in {got.name}")
    for name, path in reader.file_of.items():
        if name not in weight_map:
            problems.append(f"tensor {name} in {path.name} is not in {INDEX_NAME}")
    total = index.get("metadata", {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
    actual = sum(t.nbytes for t in reader.tensors.values())
    if total is not None and total != actual:
        problems.append(f"{INDEX_NAME} metadata total_size is {total}, the shards hold {actual} bytes of tensors")
    for stray in sorted(shards - set(weight_map.values())):
        problems.append(f"{stray} is not referenced by {INDEX_NAME} (a stray shard: loaders ignore it)")
    return listed(problems, "index problems")


def _check_tensors(layout: MoeLayout, reader: CheckpointReader) -> list[str]:
    problems = []
    dtypes = {t.dtype for t in reader.tensors.values()}
    if layout.dtype is None and len(dtypes) > 1:
        problems.append(f"tensors have mixed dtypes {sorted(map(str, dtypes))} and config.json names none")
    for name, shape in layout.shapes.items():
        info = reader.tensors.get(name)
        if info is None:
            problems.append(f"tensor {name} is missing (config.json implies shape {list(shape)})")
        elif info.shape != shape:
            problems.append(f"tensor {name} has shape {list(info.shape)}, config.json implies {list(shape)}")
        elif layout.dtype is not None and info.dtype != layout.dtype:
            problems.append(f"tensor {name} has dtype {info.dtype}, config.json says {layout.dtype}")
    extra = [n for n in reader.tensors if n not in layout.shapes and not (layout.tied and n == "lm_head.weight")]
    problems += [f"tensor {n} is in {reader.file_of[n].name} but config.json implies no such tensor" for n in extra]
    return listed(problems, "tensor problems")


def _check_report(out: Path, layout: MoeLayout) -> list[str]:
    try:
        report = read_report(out)
    except MoeifyError as exc:
        return [str(exc)]
    if report is None:
        return []
    layers = report["layers"]
    if report.get("construction") in ("upcycle", "merge"):
        from .verify_upcycle import check_report

        return check_report(report, layout.n_layers, layout.n_experts, layout.top_k)
    problems = []
    if [entry.get("layer") if isinstance(entry, dict) else None for entry in layers] != list(range(layout.n_layers)):
        return [f"report.json lists layers that are not 0..{layout.n_layers - 1} in order"]
    width = real_width(report, layout)
    if width > layout.expert_width:
        return [f"report.json expert_width {width} is wider than config.json's expert width {layout.expert_width}"]
    d_ff = layout.n_experts * width + layout.shared_width
    for entry in layers:
        i = entry["layer"]
        if bool(entry.get("dense")) != layout.is_dense(i):
            problems.append(f"report.json says layer {i} is {'dense' if entry.get('dense') else 'MoE'}, "
                            f"config.json says {'dense' if layout.is_dense(i) else 'MoE'}")
            continue
        if entry.get("dense"):
            continue
        perm = entry.get("perm")
        if not isinstance(perm, list) or sorted(perm) != list(range(d_ff)):
            problems.append(f"report.json layer {i}: 'perm' is not a permutation of the {d_ff} neurons")
        elif entry.get("shared_neurons", 0) != layout.shared_width:
            problems.append(f"report.json layer {i}: {entry.get('shared_neurons')} shared neurons, "
                            f"config.json says {layout.shared_width}")
    return listed(problems, "report problems")


# ------------------------------------------------------------------------------------------------ full checks


def check_values(reader: CheckpointReader, progress: Progress | None = None) -> list[str]:
    """Read every tensor once (shard by shard); list those with NaN/Inf."""
    names = sorted(reader.tensors, key=lambda n: (str(reader.file_of[n]), n))
    for done, name in enumerate(names, 1):
        reader.get(name)
        if progress:
            progress("checking values", done, len(names))
    reader.close()
    return listed([f"tensor {n} has {c} NaN/Inf value(s)" for n, c in reader.nonfinite.items()], "non-finite tensors")


# ------------------------------------------------------------------------------------------------ entry point


def verify_checkpoint(out: str | Path, against: str | Path | None = None, *, values: bool = True,
                      logits: bool = True, allow_pickle: bool = False, seq_len: int = 16,
                      progress: Progress | None = None) -> VerifyResult:
    """Run the checks; problems are collected, not raised. MoeifyError only when OUT cannot be examined at all."""
    out = Path(out)
    if not out.is_dir():
        raise MoeifyError(f"{out} is not a directory", "pass the output directory of moeify convert")
    result = VerifyResult(out)
    problems, layout, reader = check_structure(out)
    result.problems += problems
    if layout is None or reader is None:
        return result
    result.checked.append(f"config.json, index and shard headers: {len(reader.tensors)} tensors, "
                          f"{len(set(reader.file_of.values()))} shard(s)")
    if values:
        result.problems += check_values(reader, progress)
        result.checked.append("every tensor read: no NaN/Inf" if not reader.nonfinite else "every tensor read")
    if against is None:
        return result
    if problems:
        result.skipped.append(f"comparison with {against}: skipped because the structure checks failed")
        return result
    against = Path(against)
    report = read_report(out) or {}
    if report.get("construction") in ("upcycle", "merge"):
        return _verify_upcycle(result, out, against, report, layout, reader, logits, allow_pickle, seq_len, progress)
    diffs, skipped = check_weights_against(out, layout, reader, against, allow_pickle=allow_pickle, progress=progress)
    result.problems += diffs
    result.skipped += skipped
    result.checked.append(f"weights against {against}: non-FFN tensors and un-permuted experts bit for bit")
    if not logits:
        return result
    if any(entry.get("compensated") or entry.get("tuned") for entry in report.get("layers", [])):
        result.skipped.append("logits: FFN weights were refit (--compensate) or tuned (--fit-epochs / --tune-tokens), so the MoE model "
                              "is not the dense one by design; not compared")
        return result
    diff, scale = compare_logits(out, against, layout, report, seq_len=seq_len)
    result.max_logit_diff, result.logit_scale = diff, scale
    tol = LOGIT_RTOL * max(scale, 1e-6)
    if not math.isfinite(diff) or diff > tol:
        result.problems.append(f"logits with every expert active differ from {against}'s by {diff:.3g} "
                               f"(allowed {tol:.3g} = {LOGIT_RTOL:g} × max |logit| {scale:.3g})")
    result.checked.append(f"logits, all {layout.n_experts} experts active, float32: max |diff| {diff:.3g} "
                          f"(≤ {tol:.3g})")
    return result


def _verify_upcycle(result: VerifyResult, out: Path, against: Path, report: dict, layout: MoeLayout,
                    reader: CheckpointReader, logits: bool, allow_pickle: bool, seq_len: int,
                    progress: Progress | None) -> VerifyResult:
    """An upcycled output against its source (moeify.evaluation.verify_upcycle)."""
    from .verify_upcycle import EXACT_SYMMETRY, check_against, compare_logits as streamed_logits, logits_problem

    dtype = layout.dtype or reader.tensors["model.embed_tokens.weight"].dtype
    problems, checked, skipped = check_against(out, against, report, layout.fmt, dtype, reader,
                                               allow_pickle=allow_pickle, progress=progress)
    result.problems += listed(problems, "differences")
    result.checked += checked
    result.skipped += skipped
    if not logits:
        return result
    if report.get("construction") == "merge" or report.get("settings", {}).get("symmetry") not in EXACT_SYMMETRY:
        result.skipped.append("logits: the experts differ from the source's FFN by design (a merge, or copies made "
                              "to differ on purpose); not compared")
        return result
    diff, scale = streamed_logits(out, against, seq_len=seq_len)
    result.max_logit_diff, result.logit_scale = diff, scale
    problem = logits_problem(diff, scale, LOGIT_RTOL, against)
    if problem:
        result.problems.append(problem)
    result.checked.append(f"logits, top-{layout.top_k} of {layout.n_experts} routed as written, float32, a decoder "
                          f"layer at a time: max |diff| {diff:.3g}")
    return result


__all__ = ["VerifyResult", "MoeLayout", "read_layout", "check_structure", "check_values", "check_weights_against",
           "compare_logits", "verify_checkpoint", "LOGIT_RTOL"]
