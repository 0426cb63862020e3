"""Whole-model distillation of a carved MoE towards its dense source (the main tuning path, `--tune-tokens`).

The student is the dense model with every carved layer's `mlp` replaced by `MaskedMoE`, which computes exactly what
the exported Mixtral / Qwen2-MoE block computes (softmax router, top-k, the format's gate weights, the factor k or N
that moeify folds into `down_proj`), in the dense neuron order. It is trained to match the dense teacher's
next-token distributions (KL, no labels) on a stream of fresh tokens. Data in, tensors out; no checkpoint I/O.

Why these choices (BENCHMARKS.md, "Quality against tuning tokens", has the measurements):
- Whole-model KL, not layer-local reconstruction: a layer's own weights under fixed routing can remove only a few
  percent of its error, while the end-to-end objective lets every layer compensate the others.
- Fresh tokens, not epochs over a few: the carve memorises its calibration tokens (KL 0.17 on them, 0.91 on fresh
  text), so the token budget is a stream over a broad mix (the user's text, a bundled broad sample, and text the
  dense model samples itself: what the teacher knows is what the student is taught), and every early-stopping
  decision is taken on held-out windows of that mix that no step trains on.
- Step sizes relative to each tensor's RMS (Adam updates have the size of the learning rate), linear warm-up then
  cosine decay over the whole token budget (a continued run: the rest of one cosine over its earlier tokens and its
  own, DistillSettings.schedule_from).
- Trainable routing that exports to the stock formats: each layer's router is trained with its temperature (a log
  scale, starting at the carve's unit-gate scale, so step 0 is exactly the carved model). The gate weights are the
  format's own softmax weights, so whatever is learned is what Mixtral / Qwen2-MoE compute; the top-k choice has no
  gradient, as in any trained MoE, but the weights of the chosen experts do, and the router rows move the choice.
- Memory bounded at any vocabulary (moeify.training.kl): the KL is computed over chunks of tokens, each chunk's gradient with
  respect to the student's hidden states in closed form in the forward pass (softmax(student) - softmax(teacher), times
  the head), so no (tokens, vocabulary) tensor is kept for backward and a step costs three head products per chunk.
  The model is held about once: the student uses the teacher's own frozen modules (share_frozen), the teacher's
  FFNs are stored in bf16 when autocast would cast them anyway, a step's windows go through forward + backward one
  at a time (gradients accumulate), and the best checked weights wait on disk, not in memory.
- bf16 autocast for both models where the hardware has fast bf16 (AVX512-BF16 / AMX CPUs, any recent GPU); the
  router logits stay float32, and so do the KL's softmax and sum over bf16 logit products (kl_logits; float32
  products on request, and always for the held-out checks).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from ..formats.families import attention_tensors
from .kl import chunked_kl
from ..maths.moe_block import MaskedMoE
from ..maths.numerics import tuning_autocast


@dataclass(frozen=True)
class DistillSettings:
    tokens: int  # training tokens (the budget); every step sees batch_tokens of them
    lr: float = 0.003  # Adam step relative to each expert tensor's RMS (and the router's)
    temp_lr: float = 0.05  # absolute Adam step of each layer's log router scale
    train_router: bool = True
    router_grad: str = "topk"  # topk: the router learns through the chosen experts' weights only; dense: DenseMixer
    train_attention: bool = False  # also each layer's attention projections and its two RMSNorm weights
    attention_lr: float = 0.001  # their Adam step relative to each tensor's RMS: a third of the experts' (at the
    # experts' step the attention fits the tuning mix and unseen genres get worse; 0.0003-0.002 gain 1-2% on every
    # text: BENCHMARKS.md "Quality against tuning tokens")
    batch_tokens: int = 1024  # tokens a step (a CPU's; a GPU's are sized to its memory: moeify.tuning.sizing.step_size)
    micro_windows: int = 1  # windows per forward + backward (gradients accumulate over a step's micro-batches)
    lr_reference_tokens: int = 1024  # lr and temp_lr are the steps of a batch of this many tokens; a larger batch
    # takes them times sqrt(batch_tokens / this) (Adam's square-root scaling rule: Malladi et al. 2022, "On the SDEs
    # and scaling rules for adaptive gradient algorithms"), so a GPU's fewer, larger steps move the weights as far
    show_every: float = 1.0  # seconds between progress updates on a GPU (each reads the train KL back from it; 0:
    # every step, as a timer of steps needs); a CPU's show every step
    moe_kernel: str = "auto"  # masked | grouped | auto (grouped on a GPU, masked on a CPU: moeify.maths.moe_block;
    # MOEIFY_MOE_KERNEL overrides auto)
    compile_model: bool | None = None  # the training step's teacher and student forwards through torch.compile;
    # None: on one GPU, unsharded (H200, SmolLM2's shape, 50% preset: 93,000 against 65,500 tokens/s uncompiled;
    # CPUs, FSDP2 and offload not measured: BENCHMARKS.md "GPU"); MOEIFY_COMPILE_MODEL=1 / 0 overrides,
    # MOEIFY_COMPILE=0 turns it off; MOEIFY_COMPILE_BACKEND picks the backend, inductor by default
    warmup_steps: int = 5
    schedule_from: float = 0.0  # where in its cosine the run starts (0: the peak); a continued run's schedule is the
    # rest of one cosine over its earlier tokens and these (moeify.tuning.TuneOptions.schedule_from)
    evals: int = 6  # held-out checks over the run; the best checked weights are kept
    autocast: str = "auto"  # auto | bf16 | off
    kl_chunk: int = 256  # tokens per KL chunk (bounds the logits held at once)
    kl_logits: str = "autocast"  # autocast | float32: the training KL's two logit products in the autocast dtype
    # where autocast is on (bf16: the logits rounded to it, as a bf16 dense step's cross-entropy reads them), or
    # always in float32. bf16 measured alike at equal tokens (SmolLM2, 50% preset, 65,536 tokens: within 0.16% on
    # three texts) and 11-13% faster a step (BENCHMARKS.md "Tuning speed"); the held-out checks stay float32
    seed: int = 0


def final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids).last_hidden_state


class WindowStream:
    """Training windows drawn in a seeded random order without replacement, reshuffled when all were seen. Its
    position (generator state, order, offset, passes) is part of a tuning run's saved state."""

    def __init__(self, windows: torch.Tensor, seed: int):
        self.windows, self.gen, self.order, self.pos, self.passes = windows, torch.Generator().manual_seed(seed), None, 0, 0
        self._shuffle()

    def _shuffle(self):
        self.order, self.pos = torch.randperm(self.windows.shape[0], generator=self.gen), 0

    def take(self, n: int) -> torch.Tensor:
        return self.windows[self.take_indices(n)]

    def take_indices(self, n: int) -> torch.Tensor:
        out = []
        while n:
            if self.pos == len(self.order):
                self._shuffle()
                self.passes += 1
            m = min(n, len(self.order) - self.pos)
            out.append(self.order[self.pos:self.pos + m])
            self.pos, n = self.pos + m, n - m
        return torch.cat(out)

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return {"stream.gen": self.gen.get_state(), "stream.order": self.order.clone()}, {"pos": self.pos,
                                                                                          "passes": self.passes}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        if tensors["stream.order"].numel() != self.windows.shape[0]:
            raise ValueError("saved stream position is for another set of training windows")
        self.gen.set_state(tensors["stream.gen"])
        self.order, self.pos, self.passes = tensors["stream.order"].clone(), int(meta["pos"]), int(meta["passes"])


def eager_forwards(teacher, student) -> tuple[Callable, Callable]:
    """(teacher's final hidden states of a micro-batch, student's), uncompiled."""
    return (lambda ids: final_hidden(teacher, ids)), (lambda ids: final_hidden(student, ids))


def wants_compile(settings: DistillSettings, device: torch.device, sharded: bool = False) -> bool:
    """Whether the training step's forwards go through torch.compile: settings.compile_model, None meaning on one
    GPU, the student not sharded by FSDP2 (the setting measured faster; across GPUs and with --offload not measured);
    MOEIFY_COMPILE_MODEL=1 / 0 overrides; MOEIFY_COMPILE=0 turns every compilation off."""
    default = settings.compile_model
    if default is None:
        default = torch.device(device).type == "cuda" and not sharded
    want = os.environ.get("MOEIFY_COMPILE_MODEL", "1" if default else "0") == "1"
    return want and os.environ.get("MOEIFY_COMPILE", "1") != "0"


def compiled_forwards(teacher, student, settings: DistillSettings, sharded: bool = False
                      ) -> tuple[Callable, Callable, bool]:
    """(teacher's final hidden states, student's, compiled or not) for the training step: final_hidden itself, or
    each model's decoder stack through torch.compile (static shapes: a step's micro-batches are one size) where
    settings.compile_model asks (None: on one GPU, unsharded: wants_compile), MOEIFY_COMPILE_MODEL=1 / 0 overriding it,
    and MOEIFY_COMPILE is not 0. The compiled modules share the models' parameters; the held-out checks stay eager
    (other batch sizes would recompile)."""
    if not wants_compile(settings, next(student.parameters()).device, sharded):
        return (*eager_forwards(teacher, student), False)
    backend = os.environ.get("MOEIFY_COMPILE_BACKEND", "inductor")
    ct, cs = (torch.compile(m.model, dynamic=False, backend=backend) for m in (teacher, student))
    return (lambda ids: ct(input_ids=ids).last_hidden_state), (lambda ids: cs(input_ids=ids).last_hidden_state), True


def accumulate_kl(teacher, student, batch: torch.Tensor, head: torch.Tensor, ctx, settings: DistillSettings,
                  targets: list | None = None, forwards: tuple[Callable, Callable] | None = None) -> torch.Tensor:
    """One step's gradients: the teacher's forward, the student's forward and backward and the chunked KL, one
    micro-batch of windows at a time (activations of one micro-batch held), gradients accumulated into .grad.
    targets: per window, the teacher's final hidden states kept from sampling (None where there are none): a
    micro-batch whose windows all have them skips the teacher's forward. forwards: (teacher's, student's) final
    hidden states of a micro-batch (compiled_forwards; default final_hidden). Returns the step's mean KL as a 0-dim
    tensor (read with .item() only when it is shown or saved)."""
    device, step_kl = next(student.parameters()).device, None
    fwd_t, fwd_s = forwards or eager_forwards(teacher, student)
    size = max(1, settings.micro_windows)
    if device.type == "cuda":  # the step's windows copied once, without waiting for the GPU's queue
        batch = batch.pin_memory().to(device, non_blocking=True)
    for m, micro in enumerate(batch.split(size)):
        micro = micro.to(device)
        kept = None if targets is None else targets[m * size:(m + 1) * size]
        with ctx:
            if kept is not None and all(t is not None for t in kept):
                target = torch.stack([t.float() for t in kept]).to(device)  # (fp16 sampled, fp32 real)
            else:
                with torch.no_grad():
                    target = fwd_t(micro)
            loss = chunked_kl(fwd_s(micro), target, head, settings.kl_chunk, settings.kl_logits) * (
                micro.shape[0] / batch.shape[0])
        loss.backward()
        step_kl = loss.detach() if step_kl is None else step_kl + loss.detach()
    return step_kl


def lr_scale(settings: DistillSettings) -> float:
    """The factor of the step sizes for the run's batch: sqrt(batch_tokens / lr_reference_tokens) for a batch larger
    than the reference (DistillSettings.lr_reference_tokens), 1 otherwise (the steps of small test batches as given)."""
    return math.sqrt(max(settings.batch_tokens, settings.lr_reference_tokens) / settings.lr_reference_tokens)


def moe_kernel(kernel: str, device: torch.device) -> str:
    """The MoE block's kernel a run uses: "auto" is grouped on a GPU and masked on a CPU (measured there: torch's
    CPU grouped GEMM loses to the masked dense products at the presets' layouts; BENCHMARKS.md "Tuning speed"),
    MOEIFY_MOE_KERNEL set to masked or grouped overriding it. Blocks where grouped does not apply compute masked."""
    from ..maths.moe_block import KERNELS

    if kernel == "auto":
        kernel = os.environ.get("MOEIFY_MOE_KERNEL") or ("grouped" if torch.device(device).type == "cuda" else "masked")
    if kernel not in KERNELS:
        raise ValueError(f"moe kernel {kernel!r}: use one of {', '.join(KERNELS)} or auto")
    return kernel


_STEP_HOOK = None


def set_step_hook(hook) -> None:
    """Benchmarks only: call hook(student, step, tokens_so_far) after every optimizer step (None: no hook), e.g. to
    score held-out texts along one run (scripts/bench_quality.py's tokens -> quality curve)."""
    global _STEP_HOOK
    _STEP_HOOK = hook


@dataclass(frozen=True)
class Pending:
    """A tensor of a saved state, produced when it is written (moeify.tuning.TuningState writes one at a time, so the
    writer never holds the whole state in host memory): produce() gathers it (a collective across processes: every
    rank calls it, in the same order) and returns it whole on the writing rank, None on the others."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor | None]


def materialize(tensors: dict) -> dict[str, torch.Tensor]:
    """The tensors of a state, Pending ones produced (one process)."""
    return {k: v.produce() if isinstance(v, Pending) else v for k, v in tensors.items()}


class _TempKeeper:
    """Where a run that saves no state (a library call without a state directory) keeps its best checked weights: a
    temporary file, on disk rather than in memory."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="moeify-distill-")
        self._file = f"{self._dir.name}/kept.safetensors"

    def keep(self, tensors: dict, step: int) -> None:
        save_file(materialize(tensors), self._file)

    def kept(self) -> dict[str, torch.Tensor]:
        return load_file(self._file)

    def checkpoint(self, step: int, total: int, snapshot) -> None:
        pass

    def close(self) -> None:
        self._dir.cleanup()


def distill(teacher, student, train: torch.Tensor, held_out: torch.Tensor, settings: DistillSettings,
            progress=None, state=None, resume: tuple[dict, dict] | None = None, targets=None, par=None,
            held_targets: torch.Tensor | None = None) -> dict:
    """Train the student's MaskedMoE weights (and routers) towards the teacher's next-token distributions.

    train: (n_windows, seq_len) token windows to draw the budget from; held_out: (m, seq_len) windows never trained
    on, used for every early-stopping decision. Returns info (held-out KL before/after and along the run, train KL,
    steps, tokens, passes over the training windows, seconds, autocast); the student holds the kept weights.

    state: where the best checked weights are kept and the run's state is saved (moeify.tuning.TuningState: keep(),
    kept(), checkpoint(step, total, snapshot), which saves snapshot() when due and raises KeyboardInterrupt after
    saving when a stop was requested); None: a temporary file, nothing saved. resume: (tensors, meta) of a saved
    snapshot: the run continues from it and ends with the weights an uninterrupted run would have (same machine and
    thread count). targets: targets(i) -> the teacher's final hidden states of training window i, (seq, d), kept
    from sampling it, or None (the teacher runs on that window). par: moeify.training.parallel.Parallel of a run across
    processes (the student's MaskedMoEs sharded by FSDP2; each rank trains on its share of every step's windows).
    held_targets: (m, seq, d) the teacher's final hidden states of the held-out windows (computed before; None: the
    teacher runs on them once here)."""
    from .parallel import Parallel, assign, full, like

    par = par or Parallel()
    if settings.router_grad not in ("topk", "dense"):
        raise ValueError(f"router_grad {settings.router_grad!r}: use 'topk' or 'dense'")
    device = next(student.parameters()).device
    moes = [m for m in student.modules() if isinstance(m, MaskedMoE)]
    for p in student.parameters():
        p.requires_grad_(False)
    experts = [p for m in moes for p in (m.gate, m.up, m.down)]
    routers = [m.router for m in moes] if settings.train_router else []
    kernel = moe_kernel(settings.moe_kernel, device)
    for m in moes:
        m.dense_grad = settings.train_router and settings.router_grad == "dense"
        m.kernel = kernel
    temps = [m.log_scale for m in moes] if settings.train_router else []
    attention = attention_params(student) if settings.train_attention else []
    params = experts + routers + temps + attention
    for p in params:
        p.requires_grad_(True)
    r_tensors, r_meta = resume if resume is not None else ({}, {})
    if resume is not None:
        if len(r_meta["base_lrs"]) != len(params) - len(temps) + bool(temps):
            raise ValueError("saved tuning state is for another set of trainable tensors")
        base_lrs = list(r_meta["base_lrs"])  # the step sizes of the run's start, not of the resumed weights
        for j, p in enumerate(params):
            assign(p, r_tensors[f"param.{j}"])
    else:  # each tensor's step relative to its RMS at the start of the run; the temperatures' absolute; both scaled
        scale = lr_scale(settings)  # to the batch (1 at lr_reference_tokens)
        base_lrs = [rel * scale * full(p.detach()).pow(2).mean().sqrt().item()
                    for ps, rel in ((experts + routers, settings.lr), (attention, settings.attention_lr)) for p in ps]
        base_lrs += [settings.temp_lr * scale] if temps else []
    n_single = len(experts) + len(routers) + len(attention)
    ordered = experts + routers + attention  # the single-tensor groups, in base_lrs order
    groups = [{"params": [p], "lr": lr} for p, lr in zip(ordered, base_lrs[:n_single])]
    if temps:
        groups.append({"params": temps, "lr": base_lrs[-1]})
    # one GPU: the fused Adam kernel (a step's ~100 small tensors in a few launches); elsewhere torch's default
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99), fused=True if device.type == "cuda" and not par.sharded else None)
    if resume is not None:
        by_index = [p for g in groups for p in g["params"]]  # the optimizer's own numbering of the parameters

        def moments(i: int) -> dict:
            return {"step": r_tensors[f"opt.{i}.step"], "exp_avg": like(by_index[i], r_tensors[f"opt.{i}.exp_avg"]),
                    "exp_avg_sq": like(by_index[i], r_tensors[f"opt.{i}.exp_avg_sq"])}

        opt.load_state_dict({"state": {i: moments(i) for i in range(len(by_index)) if f"opt.{i}.step" in r_tensors},
                             "param_groups": r_meta["param_groups"]})
    seq = train.shape[1]
    per_step = max(1, settings.batch_tokens // seq)
    if per_step % par.world:
        raise ValueError(f"{per_step} windows a step cannot be split evenly across {par.world} processes")
    total = max(1, math.ceil(settings.tokens / (per_step * seq)))
    warm = min(settings.warmup_steps, max(1, total // 10))

    start = settings.schedule_from

    def lr_at(step: int) -> float:  # step 0-based; warm-up to the cosine's value at `start`, then its rest
        if step < warm:
            return (step + 1) / warm * 0.5 * (1 + math.cos(math.pi * start))
        return 0.5 * (1 + math.cos(math.pi * (start + (1 - start) * (step - warm) / max(1, total - warm))))

    ctx, bf16 = tuning_autocast(str(device), settings.autocast)
    head = student.lm_head.weight
    fwd_t, fwd_s, compiled = compiled_forwards(teacher, student, settings, sharded=bool(par and par.sharded))
    if held_targets is not None and len(held_targets) == len(held_out):
        hold_t = [held_targets[s:s + per_step].to(device, torch.float32) for s in range(0, len(held_out), per_step)]
    else:
        with torch.no_grad(), ctx:  # the teacher's final hidden states on the held-out windows, once
            hold_t = [final_hidden(teacher, held_out[s:s + per_step].to(device))
                      for s in range(0, len(held_out), per_step)]

    def held_kl() -> float:
        with torch.no_grad(), ctx:
            kl = [chunked_kl(final_hidden(student, held_out[s:s + per_step].to(device)), t, head, settings.kl_chunk)
                  * t.shape[0] for s, t in zip(range(0, len(held_out), per_step), hold_t)]
        return (sum(kl) / len(held_out)).item()

    def host(t: torch.Tensor) -> torch.Tensor | None:  # the whole tensor (gathered from the ranks' shards: every
        whole = full(t.detach())  # rank takes part), kept in host memory by rank 0 only (the rank that saves it)
        return whole.contiguous().cpu() if par.main else None

    def pending(t: torch.Tensor) -> Pending:  # gathered when it is written, one tensor at a time
        return Pending(tuple(t.shape), t.dtype, lambda t=t: host(t))

    def trainable() -> dict[str, Pending]:
        return {f"param.{j}": pending(p) for j, p in enumerate(params)}

    stream = WindowStream(train, settings.seed)
    checks = sorted({max(1, round(total * (i + 1) / settings.evals)) for i in range(settings.evals)})
    keeper = state if state is not None else _TempKeeper()
    if resume is not None:
        stream.load_state(r_tensors, r_meta["stream"])
        before, best, best_step = r_meta["before"], r_meta["best"], r_meta["best_step"]
        curve, ema, done = [tuple(c) for c in r_meta["curve"]], r_meta["ema"], r_meta["step"]
        seconds_before, cpu_before = r_meta["seconds"], r_meta["cpu_seconds"]
    else:
        before = best = held_kl()
        keeper.keep(trainable(), 0)
        best_step, curve, ema, done, seconds_before, cpu_before = 0, [(0, before)], None, 0, 0.0, 0.0
    t0, cpu0, hook_s, hook_cpu = time.time(), time.process_time(), 0.0, 0.0

    def snapshot(step: int) -> tuple[dict, dict]:
        tensors = trainable()
        opt_state = opt.state_dict()
        for i, st in opt_state["state"].items():
            for k, v in st.items():
                tensors[f"opt.{i}.{k}"] = pending(v)
        stream_t, stream_m = stream.state()
        tensors.update(stream_t)
        meta = {"step": step, "total": total, "base_lrs": base_lrs, "param_groups": opt_state["param_groups"],
                "stream": stream_m, "before": before, "best": best, "best_step": best_step,
                "curve": [list(c) for c in curve], "ema": None if ema is None else ema.item(),
                "seconds": seconds_before + time.time() - t0 - hook_s,
                "cpu_seconds": cpu_before + time.process_time() - cpu0 - hook_cpu}
        return tensors, meta

    if _STEP_HOOK is not None and done == 0:  # the carved model, before any step
        h0, hc0 = time.time(), time.process_time()
        _STEP_HOOK(student, 0, 0)
        hook_s, hook_cpu = time.time() - h0, time.process_time() - hc0
    t_rate, done_rate, shown = time.time(), done, 0.0
    # the train KL's running mean stays on the device (float64: the arithmetic of the Python floats it replaced, so
    # a resumed run's numbers are the same): the loop reads nothing back from a GPU between steps except when it
    # shows progress (at most every settings.show_every s; on a CPU, where nothing waits, every step), checks the
    # held-out windows or saves a snapshot
    on_gpu = torch.device(device).type == "cuda"
    ema = None if ema is None else torch.tensor(ema, dtype=torch.float64, device=device)
    for step in range(done + 1, total + 1):
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * lr_at(step - 1)
        opt.zero_grad(set_to_none=True)
        par.at(f"step {step:,} of the tuning loop")
        idx = stream.take_indices(per_step)[par.rank::par.world]  # this rank's share of the step's windows
        step_kl = par.mean(accumulate_kl(teacher, student, train[idx], head, ctx, settings,
                                         None if targets is None else [targets(int(i)) for i in idx],
                                         (fwd_t, fwd_s))).double()
        opt.step()
        ema = step_kl if ema is None else 0.95 * ema + 0.05 * step_kl
        if step in checks:
            kl = held_kl()
            curve.append((step, kl))
            if kl < best:
                best, best_step = kl, step
                keeper.keep(trainable(), step)
        if progress and (not on_gpu or step == total or step in checks or time.time() - shown >= settings.show_every):
            shown = time.time()
            rate = (step - done_rate) * per_step * seq / max(1e-9, shown - t_rate)
            progress("tuning", step * per_step * seq, total * per_step * seq,
                     f"{rate:,.0f} tok/s, KL train {ema.item():.3f} held {curve[-1][1]:.3f}")
        if _STEP_HOOK is not None:  # its time is not tuning time
            h0, hc0 = time.time(), time.process_time()
            _STEP_HOOK(student, step, step * per_step * seq)
            hook_s, hook_cpu = hook_s + time.time() - h0, hook_cpu + time.process_time() - hc0
        keeper.checkpoint(step, total, lambda step=step: snapshot(step))
    train_kl = None if ema is None else ema.item()
    for m in moes:
        m.dense_grad = False
    opt = None  # the Adam state, before the kept weights are read back
    kept = keeper.kept()
    if state is None:
        keeper.close()
    for j, p in enumerate(params):
        assign(p, kept.pop(f"param.{j}"))
        p.requires_grad_(False)
    seconds = seconds_before + time.time() - t0 - hook_s
    tokens = total * per_step * seq
    return {"holdout_kl_before": before, "holdout_kl_after": best, "train_kl_end": train_kl, "step_kept": best_step,
            "holdout_curve": [[s, round(k, 5)] for s, k in curve], "steps": total, "tokens": tokens,
            "train_windows": int(train.shape[0]), "held_out_windows": int(held_out.shape[0]),
            "passes": round(tokens / max(1, train.numel()), 3), "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu_before + time.process_time() - cpu0 - hook_cpu, 1),
            "seconds_per_1k_tokens": round(1024 * seconds / tokens, 3), "bf16_autocast": bf16,
            "kl_logits": "bf16" if bf16 and settings.kl_logits == "autocast" else "float32",  # the training KL's
            "router_trained": settings.train_router, "attention_trained": settings.train_attention,
            "batch_tokens": per_step * seq, "micro_windows": settings.micro_windows, "moe_kernel": kernel,
            "compiled": compiled, "lr_scale": round(lr_scale(settings), 4)}


def share_frozen(teacher, student, train_attention: bool, lowp: torch.dtype | None = None,
                 own_attention: set[int] = frozenset()) -> int:
    """Make the student use the teacher's own modules for everything tuning leaves frozen (embeddings, output head,
    final norm, and unless train_attention each layer's attention and norms), so the model is not held twice; with
    lowp (bf16 when distill runs under bf16 autocast) also store the teacher's FFN weights in that dtype: autocast
    casts them to it at every call anyway, so the teacher's outputs are bit-identical and its FFNs take half the
    memory. Layers in own_attention keep the student's own attention and norms (an earlier run tuned them). Returns
    the bytes the student no longer holds."""
    def nbytes(m):
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in m.parameters()}.values())

    before = nbytes(student)
    for name, child in list(teacher.model.named_children()):
        if name != "layers":
            setattr(student.model, name, child)
    student.lm_head = teacher.lm_head
    if not train_attention:
        for i, (t_layer, s_layer) in enumerate(zip(teacher.model.layers, student.model.layers)):
            for name, child in list(t_layer.named_children()):
                if name != "mlp" and i not in own_attention:
                    setattr(s_layer, name, child)
    if lowp is not None:  # only the teacher's own FFNs: the shared modules are also run outside autocast
        for layer in teacher.model.layers:
            for m in layer.mlp.modules():
                if isinstance(m, torch.nn.Linear):
                    m.to(lowp)
    shared = {id(p) for p in teacher.parameters()}
    return before - sum(p.numel() * p.element_size() for p in
                        {id(p): p for p in student.parameters() if id(p) not in shared}.values())


def attention_params(model) -> list[torch.nn.Parameter]:
    """Each decoder layer's attention projections and its RMSNorm weights (Qwen3's q/k norms too; biases, where a model has them, stay
    fixed), in layer order: the tensors `train_attention` tunes besides the experts."""
    return [model.get_submodule(f"model.layers.{i}.{name}").weight
            for i in range(len(model.model.layers)) for name in attention_tensors(model.config.model_type)]
