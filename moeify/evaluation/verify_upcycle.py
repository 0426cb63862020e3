"""`moeify verify OUT --against SRC` for an upcycled output (report.json `construction = "upcycle"`).

Written from the files, not from the upcycler's code:
- every non-FFN tensor equals the source's, cast to the output dtype, bit for bit (q/k/v biases added for a Llama
  source are zero);
- with the copies as made (symmetry none or permute): each copy's G slices hold the source's routed neurons, each
  once (gate/up rows and down columns / G matched row by row, in any order), and the shared expert (Qwen2-MoE) the
  neurons report.json names, down_proj × 2; the router rows of one copy's slices are equal (the "virtual group"
  that keeps a copy whole);
- logits: the source and the output streamed one decoder layer at a time (moeify.evaluation.layerwise), the MoE with its own
  top-k routing as written: max |logit difference| ≤ rtol × max |source logit|.
Outputs whose copies were made to differ on purpose (symmetry drop or noise) are not the source by design: their
expert values and logits are skipped and say so; everything else is still checked.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..formats.checkpoint import CheckpointReader
from ..formats.families import check_source_tensors, load_source

EXACT_SYMMETRY = ("none", "permute")


def check_report(report: dict, n_layers: int, n_experts: int, top_k: int) -> list[str]:
    """report.json of an upcycle against config.json."""
    problems = []
    if [e.get("layer") if isinstance(e, dict) else None for e in report["layers"]] != list(range(n_layers)):
        return [f"report.json lists layers that are not 0..{n_layers - 1} in order"]
    copies, g = report.get("copies"), report.get("granularity")
    if not isinstance(copies, int) or not isinstance(g, int) or copies * g != n_experts:
        problems.append(f"report.json: {copies} copies × granularity {g} is not config.json's {n_experts} experts")
    elif top_k % g:
        problems.append(f"config.json top-k {top_k} is not a multiple of the granularity {g}: a token would get part "
                        "of a copy")
    return problems


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same rows bit for bit, in any order."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ua, ca = torch.unique(_bits(a), dim=0, return_counts=True)  # sorted distinct rows and how often each occurs
    ub, cb = torch.unique(_bits(b), dim=0, return_counts=True)
    return ua.shape == ub.shape and torch.equal(ua, ub) and torch.equal(ca, cb)


def check_against(out: Path, src_path: Path, report: dict, fmt: str, dtype: torch.dtype, reader: CheckpointReader,
                  *, allow_pickle: bool = False, progress=None) -> tuple[list[str], list[str], list[str]]:
    """(problems, checked, skipped) of the weights against the source."""
    from ..formats.families import ffn_tensor_names

    source = load_source(src_path)
    src_reader = CheckpointReader(source.path, allow_pickle=allow_pickle, allow_nonfinite=True)
    check_source_tensors(source, src_reader.tensors)
    copies, g = report["copies"], report["granularity"]
    shared_w = report.get("shared_width", 0)
    problems, checked, skipped = [], [], []
    if source.n_layers != len(report["layers"]) or source.hidden != reader.tensors["model.norm.weight"].shape[0]:
        return [f"{out} does not fit {src_path}: different layer count or hidden size"], checked, skipped

    def same(name: str, src_name: str | None = None) -> None:
        want = src_reader.get(src_name or name).to(dtype)
        got = reader.get(name)
        if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            problems.append(f"tensor {name} differs from the source's {src_name or name}")

    merge = report.get("construction") == "merge"
    exact = report.get("settings", {}).get("symmetry", "none") in EXACT_SYMMETRY and not merge
    base_parts = report.get("attention", "base") == "base"  # a merge's averaged attention is no source's
    if not base_parts:
        same = lambda name, src_name=None: None  # noqa: E731
        skipped.append("attention, norms and embeddings: the sources' average (a merge's --attention average), "
                       "not compared")
    same("model.embed_tokens.weight")
    for i in range(source.n_layers):
        p = f"model.layers.{i}."
        for name in (t + ".weight" for t in source.attention_tensors):
            same(p + name)
        for b in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
            name = p + "self_attn." + b
            if name in reader.tensors:
                if source.qkv_bias:
                    same(name)
                elif reader.get(name).count_nonzero():
                    problems.append(f"tensor {name} should be all zeros (added only for the format)")
        names = ffn_tensor_names(fmt, i, copies * g, dense=False, shared=shared_w > 0)
        router = reader.get(names[0]).float()
        if not torch.equal(router.view(copies, g, -1), router.view(copies, g, -1)[:, :1].expand(-1, g, -1)):
            problems.append(f"tensor {names[0]}: the router rows of a copy's {g} slices are not equal (a token could get "
                            "part of a copy)")
        if exact:
            problems += _check_copies(reader, src_reader, p, names, report["layers"][i], copies, g, shared_w, dtype)
        if progress:
            progress("comparing with the source", i + 1, source.n_layers)
    same("model.norm.weight")
    if "lm_head.weight" in reader.tensors:
        same("lm_head.weight", "model.embed_tokens.weight" if source.tied else "lm_head.weight")
    checked.append(f"weights against {src_path}: " + ("non-FFN tensors bit for bit, " if base_parts else "")
                   + "routers grouped by copy" + (", every copy the source's neurons bit for bit" if exact else ""))
    if merge:
        skipped.append("expert values: a merge's experts are its sources' FFNs, not the base's")
    elif not exact:
        skipped.append(f"expert values: the copies were made to differ on purpose (symmetry "
                       f"{report['settings']['symmetry']}), so they are not the source's by design")
    src_reader.close()
    return problems, checked, skipped


def _check_copies(reader, src_reader, p: str, names: list[str], entry: dict, copies: int, g: int, shared_w: int,
                  dtype) -> list[str]:
    gate, up, down = (src_reader.get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
    shared = torch.tensor(entry.get("shared_neurons", []), dtype=torch.long)
    keep = torch.ones(gate.shape[0], dtype=torch.bool)
    keep[shared] = False
    routed = torch.nonzero(keep).flatten()
    want_down = (down[:, routed].float() * g).to(dtype).T  # columns as rows, × G as written
    problems = []
    for e in range(copies):
        parts = [names[1 + 3 * (e * g + s): 4 + 3 * (e * g + s)] for s in range(g)]
        for k, (label, want) in enumerate((("gate", gate[routed].to(dtype)), ("up", up[routed].to(dtype)))):
            got = torch.cat([reader.get(part[k]) for part in parts])
            if not _same_rows(got, want):
                problems.append(f"{p}: copy {e}'s {label} rows are not the source's routed neurons")
        got = torch.cat([reader.get(part[2]) for part in parts], dim=1).T
        if not _same_rows(got, want_down):
            problems.append(f"{p}: copy {e}'s down columns are not the source's routed neurons × {g}")
    if shared_w:
        m = p + "mlp.shared_expert."
        for n, want in (("gate_proj", gate[shared]), ("up_proj", up[shared]),
                        ("down_proj", (down[:, shared].float() * 2))):
            if not torch.equal(_bits(reader.get(m + n + ".weight")), _bits(want.to(dtype))):
                problems.append(f"tensor {m}{n}.weight is not the source's shared neurons of report.json")
    return problems


@torch.no_grad()
def compare_logits(out: Path, src_path: Path, seq_len: int = 16, seed: int = 0) -> tuple[float, float]:
    """(max |logit diff|, max |source logit|): both streamed a decoder layer at a time, the MoE routing as written."""
    from .layerwise import max_logit_diff, moe_stack, source_stack, stream_hidden

    source = load_source(src_path)
    src_reader, out_reader = CheckpointReader(source.path), CheckpointReader(out)
    dtype = out_reader.tensors["model.embed_tokens.weight"].dtype
    dense, moe = source_stack(source, src_reader, dtype), moe_stack(out, out_reader)
    ids = torch.randint(0, source.vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    finals = stream_hidden([dense, moe], ids)
    result = max_logit_diff(dense, finals[0], moe, finals[1])
    src_reader.close()
    out_reader.close()
    return result


def logits_problem(diff: float, scale: float, rtol: float, against: Path) -> str | None:
    tol = rtol * max(scale, 1e-6)
    if not math.isfinite(diff) or diff > tol:
        return (f"logits with the routing as written differ from {against}'s by {diff:.3g} (allowed {tol:.3g} = "
                f"{rtol:g} × max |logit| {scale:.3g})")
    return None


__all__ = ["check_report", "check_against", "compare_logits", "logits_problem", "EXACT_SYMMETRY"]
