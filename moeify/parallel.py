"""Tuning across processes: torch.distributed with FSDP2, launched by torchrun (or `accelerate launch`).

`torchrun --nproc-per-node G -m moeify tune SRC OUT ...` starts G processes; each holds the teacher (replicated),
and the student's trainable tensors (every carved layer's MaskedMoE: experts, router, temperature), their gradients
and Adam moments are sharded across the processes by FSDP2 (`fully_shard`, which gathers a layer's weights for its
forward and backward and reduce-scatters the gradients). Each optimizer step's windows are split across the ranks
(window r, r + G, ... to rank r), so a step sees the same windows as in one process and the gradient FSDP2 averages
is the one-process gradient. Rank 0 writes files (run state, the tuned output); collectives keep the ranks in step.
The backend is NCCL on GPUs (one per process, LOCAL_RANK) and gloo on CPUs. Nothing here moves data by hand: the
only collectives are FSDP2's own, metric averages, a barrier and broadcasts of rank 0's decisions.
"""

from __future__ import annotations

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

    @property
    def on(self) -> bool:
        return self.world > 1

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

    def shard(self, module: torch.nn.Module) -> None:
        """FSDP2 over all ranks for this module's parameters (no-op in one process)."""
        if self.on:
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=self.mesh)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (a collective: every rank must call it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def assign(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole tensor into p, which may be a sharded DTensor (each rank keeps its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.reshape(p.shape)  # a state saved when a scalar was 0-dim (the temperature) loads into its (1,)
    with torch.no_grad():
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(value.to(p.device_mesh.device_type).to(p.dtype), p.device_mesh, p.placements))
        else:
            p.copy_(value.to(p.device))


def like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value laid out as p is (a DTensor with p's mesh and placements when p is one)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.reshape(p.shape)
    if isinstance(p, DTensor):
        return distribute_tensor(value.to(p.device_mesh.device_type), p.device_mesh, p.placements)
    return value.to(p.device)


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
