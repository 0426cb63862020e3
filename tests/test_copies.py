"""moeify.upcycling.copies: the upcycling maths, pure tensors (as test_partition checks the carve's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeify.upcycling.copies import (UpcycleLayout, add_noise, copy_experts, copy_orders, drop_reinit, group_router,
                           matrix_stats, routed_neurons, shared_expert, shared_neurons)
from moeify.errors import MoeifyError


def ffn(d_ff=48, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d_ff, d, generator=g), torch.randn(d_ff, d, generator=g), torch.randn(d, d_ff, generator=g))


def dense(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(x, experts, router, top_k, shared=None):
    """A renormalised top-k MoE (Mixtral's routing), and an always-on shared expert at sigmoid(0) = 1/2."""
    probs = torch.softmax(x @ router.T, -1)
    w, idx = torch.topk(probs, top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(x.shape[0], experts[0][2].shape[0])
    for t in range(x.shape[0]):
        for j in range(top_k):
            out[t] += w[t, j] * dense(x[t:t + 1], *experts[idx[t, j]])[0]
    if shared is not None:
        out += 0.5 * dense(x, *shared)
    return out


@pytest.mark.parametrize("copies,g,k,shared_w,permute", [(4, 1, 2, 0, False), (2, 4, 4, 0, False), (3, 2, 4, 0, True),
                                                          (4, 3, 6, 12, True), (1, 1, 1, 0, False)])
def test_whole_copies_routed_by_group_compute_the_dense_ffn(copies, g, k, shared_w, permute):
    gate, up, down = ffn()
    lay = UpcycleLayout(48, copies, g, k, shared_w)
    lay.check()
    gen = torch.Generator().manual_seed(1)
    shared = shared_neurons(gate, up, down, shared_w)
    orders = copy_orders(routed_neurons(48, shared), copies, permute, gen)
    experts = copy_experts(gate, up, down, orders, lay, g)
    assert len(experts) == copies * g and all(e[0].shape == (lay.expert_width, 16) for e in experts)
    router = group_router(torch.randn(copies, 16, generator=gen), g)
    x = torch.randn(20, 16, generator=gen)
    got = moe(x, experts, router, k, shared_expert(gate, up, down, shared) if shared_w else None)
    torch.testing.assert_close(got, dense(x, gate, up, down), rtol=1e-4, atol=1e-4)


def test_each_copy_holds_every_routed_neuron_once_and_the_router_rows_group_by_copy():
    gate, up, down = ffn()
    shared = shared_neurons(gate, up, down, 8)
    routed = routed_neurons(48, shared)
    assert sorted(torch.cat([shared, routed]).tolist()) == list(range(48)) and len(routed) == 40
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    assert set(shared.tolist()) == set(torch.topk(score, 8).indices.tolist())  # the strongest neurons stay on
    orders = copy_orders(routed, 3, True, torch.Generator().manual_seed(0))
    assert torch.equal(orders[0], routed) and not torch.equal(orders[1], routed)
    assert all(sorted(o.tolist()) == routed.tolist() for o in orders)
    rows = group_router(torch.arange(6.0).view(3, 2), 4)
    assert rows.shape == (12, 2) and torch.equal(rows[4:8], torch.tensor([[2.0, 3.0]] * 4))


def test_drop_reinit_draws_the_share_from_the_source_statistics():
    gate, up, down = ffn(d_ff=512, d=64)
    lay = UpcycleLayout(512, 2, 1, 2)
    expert = copy_experts(gate, up, down, [torch.arange(512)] * 2, lay, 1)[0]
    stats = (matrix_stats(gate), (3.0, 0.5), matrix_stats(down))
    (g2, u2, d2), n = drop_reinit(expert, 0.5, stats, torch.Generator().manual_seed(0))
    assert n == 256
    changed = (u2 != up).any(dim=1)
    assert changed.sum() == 256 and torch.equal(changed, (g2 != gate).any(dim=1))
    assert torch.equal(changed, (d2 != down).any(dim=0))  # the same neurons in all three matrices
    drawn = u2[changed]
    assert abs(drawn.mean().item() - 3.0) < 0.02 and abs(drawn.std().item() - 0.5) < 0.02
    assert torch.equal(u2[~changed], up[~changed])


def test_normal_draws_the_same_values_at_any_thread_count(monkeypatch):
    import moeify.upcycling.copies as copies

    monkeypatch.setattr(copies, "DRAW_CHUNK", 1000)  # 9 blocks of 111 rows (and a short last one)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = copies.normal((1000, 9), 0.5, 2.0, torch.Generator().manual_seed(3), torch.bfloat16)
        torch.set_num_threads(4)
        four = copies.normal((1000, 9), 0.5, 2.0, torch.Generator().manual_seed(3), torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert one.dtype == torch.bfloat16 and torch.equal(one, four)
    assert abs(one.float().mean().item() - 0.5) < 0.1 and abs(one.float().std().item() - 2.0) < 0.1
    assert not torch.equal(one[:111], one[111:222])  # each block its own draws
    other = copies.normal((1000, 9), 0.5, 2.0, torch.Generator().manual_seed(4), torch.bfloat16)
    assert not torch.equal(one, other)


def test_noise_is_relative_to_each_matrix():
    gate, up, down = ffn(d_ff=256, d=64)
    noisy = add_noise((gate, up, down), 0.01, (1.0, 1.0, 2.0), torch.Generator().manual_seed(0))
    assert abs((noisy[0] - gate).std().item() - 0.01) < 1e-3 and abs((noisy[2] - down).std().item() - 0.02) < 2e-3


@pytest.mark.parametrize("kw,match", [
    (dict(copies=4, granularity=2, top_k=3), "--top-k 3 is not a multiple of --granularity 2"),
    (dict(copies=4, granularity=5, top_k=5), "--granularity 5 does not divide the 48 routed neurons"),
    (dict(copies=4, granularity=1, top_k=5), "--top-k 5 must be between 1 and the 4 experts"),
    (dict(copies=0, granularity=1, top_k=1), "--copies 0"),
    (dict(copies=2, granularity=1, top_k=1, shared_width=48), "--shared-width 48 must be"),
])
def test_layouts_that_cannot_be_exact_are_refused_naming_the_flag(kw, match):
    with pytest.raises(MoeifyError, match=match):
        UpcycleLayout(48, **kw).check()


def test_params_and_compute_ratios_follow_the_design_notes():
    full = UpcycleLayout(14336, 8, 1, 2)  # max capacity: N x params, k x compute
    assert full.params_ratio == 8 and full.compute_ratio == 2
    const = UpcycleLayout(14336, 8, 2, 2)  # constant compute: d_expert = d_ff / k
    assert const.params_ratio == 8 and const.compute_ratio == 1 and const.expert_width == 7168
    shared = UpcycleLayout(4864, 4, 2, 4, shared_width=864)
    assert shared.params_ratio == pytest.approx((4 * 4000 + 864) / 4864)
    assert shared.compute_ratio == pytest.approx((4 * 2000 + 864) / 4864)
