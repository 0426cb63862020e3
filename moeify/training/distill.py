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
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .hidden import LayerOutputs, layer_match
from .kl import chunked_kl
from .steps import Pending, TempKeeper, WindowStream, attention_params, eager_forwards, final_hidden, moe_kernel
from .steps import share_frozen  # noqa: F401  (re-exported: its old home)
from ..maths.moe_block import MaskedMoE
from ..maths.numerics import tuning_autocast


@dataclass(frozen=True)
class DistillSettings:
    tokens: int  # training tokens (the budget); every step sees batch_tokens of them
    lr: float = 0.003  # Adam step relative to each expert tensor's RMS (and the router's)
    temp_lr: float = 0.05  # absolute Adam step of each layer's log router scale
    train_router: bool = True
    train_experts: bool = True  # False: the experts frozen (--router-only: the routers alone learn)
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
    hidden_weight: float = 0.0  # > 0: the loss adds this times each decoder layer's output error relative to the
    # teacher's (moeify.training.hidden.layer_match): the teacher runs on every window (no kept targets), eagerly
    seed: int = 0


def wants_compile(settings: DistillSettings, device: torch.device, sharded: bool = False) -> bool:
    """Whether the training step's forwards go through torch.compile: settings.compile_model, None meaning on one
    GPU, the student not sharded by FSDP2 (the setting measured faster; across GPUs and with --offload not measured);
    MOEIFY_COMPILE_MODEL=1 / 0 overrides; MOEIFY_COMPILE=0 turns every compilation off; never with hidden_weight."""
    default = settings.compile_model
    if settings.hidden_weight:
        return False  # the layer outputs are recorded by forward hooks, on the eager modules
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
    micro-batch whose windows all have them skips the teacher's forward (with settings.hidden_weight the teacher runs
    on every window: the loss adds its layer-output term). forwards: (teacher's, student's) final hidden states of a
    micro-batch (compiled_forwards; default final_hidden). Returns the step's mean KL as a 0-dim tensor (read with
    .item() only when it is shown or saved)."""
    device, step_kl = next(student.parameters()).device, None
    fwd_t, fwd_s = forwards or eager_forwards(teacher, student)
    size = max(1, settings.micro_windows)
    if device.type == "cuda":  # the step's windows copied once, without waiting for the GPU's queue
        batch = batch.pin_memory().to(device, non_blocking=True)
    for m, micro in enumerate(batch.split(size)):
        micro = micro.to(device)
        kept = None if targets is None else targets[m * size:(m + 1) * size]
        share = micro.shape[0] / batch.shape[0]
        with ctx:
            if settings.hidden_weight:
                kl, loss = _kl_and_layer_match(teacher, student, micro, head, settings, fwd_t, fwd_s, share)
            else:
                if kept is not None and all(t is not None for t in kept):
                    target = torch.stack([t.float() for t in kept]).to(device)  # (fp16 sampled, fp32 real)
                else:
                    with torch.no_grad():
                        target = fwd_t(micro)
                kl = loss = chunked_kl(fwd_s(micro), target, head, settings.kl_chunk, settings.kl_logits) * share
        loss.backward()
        step_kl = kl.detach() if step_kl is None else step_kl + kl.detach()
    return step_kl


def _kl_and_layer_match(teacher, student, micro: torch.Tensor, head: torch.Tensor, settings: DistillSettings,
                        fwd_t: Callable, fwd_s: Callable, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's KL × share, the loss to backpropagate: (KL + hidden_weight × layer_match) × share): both
    models' decoder-layer outputs recorded (moeify.training.hidden), so the teacher runs on every window."""
    with torch.no_grad(), LayerOutputs(teacher) as t_layers:
        target = fwd_t(micro)
    with LayerOutputs(student) as s_layers:
        final = fwd_s(micro)
    kl = chunked_kl(final, target, head, settings.kl_chunk, settings.kl_logits) * share
    return kl, kl + settings.hidden_weight * layer_match(s_layers.outputs, t_layers.outputs) * share


def lr_scale(settings: DistillSettings) -> float:
    """The factor of the step sizes for the run's batch: sqrt(batch_tokens / lr_reference_tokens) for a batch larger
    than the reference (DistillSettings.lr_reference_tokens), 1 otherwise (the steps of small test batches as given)."""
    return math.sqrt(max(settings.batch_tokens, settings.lr_reference_tokens) / settings.lr_reference_tokens)


_STEP_HOOK = None


def set_step_hook(hook) -> None:
    """Benchmarks only: call hook(student, step, tokens_so_far) after every optimizer step (None: no hook), e.g. to
    score held-out texts along one run (scripts/bench_quality.py's tokens -> quality curve)."""
    global _STEP_HOOK
    _STEP_HOOK = hook


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
    from .parallel import Parallel

    par = par or Parallel()
    if settings.router_grad not in ("topk", "dense"):
        raise ValueError(f"router_grad {settings.router_grad!r}: use 'topk' or 'dense'")
    run = _Distillation(teacher, student, train, held_out, settings, par, resume, held_targets)
    run.begin(state if state is not None else TempKeeper(), resume)
    for step in range(run.done + 1, run.total + 1):
        run.step(step, progress, targets)
        run.keeper.checkpoint(step, run.total, lambda step=step: run.snapshot(step))
    return run.finish(close=state is None)


@dataclass(frozen=True)
class _Trainable:
    """What a distill run trains: the student's MaskedMoEs, and their tensors (and the attention's) by kind; params
    is every one of them in the order of the saved state's param.{j} (experts, routers, temperatures, attention)."""

    moes: list
    experts: list
    routers: list
    temps: list
    attention: list
    params: list
    kernel: str  # the MoE blocks' kernel (moe_kernel)


def _trainable(student, settings: DistillSettings, device: torch.device) -> _Trainable:
    """The student's tensors a run trains, marked trainable and every other one frozen; its MoE blocks set to the
    run's kernel and router gradient."""
    moes = [m for m in student.modules() if isinstance(m, MaskedMoE)]
    for p in student.parameters():
        p.requires_grad_(False)
    experts = [p for m in moes for p in (m.gate, m.up, m.down)] if settings.train_experts else []
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
    return _Trainable(moes, experts, routers, temps, attention, params, kernel)


def _base_lrs(tr: _Trainable, settings: DistillSettings, resume: tuple[dict, dict] | None) -> list[float]:
    """The step sizes of the run's start: a resumed run's own (its weights put back), else each tensor's step relative
    to its RMS at the start of the run and the temperatures' absolute one, both scaled to the batch (1 at
    lr_reference_tokens)."""
    from .parallel import assign, full

    if resume is not None:
        r_tensors, r_meta = resume
        if len(r_meta["base_lrs"]) != len(tr.params) - len(tr.temps) + bool(tr.temps):
            raise ValueError("saved tuning state is for another set of trainable tensors")
        base_lrs = list(r_meta["base_lrs"])  # the step sizes of the run's start, not of the resumed weights
        for j, p in enumerate(tr.params):
            assign(p, r_tensors[f"param.{j}"])
        return base_lrs
    scale = lr_scale(settings)
    base_lrs = [rel * scale * full(p.detach()).pow(2).mean().sqrt().item()
                for ps, rel in ((tr.experts + tr.routers, settings.lr), (tr.attention, settings.attention_lr))
                for p in ps]
    return base_lrs + ([settings.temp_lr * scale] if tr.temps else [])


def _optimizer(tr: _Trainable, base_lrs: list[float], fused: bool, resume: tuple[dict, dict] | None
               ) -> torch.optim.Adam:
    """Adam over a group per tensor (the temperatures one group), at the base step sizes; a resumed run's moments put
    back. fused: the fused kernel (one GPU: a step's ~100 small tensors in a few launches); else torch's default."""
    from .parallel import like

    n_single = len(tr.experts) + len(tr.routers) + len(tr.attention)
    ordered = tr.experts + tr.routers + tr.attention  # the single-tensor groups, in base_lrs order
    groups = [{"params": [p], "lr": lr} for p, lr in zip(ordered, base_lrs[:n_single])]
    if tr.temps:
        groups.append({"params": tr.temps, "lr": base_lrs[-1]})
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99), fused=True if fused else None)
    if resume is not None:
        r_tensors, r_meta = resume
        by_index = [p for g in groups for p in g["params"]]  # the optimizer's own numbering of the parameters

        def moments(i: int) -> dict:
            return {"step": r_tensors[f"opt.{i}.step"], "exp_avg": like(by_index[i], r_tensors[f"opt.{i}.exp_avg"]),
                    "exp_avg_sq": like(by_index[i], r_tensors[f"opt.{i}.exp_avg_sq"])}

        opt.load_state_dict({"state": {i: moments(i) for i in range(len(by_index)) if f"opt.{i}.step" in r_tensors},
                             "param_groups": r_meta["param_groups"]})
    return opt


def lr_factor(step: int, warm: int, total: int, start: float) -> float:
    """The step size's factor at `step` (0-based) of `total`: a linear warm-up over `warm` steps to the cosine's value
    at `start` (DistillSettings.schedule_from), then the rest of that cosine."""
    if step < warm:
        return (step + 1) / warm * 0.5 * (1 + math.cos(math.pi * start))
    return 0.5 * (1 + math.cos(math.pi * (start + (1 - start) * (step - warm) / max(1, total - warm))))


class _Distillation:
    """A distill run between its setup and its end: what trains, the optimizer, the step and its schedule, the
    held-out check, the token stream, and the record kept along the run (best, curve, train KL, time)."""

    def __init__(self, teacher, student, train: torch.Tensor, held_out: torch.Tensor, settings: DistillSettings,
                 par, resume: tuple[dict, dict] | None, held_targets: torch.Tensor | None):
        self.teacher, self.student, self.train, self.held_out, self.settings, self.par = (
            teacher, student, train, held_out, settings, par)
        self.device = device = next(student.parameters()).device
        self.tr = _trainable(student, settings, device)
        self.base_lrs = _base_lrs(self.tr, settings, resume)
        self.opt = _optimizer(self.tr, self.base_lrs, device.type == "cuda" and not par.sharded, resume)
        self.seq = seq = train.shape[1]
        self.per_step = per_step = max(1, settings.batch_tokens // seq)
        if per_step % par.world:
            raise ValueError(f"{per_step} windows a step cannot be split evenly across {par.world} processes")
        self.total = max(1, math.ceil(settings.tokens / (per_step * seq)))
        self.warm = min(settings.warmup_steps, max(1, self.total // 10))
        self.ctx, self.bf16 = tuning_autocast(str(device), settings.autocast)
        self.head = student.lm_head.weight
        self.fwd_t, self.fwd_s, self.compiled = compiled_forwards(teacher, student, settings,
                                                                  sharded=bool(par and par.sharded))
        self.hold_t = self._held_out_targets(held_targets)

    def _held_out_targets(self, held_targets: torch.Tensor | None) -> list[torch.Tensor]:
        """The teacher's final hidden states on the held-out windows, a step's windows a tensor: given, or computed
        once here."""
        held_out, per_step, device = self.held_out, self.per_step, self.device
        if held_targets is not None and len(held_targets) == len(held_out):
            return [held_targets[s:s + per_step].to(device, torch.float32) for s in range(0, len(held_out), per_step)]
        with torch.no_grad(), self.ctx:
            return [final_hidden(self.teacher, held_out[s:s + per_step].to(device))
                    for s in range(0, len(held_out), per_step)]

    def held_kl(self) -> float:
        held_out, per_step = self.held_out, self.per_step
        with torch.no_grad(), self.ctx:
            kl = [chunked_kl(final_hidden(self.student, held_out[s:s + per_step].to(self.device)), t, self.head,
                             self.settings.kl_chunk) * t.shape[0]
                  for s, t in zip(range(0, len(held_out), per_step), self.hold_t)]
        return (sum(kl) / len(held_out)).item()

    def _host(self, t: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor (gathered from the ranks' shards: every rank takes part), kept in host memory by rank 0
        only (the rank that saves it)."""
        from .parallel import full

        whole = full(t.detach())
        return whole.contiguous().cpu() if self.par.main else None

    def _pending(self, t: torch.Tensor) -> Pending:  # gathered when it is written, one tensor at a time
        return Pending(tuple(t.shape), t.dtype, lambda t=t: self._host(t))

    def trainable(self) -> dict[str, Pending]:
        return {f"param.{j}": self._pending(p) for j, p in enumerate(self.tr.params)}

    def begin(self, keeper, resume: tuple[dict, dict] | None) -> None:
        """The token stream, the held-out checks' steps and the record: a resumed run's, or a new one's (the carved
        model checked and kept); the clocks started and the step hook shown the carved model."""
        self.stream = WindowStream(self.train, self.settings.seed)
        evals = self.settings.evals
        self.checks = sorted({max(1, round(self.total * (i + 1) / evals)) for i in range(evals)})
        self.keeper = keeper
        if resume is not None:
            r_tensors, r_meta = resume
            self.stream.load_state(r_tensors, r_meta["stream"])
            self.before, self.best, self.best_step = r_meta["before"], r_meta["best"], r_meta["best_step"]
            self.curve, ema, self.done = [tuple(c) for c in r_meta["curve"]], r_meta["ema"], r_meta["step"]
            self.seconds_before, self.cpu_before = r_meta["seconds"], r_meta["cpu_seconds"]
        else:
            self.before = self.best = self.held_kl()
            keeper.keep(self.trainable(), 0)
            self.best_step, self.curve, ema, self.done = 0, [(0, self.before)], None, 0
            self.seconds_before, self.cpu_before = 0.0, 0.0
        self.t0, self.cpu0, self.hook_s, self.hook_cpu = time.time(), time.process_time(), 0.0, 0.0
        if _STEP_HOOK is not None and self.done == 0:  # the carved model, before any step
            self._hook(0)
        self.t_rate, self.done_rate, self.shown = time.time(), self.done, 0.0
        # the train KL's running mean stays on the device (float64: the arithmetic of the Python floats it replaced,
        # so a resumed run's numbers are the same): the loop reads nothing back from a GPU between steps except when
        # it shows progress (at most every settings.show_every s; on a CPU, where nothing waits, every step), checks
        # the held-out windows or saves a snapshot
        self.on_gpu = torch.device(self.device).type == "cuda"
        self.ema = None if ema is None else torch.tensor(ema, dtype=torch.float64, device=self.device)

    def _hook(self, step: int) -> None:
        """The benchmarks' step hook (set_step_hook); its time is not tuning time."""
        h0, hc0 = time.time(), time.process_time()
        _STEP_HOOK(self.student, step, step * self.per_step * self.seq)
        self.hook_s, self.hook_cpu = self.hook_s + time.time() - h0, self.hook_cpu + time.process_time() - hc0

    def snapshot(self, step: int) -> tuple[dict, dict]:
        tensors = self.trainable()
        opt_state = self.opt.state_dict()
        for i, st in opt_state["state"].items():
            for k, v in st.items():
                tensors[f"opt.{i}.{k}"] = self._pending(v)
        stream_t, stream_m = self.stream.state()
        tensors.update(stream_t)
        meta = {"step": step, "total": self.total, "base_lrs": self.base_lrs,
                "param_groups": opt_state["param_groups"], "stream": stream_m, "before": self.before,
                "best": self.best, "best_step": self.best_step, "curve": [list(c) for c in self.curve],
                "ema": None if self.ema is None else self.ema.item(),
                "seconds": self.seconds_before + time.time() - self.t0 - self.hook_s,
                "cpu_seconds": self.cpu_before + time.process_time() - self.cpu0 - self.hook_cpu}
        return tensors, meta

    def step(self, step: int, progress, targets) -> None:
        """One optimizer step (1-based) on this rank's share of the step's windows; the held-out check where one is
        due (the best checked weights kept), the progress shown, the step hook called."""
        par, opt, settings = self.par, self.opt, self.settings
        for g, lr in zip(opt.param_groups, self.base_lrs):
            g["lr"] = lr * lr_factor(step - 1, self.warm, self.total, settings.schedule_from)
        opt.zero_grad(set_to_none=True)
        par.at(f"step {step:,} of the tuning loop")
        idx = self.stream.take_indices(self.per_step)[par.rank::par.world]  # this rank's share of the step's windows
        step_kl = par.mean(accumulate_kl(self.teacher, self.student, self.train[idx], self.head, self.ctx, settings,
                                         None if targets is None else [targets(int(i)) for i in idx],
                                         (self.fwd_t, self.fwd_s))).double()
        opt.step()
        self.ema = step_kl if self.ema is None else 0.95 * self.ema + 0.05 * step_kl
        if step in self.checks:
            kl = self.held_kl()
            self.curve.append((step, kl))
            if kl < self.best:
                self.best, self.best_step = kl, step
                self.keeper.keep(self.trainable(), step)
        if progress and (not self.on_gpu or step == self.total or step in self.checks
                         or time.time() - self.shown >= settings.show_every):
            self._show(step, progress)
        if _STEP_HOOK is not None:
            self._hook(step)

    def _show(self, step: int, progress) -> None:
        self.shown = time.time()
        tokens = self.per_step * self.seq
        rate = (step - self.done_rate) * tokens / max(1e-9, self.shown - self.t_rate)
        progress("tuning", step * tokens, self.total * tokens,
                 f"{rate:,.0f} tok/s, KL train {self.ema.item():.3f} held {self.curve[-1][1]:.3f}")

    def finish(self, close: bool) -> dict:
        """The run's end: the kept weights put back into the student (frozen again), the keeper closed where the run
        made it; returns distill's info."""
        from .parallel import assign

        train_kl = None if self.ema is None else self.ema.item()
        for m in self.tr.moes:
            m.dense_grad = False
        self.opt = None  # the Adam state, before the kept weights are read back
        kept = self.keeper.kept()
        if close:
            self.keeper.close()
        for j, p in enumerate(self.tr.params):
            assign(p, kept.pop(f"param.{j}"))
            p.requires_grad_(False)
        return self._info(train_kl, self.seconds_before + time.time() - self.t0 - self.hook_s)

    def _info(self, train_kl: float | None, seconds: float) -> dict:
        settings, bf16, per_step, seq = self.settings, self.bf16, self.per_step, self.seq
        tokens = self.total * per_step * seq
        return {"holdout_kl_before": self.before, "holdout_kl_after": self.best, "train_kl_end": train_kl,
                "step_kept": self.best_step, "holdout_curve": [[s, round(k, 5)] for s, k in self.curve],
                "steps": self.total, "tokens": tokens, "train_windows": int(self.train.shape[0]),
                "held_out_windows": int(self.held_out.shape[0]),
                "passes": round(tokens / max(1, self.train.numel()), 3), "seconds": round(seconds, 1),
                "cpu_seconds": round(self.cpu_before + time.process_time() - self.cpu0 - self.hook_cpu, 1),
                "seconds_per_1k_tokens": round(1024 * seconds / tokens, 3), "bf16_autocast": bf16,
                "kl_logits": "bf16" if bf16 and settings.kl_logits == "autocast" else "float32",  # the training KL's
                "router_trained": settings.train_router, "experts_trained": settings.train_experts,
                "attention_trained": settings.train_attention,
                "batch_tokens": per_step * seq, "micro_windows": settings.micro_windows, "moe_kernel": self.tr.kernel,
                "compiled": self.compiled, "lr_scale": round(lr_scale(settings), 4)}
