"""The dense model's own text: continuations of short prompts sampled from the model itself (temperature 1, no
truncation), with its final hidden states kept from the sampling's forward passes (the tuning targets of those
windows), and the cost of a sampling step fitted from a short run (what `tune --dry-run` estimates with).

Sampled text teaches the student what the teacher knows (LLM-QAT's data-free KL), beside the real texts; the tune
stage samples it a batch at a time (moeify.tuning.data) and moeify.training.distill trains on it.
"""

from __future__ import annotations

import os
import time

import torch


def _step_clock(stamps: list):
    """A generate() stopping criterion that never stops: it records (sequence length, time) after every step."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kw) -> torch.Tensor:
            stamps.append((input_ids.shape[1], time.perf_counter()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StepClock()])


def sampling_seconds_per_token(stamps: list, prompt: int, seq: int) -> float:
    """Seconds a sampling step takes, averaged over the positions of windows of `seq` tokens continued from
    `prompt`-token prompts, from the (length, time) stamps of a shorter sampling run (sample_text(step_times=)).
    A step's cost grows with the length of the KV cache it attends to, so the step times (the first, which
    includes the prompt's forward, left out) are fitted as a + b * length by least squares and taken at the mean
    length of a whole window's steps: the first tokens of a window alone would understate the run."""
    lengths = [n for n, _ in stamps[1:]]
    durations = [t - t0 for (_, t0), (_, t) in zip(stamps, stamps[1:])]
    if len(durations) < 2:
        raise ValueError("need at least 3 sampling steps to fit their cost")
    mx, my = sum(lengths) / len(lengths), sum(durations) / len(durations)
    sxx = sum((x - mx) ** 2 for x in lengths)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(lengths, durations)) / sxx) if sxx else 0.0
    mean_length = (prompt + 1 + seq) / 2  # the KV length grows from prompt + 1 to seq over a window's steps
    return my + slope * (mean_length - mx)


@torch.no_grad()
def sample_text(model, prompts: torch.Tensor, new_tokens: int, seed: int, batch: int = 64,
                progress=None, keep_hidden: bool = False, step_times: list | None = None, cache: str = "static",
                bf16: bool = False, pad: bool = False):
    """The dense model's own continuations (temperature 1, no truncation) of short prompts: (n, p + new_tokens)
    token windows of what the model itself predicts, for label-free distillation (LLM-QAT's data-free KL).

    keep_hidden: also return the model's final hidden states at every position of those windows, (n, p +
    new_tokens, d) float16, taken from the sampling's own forward passes (one more token is generated so that the
    window's last position has one): the teacher's targets for these windows, so tuning need not run the teacher
    on them again. Batch b is sampled under seed + b. step_times: a list that gets (sequence length, time) after
    every generation step (sampling_seconds_per_token fits them). cache: transformers' KV cache, "static" (one
    buffer of the whole window, written in place: the same tokens, 22% less time on a 2-core CPU for SmolLM2's
    512-token windows than "dynamic", which copies the growing cache at every step; BENCHMARKS.md). bf16: generate
    under bf16 autocast (the hidden states kept are then those of a bf16 forward, as tuning's own teacher computes
    under it; float16 storage either way). pad: sample a last, smaller batch at the full batch size (its first
    prompt repeated, the extra rows dropped), so a compiled decoding (a GPU's CUDA graphs) is not compiled again for
    a new shape; the text of that batch then differs from an unpadded one's, so a run pads alike or not at all."""
    device = next(model.parameters()).device
    outs, hiddens, steps = [], [], []
    hook = model.model.norm.register_forward_hook(lambda m, i, o: steps.append(o.detach())) if keep_hidden else None
    try:
        for s in range(0, prompts.shape[0], batch):
            p = prompts[s:s + batch].to(device)
            rows = p.shape[0]
            if pad and rows < batch:
                p = torch.cat([p, p[:1].expand(batch - rows, -1)])
            torch.manual_seed(seed + s // batch)  # each batch its own seed: its text does not depend on the others
            n = new_tokens + (1 if keep_hidden else 0)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = model.generate(input_ids=p, attention_mask=torch.ones_like(p), do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                                     pad_token_id=0, eos_token_id=None,
                                     # on CUDA a static cache makes generate compile the forward with CUDA graphs,
                                     # whose outputs (the hidden states the hook keeps) the next step overwrites;
                                     # MOEIFY_COMPILE=0 turns compiling off here too
                                     **({"disable_compile": True} if keep_hidden
                                        or os.environ.get("MOEIFY_COMPILE", "1") == "0" else {}),
                                     **({"cache_implementation": "static"} if cache == "static" else {}),
                                     **({"stopping_criteria": _step_clock(step_times)} if step_times is not None else {}))
            outs.append(out[:rows, : p.shape[1] + new_tokens].cpu())
            if keep_hidden:
                hiddens.append(torch.cat(steps, 1)[:rows, : p.shape[1] + new_tokens].to(torch.float16).cpu())
                steps.clear()
            if progress:
                progress("sampling tuning text", min(s + batch, prompts.shape[0]), prompts.shape[0])
    finally:
        if hook is not None:
            hook.remove()
    return (torch.cat(outs), torch.cat(hiddens)) if keep_hidden else torch.cat(outs)
