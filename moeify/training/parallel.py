"""Tuning across processes: torch.distributed with FSDP2, launched by torchrun (or `accelerate launch`).

`torchrun --nproc-per-node G -m moeify tune SRC OUT ...` starts G processes. The teacher is sharded across them
(moeify.tuning.load_teacher: every decoder layer's attention and FFN an FSDP2 group, each rank reading its own rows;
the embeddings, head and norms whole on every rank), and so are the student's trainable tensors (every carved
layer's MaskedMoE: experts, router, temperature), their gradients and Adam moments (FSDP2's `fully_shard`, which
gathers a group's weights for its forward and backward and reduce-scatters the gradients). Every forward of the
teacher gathers from all ranks, so its sampling and teacher pass run in step on every rank. Each optimizer step's windows are split across the ranks
(window r, r + G, ... to rank r), so a step sees the same windows as in one process and the gradient FSDP2 averages
is the one-process gradient. Rank 0 writes files (run state, the tuned output); collectives keep the ranks in step.
The backend is NCCL on GPUs (one per process, LOCAL_RANK) and gloo on CPUs. Nothing here moves data by hand: the
only collectives are FSDP2's own and metric averages; the ranks meet and share rank 0's decisions on the launcher's
store (below).

Offload (`moeify tune --offload`, chosen automatically when the memory model says the GPU is too small otherwise):
FSDP2's CPUOffloadPolicy keeps the student's trainable tensors, their gradients and Adam's moments in host memory
(the optimizer steps there) and brings each layer's weights to the GPU only for its forward and backward. In one
process it runs FSDP2 over a one-process group. On a CPU it changes nothing but the code path (tested in CI so the
path does not rot; pinned memory needs an accelerator, so it is pinned only on GPUs).

Runs that end (README "Many GPUs"): every decision that takes a rank into a collective or out of one is made once, by
rank 0, and shared (Parallel.share), or made by every rank and agreed (Parallel.agree: one rank's refusal is every
rank's); no rank re-reads a file another rank may be writing to decide it. The ranks meet at each phase of a run
(Parallel.arrive: the tuning text, the teacher pass, the loop, a snapshot, the output) on the launcher's key-value
store, waiting at most the collective timeout (--timeout, MOEIFY_TIMEOUT; 10 minutes), and a rank that does not
arrive in time is named in one error line on every rank that waited for it. The process group's own collectives
(FSDP2's gathers, the metric averages) time out after the same limit: on gloo as an error named by its phase here,
on NCCL by torch's watchdog, which ends the process. A stop (SIGINT, SIGTERM, to torchrun or to one rank) asks
the run to save at the end of its step; a rank that has not ended STOP_GRACE seconds after the signal (blocked in
a collective whose peer is gone) leaves at once, with one line saying where it stopped and how to resume.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import MoeifyError, ParallelError

DEFAULT_TIMEOUT = 600.0  # seconds a rank waits for the others at a phase or in a collective (both backends): far
# longer than the skew of ranks doing the same work (a cold disk, a shared host: seconds to minutes), far shorter
# than an allocation a hung job would burn
TIMEOUT_ENV = "MOEIFY_TIMEOUT"
STOP_GRACE = 20.0  # seconds a stopped rank waits for its step to end and its state to be saved (or the timeout,
# if shorter; MOEIFY_STOP_GRACE sets it); torchrun sends SIGKILL 30 s after its SIGTERM, so the rank's line comes first
STOP_GRACE_ENV = "MOEIFY_STOP_GRACE"


def collective_timeout(seconds: float | None = None) -> float:
    """The collective timeout of a run: `seconds` (--timeout), else MOEIFY_TIMEOUT, else DEFAULT_TIMEOUT."""
    where = "--timeout"
    if seconds is None and os.environ.get(TIMEOUT_ENV):
        where, seconds = TIMEOUT_ENV, os.environ[TIMEOUT_ENV]
    if seconds is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(seconds)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise MoeifyError(f"{where} must be a positive number of seconds, got {seconds!r}",
                          f"e.g. {where}{'=' if where == TIMEOUT_ENV else ' '}1800")
    return value


class _Sync:
    """What every copy of one run's Parallel shares: the launcher's store the ranks meet at, this run's keys, the
    counts of arrivals and shared decisions so far, the phase the rank is in, and the command that resumes."""

    def __init__(self, store, prefix: str):
        self.store, self.prefix = store, prefix
        self.arrivals = self.shares = 0
        self.phase = "starting"
        self.resume_hint = ""
        self.guard: _Guard | None = None


@dataclass
class Parallel:
    world: int = 1
    rank: int = 0
    device: str = "cpu"
    mesh: object = None
    offload: bool = False  # FSDP2 CPU offload of the sharded (trainable) tensors, their gradients and optimizer state
    own_group: bool = False  # this process created a one-process group for offload (destroyed by close())
    timeout: float = DEFAULT_TIMEOUT  # seconds (collective_timeout)
    sync: _Sync | None = None  # across processes: where the ranks meet (shared by copies of this Parallel)

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

    @property
    def phase(self) -> str:
        return self.sync.phase if self.sync is not None else ""

    @property
    def resume_hint(self) -> str:
        return self.sync.resume_hint if self.sync is not None else ""

    @resume_hint.setter
    def resume_hint(self, command: str) -> None:
        if self.sync is not None:
            self.sync.resume_hint = command

    def arrive(self, phase: str, then: str | None = None) -> None:
        """Every rank at `phase` before any goes on (a barrier on the launcher's store, polled, so a signal stops it
        and a rank that has not arrived within the timeout is named: ParallelError on every rank that waited).
        then: the phase the rank is in once all have arrived (default: `phase`), as errors name it."""
        if self.sync is None:
            return
        s = self.sync
        s.phase = phase
        s.arrivals += 1
        n, key = s.arrivals, f"{s.prefix}arrive/{s.arrivals}"
        self._store(lambda: s.store.set(f"{s.prefix}rank/{self.rank}", f"{n}\t{phase}"))
        self._store(lambda: s.store.add(key, 1))
        self._wait(lambda: s.store.add(key, 0) >= self.world, lambda: self._late(phase))
        s.phase = then or phase

    def at(self, phase: str) -> None:
        """Name the phase this rank is in (for the errors and stop lines; nothing is exchanged)."""
        if self.sync is not None:
            self.sync.phase = phase

    def share(self, value):
        """Rank 0's value on every rank (JSON: tuples arrive as lists): a decision made once, never re-derived by
        each rank from files another may be writing. `value` may be a function, then called on rank 0 only; a
        MoeifyError it raises is raised on every rank."""
        if self.sync is None:
            return value() if callable(value) else value
        s = self.sync
        s.shares += 1
        key = f"{s.prefix}share/{s.shares}"
        if self.main:
            try:
                v = value() if callable(value) else value
            except MoeifyError as exc:
                self._store(lambda: s.store.set(key, json.dumps({"error": [exc.what, exc.hint]})))
                raise
            self._store(lambda: s.store.set(key, json.dumps({"value": v})))
            return v
        what = s.phase or "the run"
        self._wait(lambda: s.store.check([key]), lambda: ParallelError(
            f"rank 0 did not share its decision in {what} within {self.timeout:g} s (the collective timeout)",
            self._hint()))
        got = json.loads(self._store(lambda: s.store.get(key)))
        if "error" in got:
            raise MoeifyError(*got["error"])
        return got["value"]

    def agree(self, work, phase: str):
        """work() on every rank, then every rank at `phase` (arrive); if it raised MoeifyError on any rank, every
        rank raises the first such rank's (a refusal is everyone's, so no rank waits for one that gave up)."""
        error, result = None, None
        try:
            result = work()
        except MoeifyError as exc:
            if self.sync is None:
                raise
            error = exc
        if self.sync is None:
            return result
        s = self.sync
        n = s.arrivals + 1
        if error is not None:
            self._store(lambda: s.store.set(f"{s.prefix}refused/{n}/{self.rank}",
                                            json.dumps([error.what, error.hint])))
            self._store(lambda: s.store.add(f"{s.prefix}refusals/{n}", 1))
        self.arrive(phase)
        if self._store(lambda: s.store.add(f"{s.prefix}refusals/{n}", 0)):
            for q in range(self.world):
                k = f"{s.prefix}refused/{n}/{q}"
                if self._store(lambda: s.store.check([k])):
                    if q == self.rank:
                        raise error
                    raise MoeifyError(*json.loads(self._store(lambda: s.store.get(k))))
        return result

    def failure(self, exc: BaseException) -> ParallelError | None:
        """The one-line error for a collective of the process group that failed (a gloo timeout, or another rank
        gone: its connection closed), naming the phase; None for any other exception."""
        if self.sync is None or not isinstance(exc, RuntimeError) or isinstance(exc, MoeifyError):
            return None
        text = str(exc)
        phase = self.sync.phase
        if "Timed out" in text or "timed out" in text:
            late = self._late(phase, in_collective=True)
            return late
        if any(m in text for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "NCCL communicator was aborted", "remote process exited")):
            return ParallelError(f"another rank stopped during {phase} (its connection closed): rank {self.rank} "
                                 "cannot go on", self._hint(waited=False))
        return None

    def _late(self, phase: str, in_collective: bool = False) -> ParallelError:
        """A rank did not arrive: which (those whose last arrival is behind this rank's), and where they are."""
        s = self.sync
        behind = []
        try:
            for q in range(self.world):
                k = f"{s.prefix}rank/{q}"
                if not s.store.check([k]):
                    behind.append((q, "not started"))
                    continue
                n, where = s.store.get(k).decode().split("\t", 1)
                if int(n) < s.arrivals:
                    behind.append((q, where))
        except Exception:  # the store is gone too: say what this rank knows
            behind = []
        if behind:
            names = ", ".join(str(q) for q, _ in behind[:8]) + (f" and {len(behind) - 8} more" if len(behind) > 8
                                                                  else "")
            who = f"rank{'s' if len(behind) > 1 else ''} {names}"
            still = "; ".join(f"rank {q} is still at {w}" if w != "not started" else f"rank {q} has not started"
                              for q, w in behind[:3])
            what = f"{who} did not arrive at {phase} within {self.timeout:g} s (the collective timeout; {still})"
        elif in_collective:
            what = (f"a collective of {phase} did not complete within {self.timeout:g} s (the collective timeout): "
                    "another rank stopped answering")
        else:
            what = f"a rank did not arrive at {phase} within {self.timeout:g} s (the collective timeout)"
        return ParallelError(what, self._hint())

    def _hint(self, waited: bool = True) -> str:
        resume = (f"continue from the last saved step with: {self.resume_hint}" if self.resume_hint else
                  "--resume continues from the last saved step")
        return f"every rank stops; {resume}" + (f"; --timeout SECONDS (or {TIMEOUT_ENV}) waits longer" if waited
                                                else "")

    def _store(self, op):
        try:
            return op()
        except MoeifyError:
            raise
        except Exception as exc:  # the store's host is gone (it runs in torchrun's agent, or in rank 0)
            raise ParallelError(f"rank {self.rank} lost the other ranks in {self.phase or 'the run'} (their store: "
                                f"{str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__})",
                                self._hint()) from None

    def _wait(self, done, late) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while not self._store(done):
            if time.monotonic() >= deadline:
                raise late()
            time.sleep(pause)
            pause = min(0.05, 2 * pause)

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
        """Leave the process group (the end of a run), and stop watching for signals."""
        if self.sync is not None and self.sync.guard is not None:
            self.sync.guard.stop()
            self.sync.guard = None
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


def setup(device: str, timeout: float | None = None) -> Parallel:
    """One process (WORLD_SIZE unset or 1): Parallel(1, 0, device). Under torchrun / accelerate launch: join the
    process group (NCCL on GPUs, gloo on CPUs) with the collective timeout, one GPU per process (LOCAL_RANK), a
    one-dimensional device mesh, this run's keys on the launcher's store, and a watch for stop signals."""
    timeout = collective_timeout(timeout)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Parallel(device=device, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()  # the launcher's (torchrun's agent hosts it)
    generation = store.add(f"moeify/setups/{rank}", 1)  # every rank sets up as often: one prefix a run
    par = Parallel(dist.get_world_size(), rank, device, mesh, timeout=timeout, sync=_Sync(store, f"moeify/{generation}/"))
    if threading.current_thread() is threading.main_thread():
        par.sync.guard = _Guard(par)
    return par


class _Guard:
    """Stops that stop: a thread woken by SIGINT / SIGTERM through signal.set_wakeup_fd (which the interpreter writes
    to at once, even while the main thread is blocked in a collective and cannot run Python's handler). The handler
    asks the run to stop at the end of its step (or raises KeyboardInterrupt outside the loop); if the process has
    not ended STOP_GRACE seconds later (or the collective timeout, if shorter), or at a second signal, this thread
    prints where the rank stopped and how to resume, and ends the process."""

    def __init__(self, par: Parallel):
        grace = os.environ.get(STOP_GRACE_ENV)
        try:
            grace = float(grace) if grace else STOP_GRACE
        except ValueError:
            raise MoeifyError(f"{STOP_GRACE_ENV} must be a number of seconds, got {grace!r}") from None
        self.par, self.grace = par, min(max(0.0, grace), par.timeout)
        self._r, self._w = socket.socketpair()
        self._w.setblocking(False)
        self._old = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="moeify-stop-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        signals, deadline = [], None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = select.select([self._r], [], [], wait)[0]
                data = self._r.recv(64) if ready else b""
            except (OSError, ValueError):
                return  # closed: the run ended
            if ready and not data:
                return
            signals += [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
            if len(signals) >= 2:
                self._leave(signals[0], "a second signal")
            if signals and deadline is None:
                deadline = time.monotonic() + self.grace
            elif deadline is not None and time.monotonic() >= deadline:
                self._leave(signals[0], f"still running {self.grace:g} s after the signal")

    def _leave(self, signum: int, why: str) -> None:
        par = self.par
        resume = (f"continue from the last saved step with: {par.resume_hint}" if par.resume_hint else
                  "what was saved is kept")
        sys.stderr.write(f"interrupted: rank {par.rank} stopped by {signal.Signals(signum).name} in "
                         f"{par.phase or 'the run'} ({why}); {resume}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def stop(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old)
        for sock in (self._w, self._r):
            sock.close()
