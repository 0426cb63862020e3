"""Tuning across processes: torch.distributed with FSDP2, launched by torchrun (or `accelerate launch`).

`torchrun --nproc-per-node G -m moeify tune SRC OUT ...` starts G processes. The teacher is sharded across them
(moeify.tune.load_teacher: every decoder layer's attention and FFN an FSDP2 group, each rank reading its own rows;
the embeddings, head and norms whole on every rank), and so are the student's trainable tensors (every carved
layer's MaskedMoE: experts, router, temperature), their gradients and Adam moments (FSDP2's `fully_shard`, which
gathers a group's weights for its forward and backward and reduce-scatters the gradients). Every forward of the
teacher gathers from all ranks, so its sampling and teacher pass run in step on every rank. Each optimizer step's windows are split across the ranks
(window r, r + G, ... to rank r), so a step sees the same windows as in one process and the gradient FSDP2 averages
is the one-process gradient. Rank 0 writes files (run state, the tuned output); collectives keep the ranks in step.
The backend is NCCL on GPUs (one per process, LOCAL_RANK) and gloo on CPUs. Nothing here moves data by hand: the
only collectives are FSDP2's own, metric averages, a barrier and broadcasts of rank 0's decisions.

Offload (`moeify tune --offload`, chosen automatically when the memory model says the GPU is too small otherwise):
FSDP2's CPUOffloadPolicy keeps the student's trainable tensors, their gradients and Adam's moments in host memory
(the optimizer steps there) and brings each layer's weights to the GPU only for its forward and backward. In one
process it runs FSDP2 over a one-process group. On a CPU it changes nothing but the code path (tested in CI so the
path does not rot; pinned memory needs an accelerator, so it is pinned only on GPUs).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Parallel:
    world: int = 1
    rank: int = 0
    device: str = "cpu"
    mesh: object = None
    offload: bool = False  # FSDP2 CPU offload of the sharded (trainable) tensors, their gradients and optimizer state
    own_group: bool = False  # this process created a one-process group for offload (destroyed by close())

    @property
    def on(self) -> bool:
        return self.world > 1

    @property
    def sharded(self) -> bool:
        """Whether the student's MaskedMoEs go through FSDP2 (across processes, or for offload in one)."""
        return self.mesh is not None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.on:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The average over ranks of a 0-dim tensor (every rank gets it)."""
        if not self.on:
            return value
        value = value.detach().clone().to(self.comm_device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world

    def any(self, flag: bool) -> bool:
        """Whether any rank says so (every rank gets the answer)."""
        if not self.on:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    @property
    def comm_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"

    def most(self, n: int) -> int:
        """The largest n of any rank (every rank gets it): how many forwards every rank runs in a lockstep round."""
        if not self.on:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def rows(self, n: int) -> tuple[int, int]:
        """This rank's rows of a tensor with n rows sharded on dim 0 as FSDP2 shards it (torch.chunk: ceil(n / world)
        rows a rank, the last ranks fewer or none)."""
        c = -(-n // self.world)
        return min(n, self.rank * c), min(n, (self.rank + 1) * c)

    def shard_moe(self, moe: torch.nn.Module, lowp: torch.dtype | None = None) -> None:
        """FSDP2 for a student's MaskedMoE: its routing (router rows, temperature) a float32 group of its own, then
        its experts. lowp (bf16, when tuning runs under bf16 autocast): the experts' group computes in lowp by
        FSDP2's MixedPrecisionPolicy (float32 shards, optimizer and gradient reduction; each forward gathers the
        lowp weights and frees them after it). Autocast would otherwise keep its own lowp copy of every gathered
        weight for the backward pass: the whole student on every process."""
        if self.mesh is None:
            return
        self.shard(moe.routing)
        self.shard(moe, lowp)

    def shard(self, module: torch.nn.Module, lowp: torch.dtype | None = None) -> None:
        """FSDP2 over all ranks for this module's parameters, offloaded to host memory with offload (no-op in one
        process without offload). Resharded after every forward, its own root included (FSDP2's default keeps a
        root's weights whole after forward: every MaskedMoE is a root, so a no-grad forward, the held-out check or
        the sampling, would leave the whole student gathered on every rank)."""
        if self.mesh is not None:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

            policy = CPUOffloadPolicy(pin_memory=self.device.startswith("cuda")) if self.offload else OffloadPolicy()
            mp = MixedPrecisionPolicy(param_dtype=lowp, reduce_dtype=torch.float32, cast_forward_inputs=False)
            fully_shard(module, mesh=self.mesh, offload_policy=policy, reshard_after_forward=True, mp_policy=mp)

    def shard_frozen(self, module: torch.nn.Module) -> None:
        """FSDP2 over all ranks for a frozen module of the teacher (its attention, its FFN): each rank holds 1/world
        of its weights, gathered for each forward and resharded after it; never offloaded (nothing to step)."""
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=self.mesh, reshard_after_forward=True)

    def close(self) -> None:
        """Leave the process group (the end of a run)."""
        if self.mesh is not None and dist.is_initialized():
            dist.destroy_process_group()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (a collective: every rank must call it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:  # offloaded: the collective runs on the mesh's device
        t = DTensor.from_local(local.to(t.device_mesh.device_type), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
    return t.full_tensor()


def assign(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole tensor into p, which may be a sharded DTensor (each rank keeps its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.reshape(p.shape)  # a state saved when a scalar was 0-dim (the temperature) loads into its (1,)
    with torch.no_grad():
        if isinstance(p, DTensor):  # this rank's shard, wherever it lives (the GPU, or host memory when offloaded)
            d = distribute_tensor(value.to(p.device_mesh.device_type).to(p.dtype), p.device_mesh, p.placements)
            p.to_local().copy_(d.to_local())
        else:
            p.copy_(value.to(p.device))


def like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value laid out as p is (a DTensor with p's mesh and placements when p is one)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.reshape(p.shape)
    if isinstance(p, DTensor):
        d = distribute_tensor(value.to(p.device_mesh.device_type), p.device_mesh, p.placements)
        local = d.to_local().to(p.to_local().device)  # beside p's shard (host memory when offloaded)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return value.to(p.device)


def with_offload(par: Parallel) -> Parallel:
    """par with FSDP2 CPU offload on; in one process, over a one-process group this process creates."""
    if par.mesh is not None:
        return dataclasses.replace(par, offload=True)
    from torch.distributed.device_mesh import init_device_mesh

    cuda = par.device.startswith("cuda")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (1,))
    return Parallel(1, 0, par.device, mesh, True, own)


def setup(device: str) -> Parallel:
    """One process (WORLD_SIZE unset or 1): Parallel(1, 0, device). Under torchrun / accelerate launch: join the
    process group (NCCL on GPUs, gloo on CPUs), one GPU per process (LOCAL_RANK), a one-dimensional device mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Parallel(device=device)
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    return Parallel(dist.get_world_size(), dist.get_rank(), device, mesh)
