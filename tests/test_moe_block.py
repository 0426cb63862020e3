"""The student's MoE block (moeify.maths.moe_block): the grouped kernel (only the chosen experts' products) computes what
the masked one computes, forward and backward, to bf16 rounding; and it steps aside where it does not apply."""

from __future__ import annotations

import pytest
import torch

from moeify.maths.moe_block import MaskedMoE, grouped_mm_available

pytestmark = pytest.mark.skipif(not grouped_mm_available(), reason="this torch has no torch._grouped_mm")


def block(fmt: str, shared: int, n_exp: int = 4, width: int = 16, d: int = 64, top_k: int = 2, seed: int = 0,
          shared_gate: float | None = None) -> MaskedMoE:
    g = torch.Generator().manual_seed(seed)
    d_ff = n_exp * width + shared
    labels = torch.cat([torch.arange(n_exp).repeat_interleave(width), torch.full((shared,), -1)])
    labels = labels[torch.randperm(d_ff, generator=g)]  # the dense neuron order: experts interleaved
    gate, up = torch.randn(d_ff, d, generator=g) / d ** 0.5, torch.randn(d_ff, d, generator=g) / d ** 0.5
    down = torch.randn(d, d_ff, generator=g) / d_ff ** 0.5
    router = torch.randn(n_exp, d, generator=g)
    return MaskedMoE(gate, up, down, router, 0.7, labels, top_k, fmt=fmt, shared_gate=shared_gate)


def run(moe: MaskedMoE, kernel: str, x: torch.Tensor, autocast: bool = True):
    moe.kernel = kernel
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = moe(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y.detach().float(), x.grad.clone(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt,shared,shared_gate", [("mixtral", 0, None), ("qwen2_moe", 16, 0.05),
                                                     ("qwen2_moe", 0, None), ("mixtral", 8, None)])
def test_grouped_matches_masked(fmt, shared, shared_gate, monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe = block(fmt, shared, shared_gate=shared_gate)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1))
    assert moe.grouped_applies(torch.bfloat16)
    y_m, gx_m, g_m = run(moe, "masked", x)
    assert not calls
    y_g, gx_g, g_g = run(moe, "grouped", x)
    assert len(calls) == 3  # gate, up, down: the grouped products ran
    y_32, _, _ = run(moe, "masked", x, autocast=False)  # float32: how far bf16 itself is from the exact block
    assert y_g.shape == y_m.shape == x.shape
    bf16_err = rel(y_m, y_32)
    assert 0 < bf16_err < 1e-2
    assert rel(y_g, y_m) < 2 * bf16_err  # the two kernels differ by bf16 rounding, no more
    assert rel(y_g, y_32) < 2 * bf16_err
    assert rel(gx_g, gx_m) < 2e-2
    for name in g_m:  # experts, router rows and its temperature all get the same gradient
        assert rel(g_g[name], g_m[name]) < 2e-2, name
    assert g_g["routing.router"].abs().sum() > 0


def test_grouped_with_an_expert_no_token_chose():
    moe = block("mixtral", 0, top_k=1)
    with torch.no_grad():
        moe.routing.router[0] = -100 * moe.routing.router[1:].abs().sum(0)  # expert 0 loses for these tokens
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2)).abs()
    idx = moe.choice(x.reshape(-1, 64))[0]
    assert 0 not in idx.unique().tolist()
    y_m, _, g_m = run(moe, "masked", x)
    y_g, _, g_g = run(moe, "grouped", x)
    assert rel(y_g, y_m) < 1e-2
    assert g_g["gate"][moe.labels == 0].abs().max() == 0  # an expert nobody chose gets no gradient
    assert rel(g_g["gate"], g_m["gate"]) < 2e-2


def test_grouped_steps_aside_where_it_does_not_apply():
    moe = block("mixtral", 8)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))
    assert not moe.grouped_applies(torch.float32)  # float32: the masked products, bit for bit
    y_m, _, _ = run(moe, "masked", x, autocast=False)
    y_g, _, _ = run(moe, "grouped", x, autocast=False)
    assert torch.equal(y_m, y_g)
    assert not block("mixtral", 0, width=12).grouped_applies(torch.bfloat16)  # widths off the 16-byte grid
    moe.dense_grad = True  # DenseMixer needs every expert's output
    assert not moe.grouped_applies(torch.bfloat16)
    uneven = block("mixtral", 0)
    lab = uneven.labels.clone()
    lab[torch.nonzero(lab == 0)[:4]] = 1
    assert MaskedMoE(uneven.gate, uneven.up, uneven.down, uneven.router, 1.0, lab, 2).width == 0
