"""`moeify verify OUT --against SRC` of a converted (carved) output: its weights against the source's, bit for bit, and
the logits with every expert active. (An upcycle's or a merge's: moeify.evaluation.verify_upcycle.)

- every non-FFN tensor equals the source's, cast to the output dtype, bit for bit;
- for each MoE layer, the experts' gate/up rows un-permuted (report.json's `perm`) give back the source
  gate_proj/up_proj bit for bit, and each expert's down_proj is the source's columns times its factor
  (routed: k = top_k when the top-k weights are renormalised (mixtral, qwen3_moe), else N = the number of experts (qwen2_moe
  with norm_topk_prob false); qwen2_moe shared expert: 2), rounded once to the output dtype, bit for bit; added
  q/k/v biases are the source's (Qwen2) or zero (added for a Llama/Mistral) and the shared-expert gate is report.json's constant row; dense layers equal the source;
- logits: both models in float32 (the dense one rounded through the output dtype first), the MoE model with every
  expert active at exactly unit gates (router rows and shared-expert gate zeroed so every gate is 1/N and the shared
  gate 1/2, down_proj times N/k), on a short random input: max |logit difference| ≤ LOGIT_RTOL × max |dense logit|
  (moeify.evaluation.verify's).
  The reference's routed down_proj columns get the one rounding the converter cannot avoid (× k stored in the output
  dtype, exact for a power-of-two k; the bitwise check covers it), so this compares routing and structure, and is
  ~1e-6 when all is well.
Layers whose down_proj was refit (`--compensate`) or whose expert weights were tuned (`--fit-epochs`, report.json
`tuned`) are not the dense FFN by design: those tensors and the logits comparison are skipped and say so; the
structure, the untouched tensors and the permutation are still checked. Likewise a layer whose attention and norms
were tuned (`--tune-attention`, report.json `attention_tuned`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..formats.checkpoint import CheckpointReader
from .verify_layout import MoeLayout, Progress, listed, read_report, real_width


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN with the same payload; +0 != -0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def check_weights_against(out: Path, layout: MoeLayout, reader: CheckpointReader, src: Path, *,
                          allow_pickle: bool = False, progress: Progress | None = None) -> tuple[list[str], list[str]]:
    """Bit-for-bit comparison of OUT's tensors with the source's. Returns (problems, skipped notes)."""
    from ..formats.families import check_source_tensors, load_source

    report = read_report(out)
    if report is None:
        return [f"{out}/report.json is missing: without the permutations the experts cannot be compared with {src}"], []
    source = load_source(src)
    src_reader = CheckpointReader(source.path, allow_pickle=allow_pickle, allow_nonfinite=True)
    check_source_tensors(source, src_reader.tensors)
    d_ff = layout.n_experts * real_width(report, layout) + layout.shared_width
    if source.d_ff != d_ff or source.n_layers != layout.n_layers or source.hidden != layout.hidden:
        return [f"{out} does not fit {src}: source has {source.n_layers} layers, hidden {source.hidden}, d_ff "
                f"{source.d_ff}; output has {layout.n_layers} layers, hidden {layout.hidden}, d_ff {d_ff}"], []
    dtype = layout.dtype or reader.tensors["model.embed_tokens.weight"].dtype
    problems: list[str] = []
    skipped: list[str] = []

    def same_as_source(out_name: str, src_name: str | None = None) -> None:
        expected = src_reader.get(src_name or out_name).to(dtype)
        if not _same(reader.get(out_name), expected):
            problems.append(f"tensor {out_name} differs from the source's {src_name or out_name}")

    def is_zero(name: str) -> None:
        if reader.get(name).count_nonzero():
            problems.append(f"tensor {name} should be all zeros (moeify adds it only for the format)")

    same_as_source("model.embed_tokens.weight")
    for i, entry in enumerate(report["layers"]):
        p = f"model.layers.{i}."
        if entry.get("attention_tuned"):
            skipped.append(f"layer {i}: attention and norms tuned (--tune-attention), not compared with the source")
        else:
            for name in (n + ".weight" for n in source.attention_tensors):  # Qwen3's q/k norms too
                same_as_source(p + name)
        for name in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
            if p + "self_attn." + name in layout.shapes:  # a Qwen2 source's own biases; zeros added for a Llama's
                (same_as_source if source.qkv_bias else is_zero)(p + "self_attn." + name)
        src_g, src_u, src_d = (src_reader.get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
        if layout.is_dense(i):
            for n, t in (("gate", src_g), ("up", src_u), ("down", src_d)):
                if not _same(reader.get(p + f"mlp.{n}_proj.weight"), t.to(dtype)):
                    problems.append(f"tensor {p}mlp.{n}_proj.weight (a dense layer) differs from the source")
        else:
            problems += _check_moe_layer(layout, reader, i, entry, real_width(report, layout), src_g, src_u, src_d,
                                         dtype, skipped)
        if progress:
            progress("comparing with the source", i + 1, layout.n_layers)
    same_as_source("model.norm.weight")
    if "lm_head.weight" in layout.shapes:
        same_as_source("lm_head.weight", "model.embed_tokens.weight" if source.tied else "lm_head.weight")
    reader.close()
    src_reader.close()
    return listed(problems, "differences"), skipped


def _check_moe_layer(layout: MoeLayout, reader: CheckpointReader, i: int, entry: dict, w: int, src_g: torch.Tensor,
                     src_u: torch.Tensor, src_d: torch.Tensor, dtype: torch.dtype, skipped: list[str]) -> list[str]:
    """w: neurons per routed expert; the tensors may be padded beyond it with zero neurons."""
    perm = torch.tensor(entry["perm"], dtype=torch.long)
    n_shared = layout.shared_width
    m = f"model.layers.{i}.mlp."
    groups = []  # (gate name, up name, down name, neuron ids, down factor), in perm order
    if layout.fmt == "qwen2_moe":
        groups.append((m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight",
                       m + "shared_expert.down_proj.weight", perm[:n_shared], 2))
    for e in range(layout.n_experts):
        groups.append((*layout.expert_names(i, e), perm[n_shared + e * w: n_shared + (e + 1) * w],
                       layout.routed_factor))
    problems = []
    for e in range(layout.n_experts):  # zero padding neurons add silu(0) * 0 = 0
        g, u, d = layout.expert_names(i, e)
        if reader.get(g)[w:].count_nonzero() or reader.get(u)[w:].count_nonzero() or reader.get(d)[:, w:].count_nonzero():
            problems.append(f"layer {i} expert {e}: the padding neurons beyond the first {w} are not zero")
    inv = torch.argsort(perm)
    tuned = set(entry.get("tuned", ()))
    if tuned:
        names = ', '.join(t if t == "router" else f'{t}_proj' for t in sorted(tuned))
        skipped.append(f"layer {i}: {names} tuned (--fit-epochs / --tune-tokens), "
                       "not compared with the source")
    for kind, col in (("gate", 0), ("up", 1)):
        if kind in tuned:
            continue
        rebuilt = torch.cat([reader.get(g[col])[:len(g[3])] for g in groups])[inv]  # un-permute, source order
        if not _same(rebuilt, src_g.to(dtype) if kind == "gate" else src_u.to(dtype)):
            problems.append(f"layer {i}: the experts' {kind} rows un-permuted differ from the source {kind}_proj")
    if entry.get("compensated") and "down" not in tuned:
        skipped.append(f"layer {i}: down_proj was refit (--compensate), not compared with the source")
    elif "down" not in tuned:
        for _, _, d, idx, factor in groups:
            expected = (src_d[:, idx].float() * factor).to(dtype)
            if not _same(reader.get(d)[:, :len(idx)], expected):
                problems.append(f"tensor {d} is not the source down_proj columns × {factor}")
    if layout.fmt == "qwen2_moe":  # older outputs (no shared_gate in report.json) have a zero gate
        c = entry.get("shared_gate", 0.0)
        if not torch.equal(reader.get(m + "shared_expert_gate.weight").float(), torch.full((1, layout.hidden), float(c))):
            problems.append(f"tensor {m}shared_expert_gate.weight should be the constant row {c:g} of report.json "
                            "(sigmoid ~ 1/2 is what down_proj × 2 assumes)")
    return problems


# ------------------------------------------------------------------------------------------------ logits


@torch.no_grad()
def compare_logits(out: Path, src: Path, layout: MoeLayout, report: dict | None, *, seq_len: int = 16,
                   batch: int = 2, seed: int = 0) -> tuple[float, float]:
    """(max |logit diff|, max |dense logit|) with every expert active at unit gates; both models in float32.

    The dense model's weights are rounded through the output dtype, as the converter rounded them, so it holds
    exactly the values the converter started from. One model is resident at a time.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = layout.dtype or torch.float32
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()  # exact for bf16/fp16 sources
    k = layout.routed_factor
    # The converter stores the routed experts' down_proj × k (top_k, or N without renormalisation) in the output
    # dtype: one rounding, exact only for a power-of-two k (the bitwise check covers it). Give the reference the same weights, so that the logits
    # compare the structure (permutation, routing, gates) and nothing else.
    rounded_down = {}
    for entry in (report or {}).get("layers", []):
        if entry.get("dense"):
            continue
        routed = torch.tensor(entry["perm"][layout.shared_width:], dtype=torch.long)
        w = dense.get_submodule(f"model.layers.{entry['layer']}.mlp.down_proj").weight
        rounded_down[entry["layer"]] = (routed, (w[:, routed] * k).to(dtype).float() / k)
    for param in dense.parameters():
        param.copy_(param.to(dtype).float())  # the rounding to the output dtype that every tensor got
    for i, (routed, cols) in rounded_down.items():
        dense.get_submodule(f"model.layers.{i}.mlp.down_proj").weight[:, routed] = cols
    vocab = dense.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    ref = dense(ids).logits
    del dense
    cfg = AutoConfig.from_pretrained(out)
    cfg.num_experts_per_tok = layout.n_experts
    moe = AutoModelForCausalLM.from_pretrained(out, config=cfg, dtype=torch.float32).eval()
    routers = experts = 0
    for path, module in moe.named_modules():
        name = type(module).__name__
        if path.endswith("shared_expert_gate"):
            module.weight.zero_()  # sigmoid(0): the shared gate exactly 1/2 (written as a tiny constant row)
        elif name.endswith("TopKRouter"):
            module.weight.zero_()  # softmax over zeros: every gate exactly 1/N
            module.top_k = layout.n_experts
            routers += 1
        elif name.endswith("Experts") and isinstance(getattr(module, "down_proj", None), torch.Tensor):
            module.down_proj.mul_(layout.n_experts / k)  # down_proj carries k for gates of 1/k
            experts += 1
    n_moe = layout.n_layers - len(layout.dense_layers)
    if routers != n_moe or experts != n_moe:
        raise RuntimeError(f"found {routers} routers and {experts} expert blocks in the loaded model, expected {n_moe}")
    got = moe(ids).logits
    return (got - ref).abs().max().item(), ref.abs().max().item()
