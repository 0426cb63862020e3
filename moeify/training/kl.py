"""The tuning loss: KL(teacher || student) of next-token distributions from both models' final hidden states and the
output head, over chunks of tokens with each chunk's gradient computed in its forward pass, so that no (tokens,
vocabulary) tensor is kept for backward at any vocabulary (moeify.training.distill trains with it)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _kl_and_diff_eager(lt: torch.Tensor, ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a chunk's teacher and student logits (float32, (n, V); ls is overwritten): the chunk's summed
    KL(teacher || student) and p_s - p_t, in place where it can be (one (n, V) temporary beyond the inputs)."""
    t = F.log_softmax(lt, dim=-1)
    s = F.log_softmax(ls, dim=-1)
    pt = t.exp()
    kl = (pt * (t - s)).sum()
    del t
    return kl, s.exp_().sub_(pt)


def _kl_and_diff_fused(lt: torch.Tensor, ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation written for torch.compile, which fuses its dozen passes over the (n, V) logits into a
    few (the elementwise part of the KL: a third of its cost before; BENCHMARKS.md "Tuning speed")."""
    t = F.log_softmax(lt, dim=-1)
    s = F.log_softmax(ls, dim=-1)
    pt = t.exp()
    return (pt * (t - s)).sum(), s.exp() - pt


FUSE_MIN_ELEMENTS = 1 << 22  # a chunk's logits smaller than this (tiny models, tests) stay eager: nothing to win
_FUSED: dict = {}


def _fused_kl_fn():
    """torch.compile of _kl_and_diff_fused, or None where it cannot be had (no compiler, an unsupported platform;
    MOEIFY_COMPILE=0 turns it off). Compiled once per process; a failure is reported once and the eager code runs."""
    if "fn" not in _FUSED:
        fn = None
        if os.environ.get("MOEIFY_COMPILE", "1") != "0":
            try:
                fn = torch.compile(_kl_and_diff_fused, dynamic=False)
            except Exception as e:  # torch.compile itself unavailable (e.g. an unsupported Python)
                _fused_failed(e)
        _FUSED["fn"] = fn
    return _FUSED["fn"]


def _fused_failed(e: Exception) -> None:
    import warnings
    _FUSED["fn"] = None
    warnings.warn(f"moeify: the fused KL could not be compiled ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                  "computing it eagerly (slower, same result). Set MOEIFY_COMPILE=0 to skip the attempt.")


def kl_and_diff(lt: torch.Tensor, ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL(teacher || student), p_s - p_t) of a chunk's float32 logits: fused by torch.compile where the
    chunk is large enough to gain, eager otherwise or where compiling fails. The two agree to float32 rounding."""
    fn = _fused_kl_fn() if lt.numel() >= FUSE_MIN_ELEMENTS else None
    if fn is not None:
        try:
            return fn(lt, ls)
        except Exception as e:  # a compiler missing or failing on this machine: found at the first call
            _fused_failed(e)
    return _kl_and_diff_eager(lt, ls)


class _ChunkKL(torch.autograd.Function):
    """Sum over a chunk's tokens of KL(teacher || student) from both models' final hidden states, with the gradient
    computed in the forward pass: d KL / d student logits = softmax(student) - softmax(teacher), so d KL / d hs =
    (p_s - p_t) @ head. Only that (chunk, d) gradient is kept for backward, not the chunk's (chunk, V) logits: memory
    stays bounded at any vocabulary, and a step costs three head products per chunk (teacher, student, gradient)
    instead of the four or five of autograd with kept or recomputed logits. The logits are products in float32, or
    with lowp_logits in head_g's dtype (then rounded to it), the softmax and KL float32 (fused, kl_and_diff); the
    gradient product runs in head_g's dtype (head cast to bf16 under
    bf16 autocast, like the rest of the backward pass; head itself otherwise)."""

    @staticmethod
    def forward(ctx, hs, ht, head, head_g, lowp_logits=False):
        with torch.no_grad():
            if lowp_logits:  # both products in head_g's dtype (bf16 under autocast), logits rounded to it
                lt = (ht.to(head_g.dtype) @ head_g.T).float()
                ls = (hs.to(head_g.dtype) @ head_g.T).float()
            else:
                lt = ht.float() @ head.float().T
                ls = hs.float() @ head.float().T
            if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
                t = F.log_softmax(lt, dim=-1)
                return (t.exp() * (t - F.log_softmax(ls, dim=-1))).sum()
            kl, diff = kl_and_diff(lt, ls)  # diff: (chunk, V) p_s - p_t
            del lt, ls
            g_hs = (diff.to(head_g.dtype) @ head_g).to(hs.dtype) if ctx.needs_input_grad[0] else None
            g_head = (diff.T @ hs.float()).to(head.dtype) if ctx.needs_input_grad[2] else None
            ctx.save_for_backward(g_hs, g_head)
        return kl

    @staticmethod
    def backward(ctx, grad):
        g_hs, g_head = ctx.saved_tensors
        return (None if g_hs is None else grad * g_hs), None, (None if g_head is None else grad * g_head), None, None


def chunked_kl(hs: torch.Tensor, ht: torch.Tensor, head: torch.Tensor, chunk: int,
               logits: str = "float32") -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) from the final hidden states (n, d) and the output head (V, d),
    `chunk` tokens at a time, so at most one chunk of log-probabilities is held (in the forward pass only: each
    chunk's gradient is computed there, see _ChunkKL). logits "autocast": when the student's states carry a gradient
    under autocast, the two logit products run in the autocast dtype (DistillSettings.kl_logits); otherwise, and
    for "float32", in float32."""
    if logits not in ("float32", "autocast"):
        raise ValueError(f"kl_logits {logits!r}: use 'float32' or 'autocast'")
    hs, ht = hs.reshape(-1, hs.shape[-1]), ht.reshape(-1, ht.shape[-1]).detach()
    dev = hs.device.type
    grad_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.float32
    head_g = head.detach().to(grad_dtype) if hs.requires_grad else head  # cast once, not per chunk
    lowp = logits == "autocast" and hs.requires_grad and head_g.dtype != torch.float32
    with torch.autocast(dev, enabled=False):
        total = hs.new_zeros((), dtype=torch.float32)
        for s in range(0, hs.shape[0], chunk):
            total = total + _ChunkKL.apply(hs[s:s + chunk], ht[s:s + chunk], head, head_g, lowp)
    return total / hs.shape[0]
