"""Scale and speed paths: exact balanced assignment, streaming I/O (direct and buffered), the synthetic
checkpoint script, the fast down_proj refit, and bit-identical shortcuts in the expert tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from scipy.optimize import linear_sum_assignment

from conftest import load
from moeify.formats.checkpoint import CheckpointReader, TensorInfo, first_nonfinite
from moeify.formats.writer import BackgroundWriter, ShardLayout, ShardWriter
from moeify.carving.compensate import refit_down, routing_mask
from moeify.formats.config import build_config
from moeify.errors import MoeifyError
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.formats.experts import _scaled
from moeify.maths.partition import Partition, _balanced_assign_ssp, assignment_prices, balanced_assign, balanced_kmeans

ROOT = Path(__file__).resolve().parents[1]


def _optimum(cost: np.ndarray, size: int) -> float:
    rows, cols = linear_sum_assignment(np.repeat(cost, size, axis=1))
    return float(cost[rows, cols // size].sum())


@pytest.mark.parametrize("n_clusters,size", [(2, 7), (4, 16), (8, 40), (16, 12), (32, 8), (64, 4), (8, 128), (48, 24)])
def test_ssp_matches_scipy(n_clusters, size):
    rng = np.random.default_rng(n_clusters * 1000 + size)
    for trial in range(3):
        # a per-cluster offset makes the cheapest-cluster start very unbalanced (long augmenting paths)
        cost = rng.standard_normal((n_clusters * size, n_clusters)) + 3 * rng.standard_normal(n_clusters) * trial
        labels = _balanced_assign_ssp(cost, size)
        assert np.bincount(labels, minlength=n_clusters).tolist() == [size] * n_clusters
        got = float(cost[np.arange(cost.shape[0]), labels].sum())
        assert got == pytest.approx(_optimum(cost, size), abs=1e-9)


def test_ssp_with_ties_and_cosine_costs():
    rng = np.random.default_rng(0)
    ties = rng.integers(0, 3, size=(240, 8)).astype(float)  # many equal costs: tight-edge batching must stay exact
    labels = _balanced_assign_ssp(ties, 30)
    assert np.bincount(labels, minlength=8).tolist() == [30] * 8
    assert ties[np.arange(240), labels].sum() == pytest.approx(_optimum(ties, 30))
    x = torch.nn.functional.normalize(torch.randn(1024, 32, generator=torch.Generator().manual_seed(1)), dim=1)
    cost = -(x @ x[:16].T).double().numpy()  # the k-means cost: -cosine to centroids
    labels = _balanced_assign_ssp(cost, 64)
    assert cost[np.arange(1024), labels].sum() == pytest.approx(_optimum(cost, 64), abs=1e-9)


@pytest.mark.parametrize("n_clusters,size", [(8, 40), (16, 12), (64, 4), (8, 128)])
def test_warm_started_assignment_is_still_optimal(monkeypatch, n_clusters, size):
    """The SSP path starts from balancing prices, and k-means passes the last iteration's prices: neither may
    change the optimum (a per-cluster constant shifts every balanced assignment's cost equally)."""
    import moeify.maths.partition as P

    monkeypatch.setattr(P, "LSA_MAX_NEURONS", 0)  # force the SSP path (with its warm start) on small problems
    rng = np.random.default_rng(n_clusters + size)
    cost = rng.standard_normal((n_clusters * size, n_clusters)) + 3 * rng.standard_normal(n_clusters)
    labels = balanced_assign(cost, size)
    assert np.bincount(labels, minlength=n_clusters).tolist() == [size] * n_clusters
    assert cost[np.arange(cost.shape[0]), labels].sum() == pytest.approx(_optimum(cost, size), abs=1e-9)
    prices = assignment_prices(cost, labels)
    reduced = cost - prices
    assert (reduced[np.arange(cost.shape[0]), labels] <= reduced.min(axis=1) + 1e-9).all()  # prices certify it
    nearby = cost + 0.1 * rng.standard_normal(cost.shape)  # the next Lloyd iteration's cost
    warm = balanced_assign(nearby, size, prices)
    assert np.bincount(warm, minlength=n_clusters).tolist() == [size] * n_clusters
    assert nearby[np.arange(cost.shape[0]), warm].sum() == pytest.approx(_optimum(nearby, size), abs=1e-9)


def test_large_problem_uses_ssp_and_is_balanced():
    rng = np.random.default_rng(2)
    cost = rng.standard_normal((4096, 64)) + rng.standard_normal(64)
    labels = balanced_assign(cost, 64)
    assert np.bincount(labels, minlength=64).tolist() == [64] * 64


def test_kmeans_device_argument_is_the_default_on_cpu():
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a = balanced_kmeans(x, 4, 5, seed=3)
    assert torch.equal(a, balanced_kmeans(x, 4, 5, seed=3, device="cpu"))
    assert torch.bincount(a).tolist() == [64] * 4


# --------------------------------------------------------------------------------------------------- I/O


def _tensors():
    gen = torch.Generator().manual_seed(0)
    infos = [TensorInfo(f"t{i}", torch.bfloat16 if i % 3 else torch.float32, (i * 37 + 5, 9)) for i in range(12)]
    infos += [TensorInfo("scalar", torch.float32, ()), TensorInfo("empty", torch.float16, (0, 4))]
    return infos, {t.name: torch.randn(t.shape, generator=gen).to(t.dtype) for t in infos}


@pytest.mark.parametrize("direct", ["1", "0"])
def test_writer_streams_bytes_that_read_back(tmp_path, monkeypatch, direct):
    monkeypatch.setenv("MOEIFY_DIRECT_IO", direct)
    infos, data = _tensors()
    writer = BackgroundWriter(ShardWriter(tmp_path, ShardLayout.plan(infos, 3000)), max_pending=5000)
    for t in infos:
        writer.write(t.name, data[t.name])
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in infos)
    reader = CheckpointReader(tmp_path)
    for t in infos:
        got = reader.get(t.name)
        assert got.dtype == t.dtype and torch.equal(got, data[t.name])
        with safe_open(str(reader.file_of[t.name]), "pt") as f:  # the reference reader agrees
            assert torch.equal(f.get_tensor(t.name), got)


def _written(tmp_path):
    infos, data = _tensors()
    writer = ShardWriter(tmp_path, ShardLayout.plan(infos, 3000))
    for t in infos:
        writer.write(t.name, data[t.name])
    writer.finish()
    return infos, data


def test_read_ahead_returns_the_same_tensors_across_shards(tmp_path):
    infos, data = _written(tmp_path)
    reader = CheckpointReader(tmp_path)
    assert len(set(reader.file_of.values())) > 1
    names = sorted(reader.tensors, key=reader.location)
    assert [reader.location(n) for n in names] == sorted(reader.location(n) for n in names)
    reader.prefetch(names[::2])  # every other tensor read ahead, the rest read directly, interleaved
    for name in reversed(names):
        got = reader.get(name)
        assert got.dtype == data[name].dtype and torch.equal(got, data[name]), name
    assert not reader._ahead  # every read-ahead tensor was handed over (none kept in memory)
    reader.prefetch(names[:3])
    reader.forget(names[:2])  # what a layer did not use (an expert no token reached) is dropped
    assert list(reader._ahead) == [names[2]] and torch.equal(reader.get(names[2]), data[names[2]])
    reader.prefetch(names[:3])
    reader.close()  # unclaimed read-ahead tensors are dropped and the thread stops
    assert reader._pool is None and not reader._ahead


def test_read_ahead_errors_and_nonfinite_surface_in_get(tmp_path):
    infos, data = _written(tmp_path)
    reader = CheckpointReader(tmp_path)
    name = "t4"
    path = reader.file_of[name]
    raw = bytearray(path.read_bytes())
    start, _ = reader._span[name]
    raw[start:start + 2] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(raw))
    reader.prefetch([name])
    with pytest.raises(MoeifyError, match=rf"tensor {name} in {path.name} has 1 NaN/Inf value\(s\)"):
        reader.get(name)
    path.write_bytes(bytes(raw[: reader._span[name][1] - 10]))  # truncated after the headers were read
    reader.prefetch([name])
    with pytest.raises(MoeifyError, match=rf"tensor {name} in .*{path.name} could not be read .*file ends 10 bytes early"):
        reader.get(name)
    reader.close()


def test_direct_and_buffered_outputs_are_identical(tmp_path, monkeypatch):
    infos, data = _tensors()
    for mode in ("1", "0"):
        monkeypatch.setenv("MOEIFY_DIRECT_IO", mode)
        (tmp_path / mode).mkdir()
        w = ShardWriter(tmp_path / mode, ShardLayout.plan(infos, 4000))
        for t in infos:
            w.write(t.name, data[t.name])
        w.finish()
    for f in sorted((tmp_path / "1").iterdir()):
        assert f.read_bytes() == (tmp_path / "0" / f.name).read_bytes(), f.name


def test_background_writer_reports_errors(tmp_path):
    infos, data = _tensors()
    writer = BackgroundWriter(ShardWriter(tmp_path, ShardLayout.plan(infos, 3000)))
    writer.write(infos[1].name, data[infos[1].name])  # out of the planned order
    with pytest.raises(RuntimeError, match="plan expects"):
        writer.finish()
    writer.abort()


def test_nonfinite_fast_path_still_finds_nan_and_inf():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.zeros(1000, 3, dtype=dtype)
        assert first_nonfinite(t) is None
        t[700, 1] = float("inf")
        t[900, 2] = float("nan")
        assert first_nonfinite(t)[:2] == (2, 2101)


def test_scaled_is_bit_identical_to_the_float32_round_trip():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(64, 300, generator=gen) * 3).to(dtype)
        for k in (1, 2, 3, 5, 8):
            ref = (x.float() * k).to(dtype)
            assert torch.equal(_scaled(x.clone(), k, dtype).view(-1), ref.view(-1))
    x = torch.randn(8, 8, generator=gen)
    assert torch.equal(_scaled(x.clone(), 3, torch.bfloat16), (x * 3).to(torch.bfloat16))


# ------------------------------------------------------------------------------------ synthetic checkpoint


def test_synthetic_checkpoint_converts_and_loads(tmp_path):
    src = tmp_path / "synthetic"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py"), str(src), "--shape", "tiny",
                    "--layers", "2", "--hidden", "64", "--intermediate", "192", "--vocab", "300",
                    "--max-shard-size", "100KB", "--dtype", "float32"], check=True, capture_output=True)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["intermediate_size"] == 192
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    dense, info = load(src)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    run_conversion(plan_conversion(src, build_config(experts=8, top_k=8, gate_tolerance=1e-6)), tmp_path / "moe")
    moe, info = load(tmp_path / "moe")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (dense(ids).logits - moe(ids).logits).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------- refit


def _refit_normal_equations(act, mask, down, holdout=0.1, strengths=(1e-4, 1e-3, 1e-2, 1e-1, 1.0)):
    """The textbook form: D'^T = (Z^T Z + lam I)^-1 (Z^T Y + lam D^T), strength chosen on held-back tokens."""
    n = act.shape[0]
    n_fit = n - max(1, int(holdout * n))
    a, d_t = act.double(), down.double().T
    z, y = a * mask, a @ d_t

    def solve(rows, lam):
        g = z[rows].T @ z[rows]
        reg = lam * g.diagonal().mean()
        g.diagonal().add_(reg)
        return torch.linalg.solve(g, z[rows].T @ y[rows] + reg * d_t)

    fit, hold = slice(0, n_fit), slice(n_fit, n)
    errors = {lam: (y[hold] - z[hold] @ solve(fit, lam)).square().sum().item() for lam in strengths}
    best = min(strengths, key=lambda lam: (errors[lam], -lam))
    return solve(slice(0, n), best).T.float(), best


@pytest.mark.parametrize("n,d_ff,n_shared,routed", [(600, 48, 0, True), (96, 160, 0, True), (600, 56, 8, True),
                                                     (96, 168, 8, True), (300, 40, 0, False), (40, 120, 0, False)])
def test_refit_matches_normal_equations(n, d_ff, n_shared, routed):
    """Token space (n <= d_ff) and neuron space, block-sparse (routed experts, with and without shared neurons)
    and dense (an unstructured mask) products."""
    gen = torch.Generator().manual_seed(n + d_ff)
    act = torch.randn(n, 6, generator=gen) @ torch.randn(6, d_ff, generator=gen) + 0.1 * torch.randn(n, d_ff, generator=gen)
    down = torch.randn(12, d_ff, generator=gen)
    if routed:
        part = Partition(torch.randperm(d_ff, generator=gen), n_shared, 8, (d_ff - n_shared) // 8)
        mask = routing_mask(torch.randn(n, 8, generator=gen), part, k=2)
    else:
        mask = torch.rand(n, d_ff, generator=gen) < 0.4
    new, info = refit_down(act, mask, down)
    ref, best = _refit_normal_equations(act, mask, down)
    assert info["ridge"] == best
    # neuron space (n > d_ff) forms its Gram matrices as float32 products: on this nearly rank-6 activation matrix
    # (condition ~1e4 after the ridge) that is ~5e-5 of the largest weight
    tol = 1e-6 if n <= d_ff else 1e-4 * ref.abs().max().item()
    assert (new - ref).abs().max().item() <= tol
    with_dense_out, _ = refit_down(act, mask, down, dense_out=act @ down.T)  # float32 dense output: ~1e-6
    assert (with_dense_out - ref).abs().max().item() <= max(tol, 1e-4 * ref.abs().max().item())


def test_small_outputs_go_through_the_page_cache_and_large_ones_past_it(monkeypatch):
    """O_DIRECT only for an output above half the memory available (a smaller one stays cached for the end-of-run
    check to read back); MOEIFY_DIRECT_IO forces either."""
    from moeify.formats import writer

    available = 16 << 30
    monkeypatch.setattr(writer, "_available_memory", lambda: available)
    monkeypatch.delenv("MOEIFY_DIRECT_IO", raising=False)
    assert not writer._direct_io_wanted(available // 2) and writer._direct_io_wanted(available // 2 + 1)
    monkeypatch.setenv("MOEIFY_DIRECT_IO", "1")
    assert writer._direct_io_wanted(1)
    monkeypatch.setenv("MOEIFY_DIRECT_IO", "0")
    assert not writer._direct_io_wanted(available)
    monkeypatch.undo()
    assert 0 < writer._available_memory() < 1 << 50  # this machine's, read from the kernel


def test_a_second_read_may_skip_the_nonfinite_scan(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.tensor([1.0, float("nan")])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(MoeifyError, match="NaN/Inf"):
        CheckpointReader(tmp_path).get("w")
    assert torch.isnan(CheckpointReader(tmp_path, scan_nonfinite=False).get("w")[1])
