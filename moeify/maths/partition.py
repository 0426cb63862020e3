"""Pure maths: FFN weights -> a permutation of the intermediate neurons and its cut into experts.

A partition is a permutation `perm` of range(d_ff): perm[:n_shared] are the shared (always-on) neurons,
then expert e owns perm[n_shared + e*w : n_shared + (e+1)*w]. Within each group indices are sorted,
so the result does not depend on the order clustering happened to produce.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

# Above this many neurons, the repeated-column linear_sum_assignment (O(n^3)) is replaced by an exact
# min-cost-flow solver with the same optimum (see balanced_assign); tests check the two agree.
LSA_MAX_NEURONS = 2048


@dataclass(frozen=True)
class Partition:
    perm: torch.Tensor  # (d_ff,) int64, a permutation
    n_shared: int  # neurons in the shared expert (first n_shared of perm)
    n_experts: int
    expert_width: int

    def expert_neurons(self, expert_idx: int) -> torch.Tensor:
        start = self.n_shared + expert_idx * self.expert_width
        return self.perm[start:start + self.expert_width]

    @property
    def shared_neurons(self) -> torch.Tensor:
        return self.perm[: self.n_shared]

    def labels(self) -> torch.Tensor:
        """(d_ff,) expert index of every neuron, -1 for shared neurons."""
        labels = torch.full((self.perm.numel(),), -1, dtype=torch.long)
        for e in range(self.n_experts):
            labels[self.expert_neurons(e)] = e
        return labels


def perm_hash(perm: torch.Tensor) -> str:
    return hashlib.sha256(perm.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def valid_expert_counts(routed_width: int) -> list[int]:
    return [n for n in range(1, routed_width + 1) if routed_width % n == 0 and n <= 256]


def weight_scores(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Weight-only importance of each neuron: ||gate row|| * ||up row|| * ||down column||."""
    return gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)


def make_partition(labels_routed: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor, n_experts: int) -> Partition:
    """Assemble a Partition from shared neuron ids and a label per routed neuron."""
    groups = [shared.sort().values]
    for e in range(n_experts):
        groups.append(routed[labels_routed == e].sort().values)
    sizes = {g.numel() for g in groups[1:]}
    assert len(sizes) == 1, f"unbalanced partition: {sorted(sizes)}"
    perm = torch.cat(groups).long()
    return Partition(perm=perm, n_shared=shared.numel(), n_experts=n_experts, expert_width=sizes.pop())


def split_shared(scores: torch.Tensor, n_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared = the n_shared highest-scoring neurons (ties broken by index); the rest are routed."""
    order = torch.sort(-scores.float(), stable=True).indices
    return order[:n_shared].sort().values, order[n_shared:].sort().values


def _move_table(cost: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The single-item moves between clusters: delta (n, k), the cost of moving item i to cluster b; edge (k, k),
    edge[a, b] = min over items in a of delta[i, b] (inf on the diagonal and from empty clusters); who (k, k),
    the (lowest-index) item attaining it."""
    n, k = cost.shape
    delta = cost - cost[np.arange(n), labels][:, None]
    edge = np.full((k, k), np.inf)
    who = np.zeros((k, k), dtype=np.int64)
    cols = np.arange(k)
    order = np.argsort(labels, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=k))])
    for a in range(k):
        members = order[bounds[a]:bounds[a + 1]]
        if members.size:
            best = delta[members].argmin(axis=0)
            who[a] = members[best]
            edge[a] = delta[members[best], cols]
    np.fill_diagonal(edge, np.inf)
    return delta, edge, who


def assignment_prices(cost: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cluster prices v (N,) under which an optimal balanced assignment is also the unconstrained one: every item's
    label minimises cost[i, j] - v[j]. They are shortest-path potentials over the clusters (edge a->b: the cheapest
    move of an item from a to b; no negative cycle when the assignment is optimal), so for a nearby cost matrix
    (the next Lloyd iteration) argmin(cost - v) is already almost balanced and the exact solver has little to do."""
    k = cost.shape[1]
    _, edge, _ = _move_table(cost, labels)
    dist = np.zeros(k)
    for _ in range(k):  # Bellman-Ford from a virtual source joined to every cluster at cost 0
        new = np.minimum(dist, (dist[:, None] + edge).min(axis=0))
        if np.array_equal(new, dist):
            break
        dist = new
    return dist


def balanced_assign(cost: np.ndarray, size: int, prices: np.ndarray | None = None) -> np.ndarray:
    """Assign n items to N clusters of exactly `size` items each, minimising the total cost.

    cost: (n, N) with n == N * size. Returns labels (n,). Small problems use Jonker-Volgenant
    (scipy linear_sum_assignment) on the cost matrix with each cluster's column repeated `size` times.
    Large ones use successive shortest paths on the N cluster nodes, which is exact too and
    takes O(excess * n * N) instead of O(n^3). `prices` (from assignment_prices on a similar cost matrix)
    shift the columns: the same optimum, found with fewer augmentations.
    """
    n, n_clusters = cost.shape
    assert n == n_clusters * size, (n, n_clusters, size)
    if prices is not None:  # a constant per cluster adds size * sum(prices) to every balanced assignment's cost
        cost = cost - prices[None, :]
    if n <= LSA_MAX_NEURONS:
        from scipy.optimize import linear_sum_assignment  # here: scipy's import (~0.4 s) only where it is used

        rows, cols = linear_sum_assignment(np.repeat(cost, size, axis=1))
        labels = np.empty(n, dtype=np.int64)
        labels[rows] = cols // size
        return labels
    return _balanced_assign_ssp(cost - _balancing_prices(cost, size)[None, :], size)


def _balancing_prices(cost: np.ndarray, size: int, rounds: int = 30) -> np.ndarray:
    """Cheap cluster prices that make argmin(cost - v) roughly balanced (an auction-like heuristic: each round, every
    over-full cluster raises its price by half the margin that would push out its excess items). Only a warm start
    for the exact solver (any prices give the same optimum); it turns thousands of augmentations into a few."""
    n, k = cost.shape
    v = np.zeros(k)
    rows = np.arange(n)
    for _ in range(rounds):
        red = cost - v
        labels = red.argmin(axis=1)
        counts = np.bincount(labels, minlength=k)
        if counts.max() <= size + max(1, size // 100):
            break
        gap = np.partition(red, 1, axis=1)[:, 1] - red[rows, labels]  # margin of each item over its second choice
        for j in np.flatnonzero(counts > size):
            margins = np.partition(gap[labels == j], counts[j] - size - 1)[: counts[j] - size]
            v[j] -= 0.5 * margins.max() + 1e-12
    return v


def _balanced_assign_ssp(cost: np.ndarray, size: int) -> np.ndarray:
    """Min-cost balanced assignment by successive shortest paths over clusters.

    Start from every item at its cheapest cluster (a min-cost pseudo-flow: no negative cycles). While a
    cluster is over-full, find the cheapest chain of single-item moves over->...->under-full (Bellman-Ford
    on N nodes, edge a->b costs min over items i in a of cost[i,b]-cost[i,a]) and apply it. Each augmentation
    along a shortest path keeps the pseudo-flow optimal, so the final balanced assignment is optimal.

    The edge table is kept up to date incrementally: a move changes only the moved item's row of the move
    costs, so only the rows of the clusters on the path are recomputed (O(n) per augmentation, not O(n*N)).
    """
    cost = np.ascontiguousarray(cost, dtype=np.float64)
    n, k = cost.shape
    labels = cost.argmin(axis=1)
    counts = np.bincount(labels, minlength=k)
    if not (counts > size).any():
        return labels
    delta, edge, who = _move_table(cost, labels)
    cols = np.arange(k)

    def refresh(a: int) -> None:
        members = np.flatnonzero(labels == a)
        if members.size == 0:
            edge[a] = np.inf
            return
        best = delta[members].argmin(axis=0)
        who[a] = members[best]
        edge[a] = delta[members[best], cols]
        edge[a, a] = np.inf

    tol = 1e-12 * max(1.0, float(np.abs(cost).max()))

    def augment(path: list[int]) -> None:
        """Apply the moves of a path of clusters, each item chosen before any move on this path."""
        moves = [(who[a, b], b) for a, b in zip(path[:-1], path[1:])]
        for item, b in moves:
            counts[labels[item]] -= 1
            labels[item] = b
            counts[b] += 1
            delta[item] = cost[item] - cost[item, b]
        for a in path:
            refresh(a)

    while (counts > size).any():
        # Bellman-Ford from all over-full clusters at once (virtual source).
        dist = np.where(counts > size, 0.0, np.inf)
        pred = np.full(k, -1)
        for _ in range(k):
            cand = dist[:, None] + edge  # (from, to)
            best_from = cand.argmin(axis=0)
            best = cand[best_from, cols]
            improve = best < dist - tol
            if not improve.any():
                break
            dist = np.where(improve, best, dist)
            pred = np.where(improve, best_from, pred)
        under = np.flatnonzero(counts < size)
        target = under[dist[under].argmin()]
        # Walk back to a source (an over-full cluster: the only nodes with finite dist and no predecessor).
        path = [target]
        while pred[path[-1]] != -1:
            path.append(pred[path[-1]])
        augment(path[::-1])
        # More augmentations with the same distances: any path of tight edges (reduced cost edge[a,b] +
        # dist[a] - dist[b] ~ 0) from an over-full to an under-full cluster is a shortest path too, and
        # applying it keeps every reduced cost >= 0 (dist stays a certificate of optimality). This batches
        # the many independent augmentations between two Bellman-Ford runs.
        while (counts > size).any():
            path = _tight_path(edge + dist[:, None] - dist[None, :] <= tol, counts > size, counts < size)
            if path is None:
                break
            augment(path)
    return labels


def _tight_path(tight: np.ndarray, sources: np.ndarray, sinks: np.ndarray) -> list[int] | None:
    """Breadth-first search over clusters along tight edges, from any source to any sink; None if none."""
    parent = np.full(tight.shape[0], -2)
    frontier = np.flatnonzero(sources)
    parent[frontier] = -1
    while frontier.size:
        sub = tight[frontier]  # (frontier, k)
        nodes = np.flatnonzero(sub.any(axis=0) & (parent == -2))
        if nodes.size == 0:
            return None
        parent[nodes] = frontier[sub[:, nodes].argmax(axis=0)]
        hit = nodes[sinks[nodes]]
        if hit.size:
            path = [int(hit[0])]
            while parent[path[-1]] != -1:
                path.append(int(parent[path[-1]]))
            return path[::-1]
        frontier = nodes
    return None


def balanced_kmeans(x: torch.Tensor, n_clusters: int, iters: int, seed: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Spherical balanced k-means: rows of x (L2-normalised here) into n_clusters equal groups.

    k-means++ initialisation (seeded), then Lloyd iterations whose assignment step is the exact balanced
    assignment above on cost = -cosine similarity. Returns labels (n,) on the CPU.

    The similarities and centroids are float32 matrix products on `device` (default: x's device; a GPU when
    the caller passes one); only the (n, n_clusters) cost matrix goes to the CPU for the exact assignment.
    """
    n = x.shape[0]
    if n_clusters == 1:
        return torch.zeros(n, dtype=torch.long)
    # one float32 copy of x, normalised in place (what F.normalize computes, without a second n x d buffer)
    x = x.to(device=device or x.device, dtype=torch.float32, copy=True)
    x.div_(x.norm(dim=1, keepdim=True).clamp_min(1e-12))
    size = n // n_clusters
    gen = torch.Generator().manual_seed(seed)  # CPU generator: the same draws on every device
    centers = [int(torch.randint(n, (1,), generator=gen))]
    dist = (1 - x @ x[centers[0]]).clamp_min(0)
    for _ in range(1, n_clusters):
        probs = dist / dist.sum() if dist.sum() > 0 else torch.full_like(dist, 1.0 / n)
        centers.append(int(torch.multinomial(probs.cpu(), 1, generator=gen)))
        dist = torch.minimum(dist, (1 - x @ x[centers[-1]]).clamp_min(0))
    centroids = x[centers].clone()
    labels, prices = None, None
    for _ in range(iters):
        cost = -(x @ centroids.T).double().cpu().numpy()
        new = balanced_assign(cost, size, prices)
        prices = assignment_prices(cost, new)  # warm start for the next iteration's assignment
        new = torch.from_numpy(new)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        centroids = torch.zeros_like(centroids).index_add_(0, labels.to(x.device), x)
        centroids = torch.nn.functional.normalize(centroids, dim=1)
    return labels


def partition_neurons(method: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, n_experts: int,
                      n_shared: int, seed: int, kmeans_iters: int = 8, device=None) -> Partition:
    """Weight-only partition of one FFN. gate/up: (d_ff, d_model), down: (d_model, d_ff).
    `device`: where gate-cluster's k-means runs (default: gate's device)."""
    d_ff = gate.shape[0]
    scores = weight_scores(gate, up, down) if n_shared else torch.zeros(d_ff)
    shared, routed = split_shared(scores, n_shared)
    width = routed.numel() // n_experts
    if method == "contiguous":
        labels = torch.arange(routed.numel()) // width
    elif method == "random":
        gen = torch.Generator().manual_seed(seed)
        labels = torch.empty(routed.numel(), dtype=torch.long)
        labels[torch.randperm(routed.numel(), generator=gen)] = torch.arange(routed.numel()) // width
    elif method == "gate-cluster":
        feats = gate if n_shared == 0 else gate[routed]  # routed == arange(d_ff) without shared: no gather copy
        labels = balanced_kmeans(feats, n_experts, kmeans_iters, seed, device)
    else:
        raise ValueError(f"unknown partition method {method!r}")
    return make_partition(labels, routed, shared, n_experts)


def partition_from_stats(method: str, stats, *, n_experts: int, n_shared: int, seed: int,
                         kmeans_iters: int = 8, device=None, down_norms: torch.Tensor | None = None) -> Partition:
    """Calibrated partition of one FFN from its NeuronStats.

    Shared neurons are the most often active ones (activation rate, as CMoE; mean |activation| breaks ties); with
    down_norms (‖W_down[:, i]‖ per neuron), those with the largest mean |activation| × ‖W_down[:, i]‖ instead: each
    neuron's share of the layer's output (shared_by = "contribution").
    `activation`: balanced k-means of the routed neurons' binary activation patterns over calibration tokens.
    `coactivation`: balanced k-means of their |activation| profiles, so the cosine between two neurons is their
    normalised co-activation (MoEfication-style grouping of neurons that fire together).
    """
    d_ff = stats.rate.numel()
    # rate first, mean |activation| as a tie-breaker (scaled below the smallest rate step)
    score = stats.rate.double() + stats.mean_abs.double() / (stats.mean_abs.double().max() + 1e-30) * 1e-6
    if down_norms is not None:
        score = stats.mean_abs.double() * down_norms.double().to(score.device)
    shared, routed = split_shared(score, n_shared)
    feats = {"activation": stats.pattern, "coactivation": stats.profile}.get(method)
    if feats is None:
        raise ValueError(f"unknown calibrated partition method {method!r}")
    feats = feats[routed].float()
    # neurons that never fired in the sample would have a zero feature vector: give them a tiny unique signal
    dead = feats.norm(dim=1) == 0
    if dead.any():
        feats[dead] = 1e-6
    labels = balanced_kmeans(feats, n_experts, kmeans_iters, seed, device)
    assert labels.numel() == d_ff - n_shared
    return make_partition(labels, routed, shared, n_experts)
