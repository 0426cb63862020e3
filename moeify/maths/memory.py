"""Peak memory of recovery tuning per process, predicted from the config alone (no weights read).

What the tune stage (`moeify/tuning/`) holds while it tunes (moeify.training.distill; every term is a tensor the code keeps):
- the teacher, as loaded: every dense parameter in float32. In one process it is loaded whole. Across processes
  (torchrun) it is sharded (moeify.tuning.load_teacher): every decoder layer's attention and FFN are FSDP2 groups
  split across the processes, gathered one group at a time for each forward (two at once: the one computing and
  the one fetched next), while the embeddings, output head and norms are whole on every process;
- before tuning the teacher pass has computed every target, and the carved layers' FFNs of the teacher are freed
  (`teacher_freed`): on a GPU, and across processes (with the teacher in the loop instead, `teacher_inline`, one
  GPU: its FFNs stay, in bf16 under autocast); in one process on a CPU the freed weights are pages of the
  memory-mapped safetensors file, which stays mapped while the rest of the teacher uses it (measured: RSS
  unchanged). Under bf16 autocast in one process the FFNs of layers kept dense are stored in bf16 (share_frozen:
  autocast casts them at every call anyway): half of them freed on a GPU, a bf16 copy beside the mapped file on a
  CPU;
- the student's own tensors: the carved FFNs (gate, up, down at the dense width: the masked student computes every
  neuron) and routers in float32, their gradients and Adam's two moments (4 copies, sharded across processes; the
  FFNs once with --router-only, frozen), and
  the dense layers' FFNs (student copies, frozen; shared with a sharded teacher); with --tune-attention the
  attention projections and norms too (4 copies);
- the activations autograd keeps for the backward pass of one micro-batch (one window of seq tokens): per token and
  layer about 6 d_ff (the FFN's gate and up products, their activation and product, the mask and the masked
  product) plus 10 d (the norms, q/k/v/attention output and the FFN input) values, in float32, or half of that in
  bf16 under autocast; and under autocast the bf16 copies of every trainable weight it casts, which autograd saves
  for the backward pass (2 bytes a trainable parameter). Under FSDP2 (across processes, or offloaded) the experts
  compute in bf16 by FSDP2's MixedPrecisionPolicy instead (moeify.training.parallel.Parallel.shard_moe: each layer's bf16
  weights gathered for its forward and freed after it), so only trained attention is copied: autocast's copies
  would outlive FSDP2's resharding, the whole student on every process;
- with --hidden-weight, the teacher's output of every layer (float32: the residual stream stays float32 under
  autocast) and the error against it that autograd saves for the layer-match term (moeify.training.hidden);
- the KL of one chunk: four (chunk, vocabulary) float32 tensors at once (logits, both log-softmaxes, the teacher's
  probabilities), and under bf16 autocast the output head's bf16 copy the gradient product uses;
- the sampling of tuning text, before the student exists: the teacher, its KV cache for a batch of windows (float32:
  2 · layers · kv_heads · head_dim values per token) and the kept final hidden states;
- a process baseline (the Python runtime, torch and transformers, the tokenizer): measured, about 0.5 GB on CPU.
With offload (FSDP2 CPU offload, a GPU run) the student's tensors, gradients and Adam moments move to host memory
(`host`, per process), and the GPU holds the weights and gradients of about two carved layers at a time (the one
computing and the one FSDP2 fetches next), in float32. Saving the run's state (every 10 minutes, and the best
checked weights) gathers the trainable tensors and Adam's moments whole into the host memory of the process that
writes them, one tensor at a time, written as it comes (`save_host`: the largest one, on rank 0; a GPU or a run
across processes; in one CPU process they are the tensors themselves).
The prediction is the larger of the sampling and tuning phases. scripts/bench_memory.py holds it against the measured
peak (RSS on CPU, torch.cuda.max_memory_allocated on a GPU); BENCHMARKS.md "Tuning speed" ("Tuning memory") has
the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_BASELINE = 500 * 10**6  # bytes: python + torch + transformers + moeify + a tokenizer, measured peak RSS on CPU


@dataclass(frozen=True)
class TuneMemory:
    teacher: int
    student: int  # the student's own weights, gradients and Adam moments (and frozen dense-layer FFN copies)
    activations: int
    kl: int
    sampling: int  # KV cache and kept hidden states of one sampling batch
    baseline: int
    host: int = 0  # host memory of an offloaded run (the student's state), per process, besides the device's peak
    teacher_freed: int = 0  # the teacher's carved FFNs, freed after the teacher pass (not held while tuning)
    save_host: int = 0  # host memory of the writing process while it saves the run's state (one whole tensor)
    world: int = 1

    @property
    def tuning_peak(self) -> int:
        return self.teacher - self.teacher_freed + self.student + self.activations + self.kl + self.baseline

    @property
    def sampling_peak(self) -> int:
        return self.teacher + self.sampling + self.baseline

    @property
    def peak(self) -> int:
        return max(self.tuning_peak, self.sampling_peak)

    def to_dict(self) -> dict:
        return {"teacher": self.teacher, "student": self.student, "activations": self.activations, "kl": self.kl,
                "sampling": self.sampling, "baseline": self.baseline, "tuning_peak": self.tuning_peak,
                "sampling_peak": self.sampling_peak, "peak": self.peak, "host": self.host,
                "teacher_freed": self.teacher_freed, "save_host": self.save_host, "world": self.world,
                "host_total": self.host_total}

    @property
    def host_total(self) -> int:
        """Host memory of the machine beyond the devices' (all processes on one machine): the offloaded state of
        every process and the writer's saved copies."""
        return self.host * self.world + self.save_host


def sampling_bytes_per_window(*, seq: int, n_layers: int, kv_heads: int, head_dim: int, hidden: int,
                              vocab: int) -> int:
    """Bytes one window adds to the sampling phase: its float32 KV cache (static, the whole window), the final
    hidden states kept at every position, and a step's logits and sampling probabilities."""
    return seq * (n_layers * 2 * kv_heads * head_dim * 4 + hidden * 4) + vocab * 4 * 2


def tuning_memory(*, hidden: int, d_ff: int, n_layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                  tied: bool, experts: int, dense_layers: int = 0, seq: int = 512, micro_windows: int = 1,
                  kl_chunk: int = 256, sample_batch: int = 64, bf16: bool = False, train_attention: bool = False,
                  device: str = "cpu", world: int = 1, offload: bool = False,
                  teacher_inline: bool = False, train_experts: bool = True, layer_match: bool = False) -> TuneMemory:
    """Predicted bytes of each part of a tuning run (see the module docstring), per process: across `world`
    processes (torchrun, moeify.training.parallel) FSDP2 shards the teacher's decoder layers and the student's trainable
    tensors, gradients and Adam moments; every process holds the embeddings, head and norms and one window's
    activations. offload (a GPU run): the student's state in host memory instead (TuneMemory.host). train_experts
    False (--router-only): the carved FFNs are held once, frozen (no gradients or Adam moments of their own).
    layer_match (--hidden-weight): every layer's output of the teacher (float32) and of the error against it that
    autograd saves (moeify.training.hidden.layer_match), 8 bytes a token, layer and hidden unit, held at once."""
    h, f, L = hidden, d_ff, n_layers
    proj = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o, k, v projections
    attn = proj + 2 * h  # and the layer's two norms
    ffn = 3 * h * f
    embed = vocab * h * (1 if tied else 2) + h
    carved = L - dense_layers
    sharded = world > 1
    if sharded:  # the layers' attention and FFN split across the processes, two groups gathered at a time
        teacher = 4 * (embed + L * 2 * h) + -(-4 * L * (proj + ffn) // world) + 2 * 4 * max(proj, ffn)
        freed = -(-4 * carved * ffn // world)
    else:
        teacher = 4 * (embed + L * attn + L * ffn)
        if device != "cpu" and teacher_inline:  # the teacher runs in the loop: its FFNs are kept, in bf16 under
            freed = 2 * L * ffn if bf16 else 0  # autocast (share_frozen), half of what was loaded
        elif device != "cpu":
            freed = 4 * carved * ffn + (2 * dense_layers * ffn if bf16 else 0)
        else:  # mapped pages stay; bf16 copies of the dense layers' FFNs come beside them
            freed = -(2 * dense_layers * ffn if bf16 else 0)
    trainable = carved * ((ffn if train_experts else 0) + experts * h + 1) + (L * attn if train_attention else 0)
    own_dense = 0 if sharded else 4 * dense_layers * ffn  # a sharded teacher's dense FFNs are shared
    frozen = 0 if train_experts else -(-4 * carved * ffn // world)  # the carved FFNs, weights alone
    student = -(-4 * 4 * trainable // world) + own_dense + frozen
    host = 0
    if offload and device != "cpu":  # on a CPU the "host" is the device: nothing moves
        host = student - own_dense
        student = 2 * 2 * 4 * (ffn + experts * h + 1) + own_dense
    save_host = 4 * max(h * f, h * heads * head_dim) if (device != "cpu" or sharded) else 0  # one tensor, whole
    act_bytes = 2 if bf16 else 4
    tokens = seq * micro_windows
    activations = tokens * L * (6 * f + 10 * h) * act_bytes + tokens * h * 4 * 2  # + final hidden and its gradient
    if layer_match:  # the teacher's layer outputs until the loss, the errors' float32 copies until the backward
        activations += tokens * L * h * 4 * 2
    if bf16:  # autocast's bf16 copies of the trainable weights it casts, saved for the backward pass; under FSDP2
        fsdp = sharded or (offload and device != "cpu")  # (across processes, or offloaded) the experts compute in
        cast = trainable + (0 if train_experts else carved * ffn)  # frozen experts are cast (and saved) alike
        activations += 2 * (L * attn if train_attention else 0) if fsdp else 2 * cast  # bf16 by its policy
    kl = 4 * kl_chunk * vocab * 4 + (vocab * h * 2 if bf16 else 0)  # + the head's bf16 copy for the gradient
    sampling = sample_batch * sampling_bytes_per_window(seq=seq, n_layers=L, kv_heads=kv_heads, head_dim=head_dim,
                                                        hidden=h, vocab=vocab)
    return TuneMemory(teacher, student, activations, kl, sampling, CPU_BASELINE if device == "cpu" else 0, host,
                      freed, save_host, world)


def source_tuning_memory(src, experts: int, dense_layers: int = 0, **kw) -> TuneMemory:
    """tuning_memory of a moeify.formats.families.SourceModel."""
    return tuning_memory(hidden=src.hidden, d_ff=src.d_ff, n_layers=src.n_layers, heads=src.heads,
                         kv_heads=src.kv_heads, head_dim=src.head_dim, vocab=src.vocab, tied=src.tied,
                         experts=experts, dense_layers=dense_layers, **kw)


def device_memory(device: str) -> int | None:
    """Total memory of the device tuning runs on: the GPU's, or this machine's RAM; None when unknown."""
    import os

    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.device(device)).total_memory
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


GPU_COUNTS = (1, 2, 4, 8)


def memory_table(src, experts: int, dense_layers: int = 0, seq: int = 512) -> list[dict]:
    """Predicted peak per process of tuning, float32 on a CPU and bf16 on GPUs across 1-8 processes, and offloaded
    on 1 and 8 GPUs (`moeify plan`); "host": the machine's host memory beyond the devices (TuneMemory.host_total)."""
    rows = [{"device": "cpu", "processes": 1,
             "peak": source_tuning_memory(src, experts, dense_layers, seq=seq, device="cpu").peak}]
    rows += [{"device": "cuda", "processes": g, "offload": False,
              "peak": source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda", world=g).peak}
             for g in GPU_COUNTS]
    for at, g in ((2, 1), (len(rows) + 1, GPU_COUNTS[-1])):
        off = source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda", offload=True,
                                   world=g)
        rows.insert(at, {"device": "cuda", "processes": g, "offload": True, "peak": off.peak, "host": off.host_total})
    for r in rows:
        if not r.get("offload") and r["device"] == "cuda":
            r["host"] = source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda",
                                             world=r["processes"]).host_total
    return rows


def fits(mem: TuneMemory, have: int | None, host_have: int | None) -> bool:
    """Whether a prediction fits the device's memory (and the host's: offloaded state, saved copies)."""
    return (have is None or mem.peak <= have) and (host_have is None or mem.host_total <= host_have)


def gpu_layout(src, experts: int, dense_layers: int, seq: int, have: float, host_have: float | None):
    """The fewest GPUs (of GPU_COUNTS, each with `have` bytes) that fit a tuning run, plain before offloaded at the
    same count: (count, offload, prediction), or None."""
    for g in GPU_COUNTS:
        for off in (False, True):
            mem = source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda", world=g,
                                       offload=off)
            if fits(mem, have, host_have):
                return g, off, mem
    return None


def check_fits(mem: TuneMemory, device: str, have: int | None, src, experts: int, dense_layers: int = 0,
               seq: int = 512) -> None:
    """Refuse a tuning run whose predicted peak per process exceeds the device's memory (or whose host memory
    exceeds the machine's), naming what would fit."""
    from ..errors import MoeifyError

    gpu = device.startswith("cuda")
    host_have = device_memory("cpu") if gpu and mem.host_total else None
    if fits(mem, have, host_have):
        return
    per_gpu = have if gpu else 80e9
    layout = gpu_layout(src, experts, dense_layers, seq, per_gpu, device_memory("cpu") if gpu else None)
    if layout is None:
        hint = "no layout of up to 8 GPUs fits"
    else:
        g, off, best = layout
        cmd = "moeify tune" if g == 1 else f"torchrun --nproc-per-node {g} -m moeify tune"
        hint = (f"run on {g} GPU{'s' if g > 1 else ''}{' with --offload' if off else ''}: {cmd} ...{' --offload' if off else ''} "
                f"(predicted {best.peak / 1e9:.0f} GB each{'' if gpu else ' on 80 GB GPUs'}"
                f"{f', {best.host_total / 1e9:.0f} GB host' if off else ''})")
    if have is not None and mem.peak <= have:
        raise MoeifyError(f"tuning needs about {mem.host_total / 1e9:.1f} GB of host memory (the offloaded state and "
                          f"the saved copies; predicted: moeify/maths/memory.py), and this machine has "
                          f"{host_have / 1e9:.1f} GB", f"{hint}; or pass --no-memory-check to try anyway")
    raise MoeifyError(f"tuning needs about {mem.peak / 1e9:.1f} GB on {device} (predicted: moeify/maths/memory.py), and "
                      f"{device} has {have / 1e9:.1f} GB", f"{hint}; or convert with --no-tune; or pass "
                      "--no-memory-check to try anyway")


def choose_offload(plain: TuneMemory, offloaded: TuneMemory, device: str, have: int | None) -> bool:
    """auto, from the run's predictions without and with offload: offload on a GPU when the run does not fit it as
    it is and fits it offloaded (host memory permitting)."""
    if not device.startswith("cuda") or have is None or fits(plain, have, device_memory("cpu")):
        return False
    return fits(offloaded, have, device_memory("cpu"))


# ------------------------------------------------------------------ next-token training of an upcycle or a merge

HOST_PER_GPU = 240 * 10**9  # bytes of host memory per GPU an offloaded run may use (a DGX H100 node: 2 TB, 8 GPUs)
PROCESS_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class TrainMemory:
    """Peak memory per process of `moeify tune OUT --tune-text` on an upcycle or merge (moeify.tuning.lm), by part."""

    weights: int  # the float32 master weights this process holds (1/world of them across processes)
    state: int  # gradients and AdamW's two moments of what trains (float32, 1/world of them)
    gathered: int  # the weights computed with: FSDP2's gathered layers (and one layer's whole gradients), or
    # autocast's bf16 copies of the trained weights in one process
    activations: int  # what autograd keeps of one forward (the windows a forward on this process)
    logits: int  # the output head's logits and the cross-entropy's float32 copies and gradient
    baseline: int
    host: int = 0  # offloaded: the weights and state in host memory instead, per process
    world: int = 1

    @property
    def peak(self) -> int:
        return self.weights + self.state + self.gathered + self.activations + self.logits + self.baseline

    def to_dict(self) -> dict:
        return {"weights": self.weights, "state": self.state, "gathered": self.gathered,
                "activations": self.activations, "logits": self.logits, "baseline": self.baseline,
                "peak": self.peak, "host": self.host, "world": self.world}


def train_memory(*, hidden: int, n_layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tied: bool,
                 experts: int, top_k: int, expert_width: int, shared_width: int = 0, seq: int = 512,
                 windows: int = 1, world: int = 1, offload: bool = False, device: str = "cuda", bf16: bool = True,
                 train_router: bool = True, train_experts: bool = True, train_attention: bool = False) -> TrainMemory:
    """Predicted bytes per process of next-token training of an MoE of this shape (moeify.tuning.lm: float32 master
    weights, AdamW on what trains; `windows` windows of `seq` tokens a forward on each process). Across `world`
    processes FSDP2 shards every decoder layer (a group each, its experts sharded with it) and the rest (embeddings,
    head, final norm), gathering a layer for its forward and the next one ahead (bf16 on a GPU: its
    MixedPrecisionPolicy), and a layer's whole gradients before they are reduce-scattered; offload (a GPU run): the
    float32 weights, gradients and moments in host memory (TrainMemory.host), the GPU holds what it computes with."""
    h, L = hidden, n_layers
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 2 * h
    expert_params = experts * 3 * h * expert_width + 3 * h * shared_width + (h if shared_width else 0)
    router = experts * h
    layer = attn + expert_params + router
    rest = vocab * h * (1 if tied else 2) + h
    total = L * layer + rest
    trained = L * ((router if train_router else 0) + (expert_params if train_experts else 0)
                   + (attn if train_attention else 0))
    sharded = world > 1 or (offload and device != "cpu")
    lowp = 2 if bf16 else 4
    weights, state = -(-4 * total // world), -(-12 * trained // world)
    if sharded:  # two layers gathered (the one computing, the next fetched) and the rest; a layer's gradients whole
        gathered = lowp * (2 * layer + rest) + 4 * (trained // L)
    else:  # autocast keeps a bf16 copy of every trained weight it casts for the backward pass
        gathered = 2 * trained if bf16 else 0
    tokens = seq * windows
    act = 2 if bf16 else 4
    per_token_layer = top_k * (4 * expert_width + 3 * h) + (4 * shared_width + 3 * h if shared_width else 0) \
        + 10 * h + 2 * experts
    activations = tokens * L * per_token_layer * act + tokens * h * 4 * 2
    logits = tokens * vocab * (3 * 4 + (2 if bf16 else 0))
    host = 0
    if offload and device != "cpu":
        host, weights, state = weights + state, 0, 0
    return TrainMemory(weights, state, gathered, activations, logits, CPU_BASELINE if device == "cpu" else 0, host,
                       world)


def train_windows(world: int, step_windows: int = 8) -> int:
    """Windows a forward on each GPU process: a step's (4,096 tokens of 512: 8) split across the processes, one at
    least (moeify.tuning.lm on a GPU runs a process's share of a step in one forward)."""
    return max(1, step_windows // world)


def gpus_needed(memory_at, gpu_bytes: float, host_per_gpu: float = HOST_PER_GPU) -> dict:
    """The fewest processes (of PROCESS_COUNTS, one GPU each) whose predicted peak fits gpu_bytes: plain, and
    offloaded with at most host_per_gpu of host memory a process. memory_at(world, offload) -> TrainMemory.
    {"plain": n or None, "offload": n or None}."""
    plain = next((n for n in PROCESS_COUNTS if memory_at(n, False).peak <= gpu_bytes), None)
    off = next((n for n in PROCESS_COUNTS if memory_at(n, True).peak <= gpu_bytes
                and memory_at(n, True).host <= host_per_gpu), None)
    return {"plain": plain, "offload": off}
