"""The upcycle stage's end-of-run check: the source and the written MoE streamed one decoder layer at a time
(transformers' own classes, the MoE's real top-k routing, moeify.evaluation.layerwise): the construction with
unbroken copies (a merge's: every copy the base's FFN) must give the source's logits, else the run stops and writes
nothing; the KL to the source of the model as written (the price of the symmetry breaking, or of the merge) goes into
report.json and the card.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from ..evaluation.layerwise import compare_to_reference, moe_stack, source_stack, stream_hidden
from ..formats.checkpoint import CheckpointReader

Progress = Callable[[str, int, int], None]  # (stage, done, total)
Experts = Callable[[int], object]  # layer -> its experts, made again from the sources (LayerExperts.experts)
CHECK_RTOL = 1e-3  # max |logit difference| allowed, relative to max |source logit| (as `moeify verify`)
CHECK_SEQ = 32  # tokens of each of the 2 random sequences the check runs when the source has no tokenizer
READ_BACK_BYTES = 16 << 30  # outputs up to this size are checked from the files; larger ones from regenerated experts


def check_output(plan, out_dir: Path, regenerate: Callable[..., Experts], progress: Progress | None = None,
                 text_ids: torch.Tensor | None = None, out_reader: CheckpointReader | None = None) -> dict:
    """The source and the written MoE streamed one decoder layer at a time (moeify.evaluation.layerwise), in one
    pass over `text_ids` (else 64 random tokens, as moeify.api.run_upcycle_plan asks for an output exact as written):
    the model as written scored by its KL to the source, and the exact construction (the model as written when it
    is one; else the copies before symmetry breaking, a merge's every copy the base's FFN, made again) must give the
    source's logits on the same tokens (RuntimeError otherwise). When the model as written is the exact
    construction, its KL is bounded by its logit difference: of a text given, the first window is checked, not every
    one. plan: the UpcyclePlan; regenerate(broken, base_only=False): each layer's experts made again, as the output
    holds them. Both checkpoints are read without the NaN/Inf scan: this process read every source tensor through it
    while writing, and wrote the output from them. out_reader: the output's reader (a WrittenReader while it is being
    written: the check a layer behind the writer); else one is opened on out_dir's files."""
    src = plan.src
    src_reader = CheckpointReader(src.path, scan_nonfinite=False)
    out_reader = out_reader or CheckpointReader(out_dir, scan_nonfinite=False)
    from_files = plan.output_bytes <= READ_BACK_BYTES
    dense = source_stack(src, src_reader, plan.out_dtype)  # the source as the output's dtype holds it
    written = moe_stack(out_dir, out_reader, None if from_files else regenerate(True))
    # With averaged attention, or a shared expert of its own that is not the base's FFN at a constant gate, no
    # setting computes the base, and only the KL is measured. Exactness is a property of the weights and the class's
    # routing, which any tokens show: the exact construction runs in the same pass, on the same tokens.
    averaged = bool(plan.sources) and (plan.attention != "base" or not plan.shared_is_base)
    exact = None if averaged else written if plan.exact else \
        moe_stack(out_dir, out_reader, regenerate(False, bool(plan.sources)))
    if text_ids is not None and exact is written:
        text_ids = text_ids[:1]  # the model as written is the exact construction: one window shows both numbers
    ids = text_ids if text_ids is not None else torch.randint(
        0, src.vocab, (2, CHECK_SEQ), generator=torch.Generator().manual_seed(plan.settings.seed))
    stacks = [dense, written] + ([exact] if exact is not None and exact is not written else [])
    try:
        finals = stream_hidden(stacks, ids, progress)
        found = compare_to_reference(dense, finals[0], list(zip(stacks[1:], finals[1:])))
        result = {"tokens": int(ids.numel()), "tokens_from": "text" if text_ids is not None else "random",
                  "experts_read_back": from_files, "exact_model": None, "kl_to_source": found[0]["kl"]}
        if text_ids is not None:
            result["kl_text_tokens"] = int(ids.numel())
        if exact is not None:
            result.update(_exactness(plan, found[-1]))
    finally:
        src_reader.close()
        out_reader.close()
    return result


def _exactness(plan, found: dict) -> dict:
    """The exact construction's max |logit difference| to the source (`found`), within CHECK_RTOL of the source's
    max |logit| (RuntimeError otherwise: the run writes nothing)."""
    diff, scale = found["max_logit_diff"], found["logit_scale"]
    tol = CHECK_RTOL * max(scale, 1e-6)
    if not math.isfinite(diff) or diff > tol:
        raise RuntimeError(f"upcycle check failed: the copies' logits differ from {plan.src.path}'s by {diff:.3g} "
                           f"(allowed {tol:.3g}); nothing was written")
    label = "every expert the base's FFN" if plan.sources else "the copies before symmetry breaking"
    return {"max_logit_diff": diff, "logit_scale": scale,
            "exact_model": (f"as written: {label}" if plan.sources else "as written") if plan.exact else label}


__all__ = ["check_output"]
