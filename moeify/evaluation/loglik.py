"""Log-likelihoods of continuations with each context run once: the scoring under `eval --tasks`.

A multiple-choice item asks for log p(choice | context) of every choice; lm-eval's HFLM feeds context + choice once
per choice and computes the vocabulary's log-softmax at every position. Here the choices of one context share one
row: the context once, then each choice's tokens (all but its last, which is only predicted), with positions that
restart after the context and a mask that lets each choice see the context and itself only (tree attention), so
every choice is conditioned exactly as in a row of its own. The head and the log-softmax run only where a
continuation token is predicted. For ARC and HellaSwag that is 2-3x fewer tokens through the model; BoolQ's yes/no
and LAMBADA's one request an item gain the head alone.

    (ctx, cont) pairs ──► groups by context ──► rows: ctx | c1[:-1] | c2[:-1] | ...   positions 0..L-1 | L.. | L..
                      ──► rows sorted by length, batched under a token budget, right-padded
                      ──► the model's decoder with a 4D mask (transformers takes it as given) ──► hidden states
                          where continuation tokens are predicted ──► lm_head ──► float32 log-softmax
                      ──► (sum of the continuation's log-probabilities, whether greedy decoding gives it)

The numbers equal a separate row per choice up to floating-point order (tested against lm-eval's own HFLM path).
A model with a sliding window (Mistral) gets rows no longer than the window, the context cut from the left.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

Pair = tuple[Sequence[int], Sequence[int]]  # (context tokens, continuation tokens), as lm-eval's _encode_pair gives


@dataclass
class Row:
    """One context and the continuations that share it."""

    tokens: list[int]  # the context, then each continuation but its last token
    positions: list[int]
    segments: list[int]  # 0: the context; i + 1: continuation i
    targets: list[tuple[int, list[int], list[int]]]  # (request index, predicting rows, continuation tokens)


def pack(pairs: Sequence[Pair], max_length: int) -> list[Row]:
    """The requests as rows, one per distinct context (in first-seen order). A context longer than the model's
    window is cut from the left, as lm-eval does, so that its longest continuation still fits."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, cont) in enumerate(pairs):
        if not ctx or not cont:
            raise ValueError(f"request {i}: an empty context or continuation (lm-eval gives neither)")
        by_context.setdefault(tuple(ctx), []).append(i)
    rows = []
    for ctx, members in by_context.items():
        longest = max(len(pairs[i][1]) for i in members)
        if longest > max_length:
            raise ValueError(f"a continuation of {longest} tokens is longer than the model's window ({max_length})")
        context = list(ctx[-(max_length + 1 - longest):])
        row = Row(list(context), list(range(len(context))), [0] * len(context), [])
        seen: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
        for i in members:
            cont = list(pairs[i][1])
            if tuple(cont) not in seen:
                start = len(row.tokens)
                seg = len(seen) + 1
                row.tokens += cont[:-1]
                row.positions += range(len(context), len(context) + len(cont) - 1)
                row.segments += [seg] * (len(cont) - 1)
                seen[tuple(cont)] = ([len(context) - 1] + list(range(start, start + len(cont) - 1)), cont)
            where, cont = seen[tuple(cont)]
            row.targets.append((i, where, cont))
        rows.append(row)
    return rows


def batches(rows: list[Row], max_rows: int, max_tokens: int) -> list[list[Row]]:
    """Rows longest first, as many a batch as fit max_rows and max_tokens (padded length x rows)."""
    out: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: -len(r.tokens)):
        if out and len(out[-1]) < max_rows and len(out[-1][0].tokens) * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def tree_mask(segments: torch.Tensor) -> torch.Tensor:
    """(batch, 1, T, T) boolean, True where query q may attend key k: k <= q, and k is the context (segment 0) or
    q's own segment. Padding (segment -1) attends to itself only and is attended by nothing real."""
    q, k = segments[:, :, None], segments[:, None, :]
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    return (causal & ((k == 0) & (q >= 0) | (k == q)))[:, None]


ALL_EXPERTS = "moeify_all_experts"


def _all_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward as three dense products: every routed expert's neurons computed, each scaled by
    its routing weight (0 for the experts a token did not choose), then one down product. The same sum as the
    per-expert loop (an unchosen expert adds exactly 0); on a CPU, fine-grained experts' many small products cost
    more than the whole routed width at once (scoring SmolLM2's active-50 carve: 2x faster)."""
    n, two_w, h = self.gate_up_proj.shape
    weights = hidden_states.new_zeros(hidden_states.shape[0], n + 1)
    weights.scatter_(1, top_k_index, top_k_weights.to(weights.dtype))  # index n: a dropped slot, if any
    act = self._apply_gate(F.linear(hidden_states, self.gate_up_proj.reshape(n * two_w, h)).view(-1, n, two_w))
    down = getattr(self, "_moeify_down_all", None)
    if down is None or down.dtype != self.down_proj.dtype:  # (h, n x w), made once per model
        down = self._moeify_down_all = self.down_proj.detach().permute(1, 0, 2).reshape(h, -1).contiguous()
    return F.linear((act * weights[:, :n, None]).reshape(act.shape[0], -1), down)


def _all_experts() -> str:
    """The name of _all_experts_forward in transformers' experts interface (registered on first use)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(ALL_EXPERTS, _all_experts_forward)
    return ALL_EXPERTS


@torch.no_grad()
def score_batch(model, batch: list[Row]) -> list[tuple[int, float, bool]]:
    """(request index, log-likelihood, greedy) of every continuation in the batch, in one forward."""
    device = next(model.parameters()).device
    t = len(batch[0].tokens)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    pos = torch.zeros(len(batch), t, dtype=torch.long)
    seg = torch.full((len(batch), t), -1, dtype=torch.long)
    for b, row in enumerate(batch):
        n = len(row.tokens)
        ids[b, :n], pos[b, :n], seg[b, :n] = (torch.tensor(row.tokens), torch.tensor(row.positions),
                                              torch.tensor(row.segments))
    hidden = model.get_decoder()(input_ids=ids.to(device), position_ids=pos.to(device),
                                 attention_mask=tree_mask(seg).to(device), use_cache=False).last_hidden_state
    picks = [(b, where, cont, i) for b, row in enumerate(batch) for i, where, cont in row.targets]
    rows_b = torch.tensor([b for b, where, _, _ in picks for _ in where], device=device)
    rows_t = torch.tensor([w for _, where, _, _ in picks for w in where], device=device)
    logits = model.get_output_embeddings()(hidden[rows_b, rows_t]).float()
    wanted = torch.tensor([tok for _, _, cont, _ in picks for tok in cont], device=device)
    token_lp = (logits.gather(1, wanted[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).tolist()
    hits = (logits.argmax(-1) == wanted).tolist()
    out, at = [], 0
    for _, where, _, i in picks:
        n = len(where)
        out.append((i, float(sum(token_lp[at:at + n])), all(hits[at:at + n])))
        at += n
    return out


@contextlib.contextmanager
def experts_for_scoring(model):
    """On a CPU, an MoE's experts computed whole (_all_experts_forward) while scoring; elsewhere (CUDA's grouped
    kernels take the active share at full speed) and for a dense model, nothing changes."""
    before = getattr(model.config, "_experts_implementation", None)
    if before is None or next(model.parameters()).device.type != "cpu":
        yield
        return
    model.set_experts_implementation(_all_experts())
    try:
        yield
    finally:
        model.set_experts_implementation(before)


def score(model, pairs: Sequence[Pair], max_length: int, max_rows: int = 16, max_tokens: int = 4096,
          done: Callable[[list[int], list[tuple[float, bool]]], None] | None = None) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each (context, continuation) pair under the already-loaded causal LM `model`.
    done(indices, answers) is called after each forward with the requests it answered (progress, a cache)."""
    window = getattr(model.config, "sliding_window", None)  # a given 4D mask has no window: rows stay within it
    if window and getattr(model.config, "use_sliding_window", True):
        max_length = min(max_length, int(window))
    answers: list[tuple[float, bool] | None] = [None] * len(pairs)
    with experts_for_scoring(model):
        for batch in batches(pack(pairs, max_length), max_rows, max_tokens):
            got = score_batch(model, batch)
            for i, ll, greedy in got:
                answers[i] = (ll, greedy)
            if done is not None:
                done([i for i, _, _ in got], [(ll, g) for _, ll, g in got])
    return answers  # type: ignore[return-value]


__all__ = ["Row", "pack", "batches", "tree_mask", "score_batch", "experts_for_scoring", "score"]
