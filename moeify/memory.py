"""Peak memory of recovery tuning on one device, predicted from the config alone (no weights read).

What `moeify/tune.py` holds while it tunes (moeify.distill; every term is a tensor the code keeps):
- the teacher: every dense parameter in float32, except its FFN weights, stored in bf16 when tuning runs under bf16
  autocast (share_frozen: autocast casts them at every call anyway); on a GPU, while tuning, without the FFNs of
  the carved layers, freed once the teacher pass has computed every target (moeify.tune.teacher_pass);
- the student's own tensors: the carved FFNs (gate, up, down at the dense width: the masked student computes every
  neuron) and routers in float32, their gradients and Adam's two moments (4 copies), and the dense layers' FFNs
  (student copies, frozen); with --tune-attention the attention projections and norms too (4 copies);
- the activations autograd keeps for the backward pass of one micro-batch (one window of seq tokens): per token and
  layer about 6 d_ff (the FFN's gate and up products, their activation and product, the mask and the masked
  product) plus 10 d (the norms, q/k/v/attention output and the FFN input) values, in float32, or half of that in
  bf16 under autocast;
- the KL of one chunk: four (chunk, vocabulary) float32 tensors at once (logits, both log-softmaxes, the teacher's
  probabilities), and under bf16 autocast the output head's bf16 copy the gradient product uses;
- the sampling of tuning text, before the student exists: the teacher, its KV cache for a batch of windows (float32:
  2 · layers · kv_heads · head_dim values per token) and the kept final hidden states;
- a process baseline (the Python runtime, torch and transformers, the tokenizer): measured, about 0.5 GB on CPU.
With offload (FSDP2 CPU offload, a GPU run) the student's tensors, gradients and Adam moments move to host memory
(`host`), and the GPU holds the weights and gradients of about two carved layers at a time (the one computing and
the one FSDP2 fetches next), in float32.
The prediction is the larger of the sampling and tuning phases. scripts/bench_memory.py holds it against the measured
peak (RSS on CPU, torch.cuda.max_memory_allocated on a GPU); BENCHMARKS.md "Tuning memory" has the numbers.
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
    host: int = 0  # host memory of an offloaded run (the student's state), besides the device's peak
    teacher_freed: int = 0  # the teacher's carved FFNs, freed after the teacher pass (not held while tuning)

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
                "teacher_freed": self.teacher_freed}


def tuning_memory(*, hidden: int, d_ff: int, n_layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                  tied: bool, experts: int, dense_layers: int = 0, seq: int = 512, micro_windows: int = 1,
                  kl_chunk: int = 256, sample_batch: int = 64, bf16: bool = False, train_attention: bool = False,
                  device: str = "cpu", world: int = 1, offload: bool = False) -> TuneMemory:
    """Predicted bytes of each part of a tuning run (see the module docstring), per process: across `world`
    processes (torchrun, moeify.parallel) FSDP2 shards the student's trainable tensors, gradients and Adam moments,
    while every process holds the whole teacher (not sharded yet) and one window's activations. offload (a GPU
    run): the student's state in host memory instead (TuneMemory.host)."""
    h, f, L = hidden, d_ff, n_layers
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 2 * h  # q, o, k, v projections and two norms
    ffn = 3 * h * f
    embed = vocab * h * (1 if tied else 2) + h
    teacher = 4 * (embed + L * attn) + L * ffn * (2 if bf16 else 4)
    carved = L - dense_layers
    trainable = carved * (ffn + experts * h + 1) + (L * attn if train_attention else 0)
    student = -(-4 * 4 * trainable // world) + 4 * dense_layers * ffn
    host = 0
    if offload and device != "cpu":  # on a CPU the "host" is the device: nothing moves
        host = student - 4 * dense_layers * ffn
        student = 2 * 2 * 4 * (ffn + experts * h + 1) + 4 * dense_layers * ffn
    act_bytes = 2 if bf16 else 4
    tokens = seq * micro_windows
    activations = tokens * L * (6 * f + 10 * h) * act_bytes + tokens * h * 4 * 2  # + final hidden and its gradient
    kl = 4 * kl_chunk * vocab * 4 + (vocab * h * 2 if bf16 else 0)  # + the head's bf16 copy for the gradient
    sampling = sample_batch * seq * (L * 2 * kv_heads * head_dim * 4 + h * 4) + sample_batch * vocab * 4 * 2
    # the teacher pass: tuning never runs the teacher's carved FFNs, and they are freed; on a GPU that is memory
    # back, on a CPU not: the weights are pages of the memory-mapped safetensors file, which stays mapped (and
    # counted in RSS) while the rest of the teacher uses it (measured: RSS unchanged when they are dropped)
    freed = carved * ffn * (2 if bf16 else 4) if device != "cpu" else 0
    return TuneMemory(teacher, student, activations, kl, sampling, CPU_BASELINE if device == "cpu" else 0, host,
                      freed)


def source_tuning_memory(src, experts: int, dense_layers: int = 0, **kw) -> TuneMemory:
    """tuning_memory of a moeify.families.SourceModel."""
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
    """Predicted peak per process of tuning, float32 on a CPU and bf16 on GPUs across 1-8 processes (`moeify plan`)."""
    rows = [{"device": "cpu", "processes": 1,
             "peak": source_tuning_memory(src, experts, dense_layers, seq=seq, device="cpu").peak}]
    rows += [{"device": "cuda", "processes": g, "offload": False,
              "peak": source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda", world=g).peak}
             for g in GPU_COUNTS]
    off = source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda", offload=True)
    rows.insert(2, {"device": "cuda", "processes": 1, "offload": True, "peak": off.peak, "host": off.host})
    return rows


def fits(mem: TuneMemory, have: int | None, host_have: int | None) -> bool:
    """Whether a prediction fits the device's memory (and, offloaded, the host's)."""
    return (have is None or mem.peak <= have) and (host_have is None or mem.host <= host_have)


def check_fits(mem: TuneMemory, device: str, have: int | None, src, experts: int, dense_layers: int = 0,
               seq: int = 512) -> None:
    """Refuse a tuning run whose predicted peak per process exceeds the device's memory, naming what would fit."""
    from .errors import MoeifyError

    host_have = device_memory("cpu") if mem.host else None
    if fits(mem, have, host_have):
        return
    if have is not None and mem.peak <= have:
        raise MoeifyError(f"offloaded tuning needs about {mem.host / 1e9:.1f} GB of host memory for the student's "
                          f"state (predicted: moeify/memory.py), and this machine has {host_have / 1e9:.1f} GB",
                          "run across GPUs with torchrun (the state is sharded), or pass --no-memory-check to try "
                          "anyway")
    fit = [g for g in GPU_COUNTS if source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda",
                                                         world=g).peak <= (have if device.startswith("cuda") else 80e9)]
    hint = (f"run across {fit[0]} GPUs: torchrun --nproc-per-node {fit[0]} -m moeify tune ... (predicted "
            f"{source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device='cuda', world=fit[0]).peak / 1e9:.0f} "
            f"GB each{'' if device.startswith('cuda') else ' on 80 GB GPUs'})" if fit else
            "no layout of up to 8 GPUs fits yet (the teacher is replicated in every process)")
    if device.startswith("cuda") and not mem.host:
        off = source_tuning_memory(src, experts, dense_layers, seq=seq, bf16=True, device="cuda", offload=True)
        if fits(off, have, device_memory("cpu")):
            hint = (f"pass --offload (the student's state in host memory: {off.peak / 1e9:.0f} GB on the GPU, "
                    f"{off.host / 1e9:.0f} GB host), or {hint}")
    raise MoeifyError(f"tuning needs about {mem.peak / 1e9:.1f} GB on {device} (predicted: moeify/memory.py), and "
                      f"{device} has {have / 1e9:.1f} GB", f"{hint}; or convert with --no-tune; or pass "
                      "--no-memory-check to try anyway")


def choose_offload(plain: TuneMemory, offloaded: TuneMemory, device: str, have: int | None) -> bool:
    """auto, from the run's predictions without and with offload: offload on a GPU when the run does not fit it as
    it is and fits it offloaded (host memory permitting)."""
    if not device.startswith("cuda") or have is None or plain.peak <= have:
        return False
    return fits(offloaded, have, device_memory("cpu"))
