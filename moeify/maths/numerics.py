"""Low-level helpers shared by the stages (calibration, carving, compensation, routing, tuning): device
resolution, the FFN activations and their per-neuron statistics, a ridge solve. Imports nothing from moeify
but errors, so every stage can use it without import cycles."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import MoeifyError


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise MoeifyError("--device cuda was given but no CUDA device is available", "use --device cpu or auto")
    return device


def release_memory() -> None:
    """Hand freed heap memory back to the operating system between stages (glibc keeps freed blocks of a large
    stage's tensors in its arenas, so the process's RSS would carry one stage's peak into the next). A no-op where
    the C library has no malloc_trim, or with MOEIFY_MALLOC_TRIM=0 (to measure what it saves)."""
    gc.collect()
    if os.environ.get("MOEIFY_MALLOC_TRIM") == "0":
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAP_ABOVE = 4 << 20  # bytes


def map_large_allocations(threshold: int = MAP_ABOVE) -> None:
    """Have glibc map every allocation of `threshold` bytes or more and unmap it when freed. By default glibc raises
    that threshold (up to 32 MiB) as mapped blocks are freed, and then serves a training step's tensors (FSDP2's
    and gloo's buffers, gradients, activations) from its heap, where what a step frees stays fragmented in the
    process's memory: measured on the CPU, next-token training of a 110M-parameter upcycle across 2 processes held
    about 0.3 GB more per process than with the threshold fixed at 4 MiB (moeify.tuning.lm calls this on CPU runs).
    A no-op where the C library has no mallopt, or with MOEIFY_MALLOC_TRIM=0 (as release_memory)."""
    if os.environ.get("MOEIFY_MALLOC_TRIM") == "0":
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(M_MMAP_THRESHOLD, int(threshold))
    except (OSError, AttributeError):
        pass


def ffn_activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Intermediate activations act(gate x) * (up x). x: (n, d_model) -> (n, d_ff)."""
    return F.silu(x @ gate.T) * (x @ up.T)


@dataclass
class NeuronStats:
    """Per-layer calibration statistics of the FFN neurons."""

    rate: torch.Tensor  # (d_ff,) share of tokens where the neuron is among the top-K_a by |activation| (CMoE)
    mean_abs: torch.Tensor  # (d_ff,) mean |activation|
    pattern: torch.Tensor  # (d_ff, n_sample) binary top-K_a indicators on a token sample (for clustering)
    profile: torch.Tensor  # (d_ff, n_sample) |activation| on the same sample (co-activation signal)

    def to_dict(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """Compact on disk: patterns as uint8, profiles as float16 (neuron_stats rounds them so already)."""
        return {f"{layer_idx}.rate": self.rate.contiguous(), f"{layer_idx}.mean_abs": self.mean_abs.contiguous(),
                f"{layer_idx}.pattern": self.pattern.to(torch.uint8).contiguous(),
                f"{layer_idx}.profile": self.profile.half().contiguous()}

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor], layer_idx: int) -> "NeuronStats":
        try:
            return cls(**{k: d[f"{layer_idx}.{k}"].float() for k in ("rate", "mean_abs", "pattern", "profile")})
        except KeyError:
            raise MoeifyError(f"--stats has no statistics for layer {layer_idx}",
                              "the statistics come from a different model; recompute them with --calib") from None


def neuron_stats(act: torch.Tensor, active_frac: float = 0.1, n_sample: int = 2048, seed: int = 0) -> NeuronStats:
    """act: (n_tokens, d_ff). K_a = active_frac * d_ff neurons count as active in a token."""
    n, d_ff = act.shape
    k_a = max(1, int(round(active_frac * d_ff)))
    mag = act.abs()
    top = mag.topk(k_a, dim=1).indices
    active = torch.zeros_like(mag, dtype=torch.bool).scatter_(1, top, True)
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randperm(n, generator=gen)[: min(n, n_sample)].sort().values.to(act.device)
    return NeuronStats(rate=active.float().mean(0).cpu(), mean_abs=mag.mean(0).cpu(),
                       pattern=active[sample].T.float().cpu(), profile=mag[sample].T.half().float().cpu())



def chol_solve(g: torch.Tensor, rhs: torch.Tensor, reg: torch.Tensor) -> torch.Tensor:
    """(g + reg I)^-1 rhs for symmetric positive semi-definite g (Cholesky; LU if it fails numerically)."""
    g = g.clone()
    g.diagonal().add_(reg)
    chol, bad = torch.linalg.cholesky_ex(g)
    return torch.linalg.solve(g, rhs) if bad.item() else torch.cholesky_solve(rhs, chol)


def bf16_fast(device: str) -> bool:
    """Whether bf16 matrix products are fast here: a CUDA device with bf16, or a CPU with AVX512-BF16 or AMX."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def tuning_autocast(device: str, mode: str):
    """(the autocast context tuning runs under, whether it is on). mode auto: bf16 where the device computes it fast;
    the environment variable MOEIFY_AUTOCAST (bf16 | off) overrides auto (tests of the bf16 path on any CPU)."""
    if mode == "auto":
        mode = os.environ.get("MOEIFY_AUTOCAST", "auto")
    on = mode == "bf16" or (mode == "auto" and bf16_fast(device))
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=on), on
