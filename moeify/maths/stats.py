"""The statistics of paired comparisons (pure): a mean and its SE, the paired difference of two models on the same
items, the share of a reference's accuracy another keeps (delta-method SE), and the pooling of independent
estimates."""

from __future__ import annotations

import math
from typing import Sequence


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error, sample sd / sqrt(n) (lm-eval's mean_stderr; 0 for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_and_se of no values")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def paired_difference(reference: Sequence[float], other: Sequence[float]) -> tuple[float, float]:
    """mean(other − reference) over the same items, and its paired SE: sd of the per-item differences / sqrt(n)
    (smaller than the two SEs combined when the models get the same items right)."""
    if len(reference) != len(other):
        raise ValueError(f"paired_difference needs the same items: {len(reference)} vs {len(other)} values")
    return mean_and_se([b - a for a, b in zip(reference, other)])


def kept_share(reference: Sequence[float], other: Sequence[float],
               chance: Sequence[float] | None = None) -> tuple[float, float]:
    """What `other` keeps of `reference`'s accuracy on the same items: (mean(other) − c) / (mean(reference) − c),
    c the mean accuracy by chance (per item; None: 0, the plain ratio), and its paired SE by the delta method: the
    sd of the per-item influences ((b − c_i) − r (a − c_i)) / (mean(reference) − c), over √n."""
    c = [0.0] * len(reference) if chance is None else list(chance)
    if not len(reference) == len(other) == len(c) or not c:
        raise ValueError(f"kept_share needs the same items: {len(reference)}, {len(other)}, {len(c)} values")
    base = math.fsum(a - ci for a, ci in zip(reference, c)) / len(c)
    if base <= 0:
        raise ValueError("kept_share: the reference is no better than chance on these items")
    r = math.fsum(b - ci for b, ci in zip(other, c)) / len(c) / base
    return r, mean_and_se([((b - ci) - r * (a - ci)) / base for a, b, ci in zip(reference, other, c)])[1]


def kept_share_difference(reference: Sequence[float], first: Sequence[float],
                          other: Sequence[float]) -> tuple[float, float]:
    """How much more of `reference`'s accuracy `other` keeps than `first` on the same items: (mean(other) −
    mean(first)) / mean(reference), and its paired SE by the delta method (influence (o − f − d · a) / mean(a))."""
    if not len(reference) == len(first) == len(other) or not reference:
        raise ValueError("kept_share_difference needs the same items")
    base = math.fsum(reference) / len(reference)
    if base <= 0:
        raise ValueError("kept_share_difference: the reference scores nothing on these items")
    d = math.fsum(o - f for f, o in zip(first, other)) / len(other) / base
    return d, mean_and_se([(o - f - d * a) / base for a, f, o in zip(reference, first, other)])[1]


def pooled(shares: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The mean of independent estimates (value, SE) and its SE: sqrt(Σ SE²) / n."""
    if not shares:
        raise ValueError("pooled of no estimates")
    return (math.fsum(v for v, _ in shares) / len(shares),
            math.sqrt(math.fsum(se * se for _, se in shares)) / len(shares))


__all__ = ["mean_and_se", "paired_difference", "kept_share", "kept_share_difference", "pooled"]
