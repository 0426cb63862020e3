"""The loop of a next-token training run (moeify.tuning.lm runs it): the output's own transformers model, whole in
one process or sharded by FSDP2 (moeify.training.parallel) across processes or for offload, AdamW on what trains, each step's
windows split across the ranks (window r, r + G, ... to rank r: the gradient FSDP2 averages is the one-process
gradient), the loss and the expert load summed over every rank's tokens, the state saved and resumed through
TuningState (moeify.tuning.state).

Across processes every decoder layer is an FSDP2 group (its attention, router and experts sharded, not replicated)
and the rest (embeddings, head, final norm) one more; on a GPU each group computes in bf16 by FSDP2's
MixedPrecisionPolicy (float32 shards, optimizer and gradient reduction) instead of autocast, whose bf16 copies of
the gathered weights would outlive the resharding. Every rank scores the held-out windows (the same numbers).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F

from .lm_options import TrainOptions, _counts, balance, load_summary
from .options import Progress
from .state import TuningState


def _selected(name: str, opts: TrainOptions) -> bool:
    if ".layers." not in name:
        return False  # embeddings, the head and the final norm stay as they are
    router = name.endswith((".mlp.gate.weight", "shared_expert_gate.weight"))
    if router:
        return opts.train_router
    if ".mlp." in name:
        return opts.train_experts
    return opts.train_attention  # attention projections (and q/k norms) and the layer's two norms


def _base_lr(p: torch.Tensor, rel: float) -> float:
    """rel × the tensor's RMS; a tensor that starts at zero steps by rel / sqrt(fan-in) (a standard init's scale)."""
    from ..training.parallel import full

    rms = full(p.detach()).float().pow(2).mean().sqrt().item()
    return rel * (rms if rms > 0 else p.shape[-1] ** -0.5)


def load_model(out, dev: str, par, opts: TrainOptions, bf16: bool):
    """OUT's model in float32 with what trains marked: whole on `dev` in one process; sharded by FSDP2 (each decoder
    layer a group, then the rest) across processes or for offload, in bf16 compute on a GPU. Built on the meta
    device and given only this rank's weights (moeify.tuning.lm_weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .lm_weights import load_weights

    config = AutoConfig.from_pretrained(str(out), local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    model.eval()  # no dropout; the router's jitter off: a step is a function of the weights and the windows
    for name, p in model.named_parameters():
        p.requires_grad_(_selected(name, opts))
    if par.sharded:
        lowp = torch.bfloat16 if bf16 else None
        for layer in model.model.layers:
            par.shard(layer, lowp)
        par.shard(model, lowp)
    load_weights(model, out, dev, par)
    return model


def train_step(model, windows: torch.Tensor, micro: int, per_rank: int, coef: float, forward) -> tuple:
    """One optimizer step's forwards and backwards over this rank's windows: (loss, balance, expert counts) of them
    (the loss and balance averaged over the windows). tests/held_back.py holds a rank here."""
    loss = aux_sum = 0.0
    counts = 0
    for s in range(0, windows.shape[0], micro):
        ce, aux, c = forward(windows[s:s + micro])
        ((ce + coef * aux) * (windows[s:s + micro].shape[0] / per_rank)).backward()
        loss += ce.item() / (per_rank // micro)
        aux_sum += aux.item() / (per_rank // micro)
        counts = counts + c
    return loss, aux_sum, counts


def train_model(model, opts: TrainOptions, train: torch.Tensor, held: torch.Tensor, seq: int, dev: str,
                state: TuningState, progress: Progress | None, par, bf16: bool) -> dict:
    """The run's steps (resumed from state's last snapshot when there is one); returns its record for report.json."""
    run = _Training(model, opts, train, held, seq, dev, par, state)
    t0 = time.time()
    if run.before is None:
        run.before = run.evaluate()
    par.arrive("the training loop")
    for step in range(run.start, run.total):
        run.step(step, progress)
        state.checkpoint(step + 1, run.total, lambda step=step: run.snapshot(step + 1))
    after = run.evaluate()
    return run.record(after, time.time() - t0)


class _Training:
    """A next-token training run between its setup and its end: what trains, the step and its schedule, AdamW, the
    token stream, and the record kept along the run (the held-out scores before, the curve and its current
    interval: loss, balance, expert counts and steps summed since its last point)."""

    def __init__(self, model, opts: TrainOptions, train: torch.Tensor, held: torch.Tensor, seq: int, dev: str, par,
                 state: TuningState):
        from ..training.steps import WindowStream
        from ..maths.numerics import tuning_autocast

        self.model, self.opts, self.held, self.seq, self.dev, self.par = model, opts, held, seq, dev, par
        self.n, self.k = _counts(model.config)
        self.coef = opts.aux_loss_coef if opts.aux_loss_coef is not None else float(
            getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.per_step = per_step = max(1, opts.step_tokens // seq)
        self.per_rank = per_step // par.world
        self.total = total = max(1, math.ceil(opts.tokens / (per_step * seq)))
        self.warm = min(total, max(5, total // 20))  # Adam's first steps move every weight by the whole step: warm up
        self.micro = self.per_rank if dev.startswith("cuda") else 1  # windows a forward
        # FSDP2 computes in bf16 by its policy where the model is sharded; autocast in one process
        self.ctx = contextlib.nullcontext() if par.sharded else tuning_autocast(dev, "auto")[0]
        self.stream = WindowStream(train, opts.seed)
        saved = state.load()  # the last snapshot, or None
        if saved is not None:
            self._resume(*saved)
        else:
            self.base_lrs = [_base_lr(p, opts.lr) for p in self.params]
            self.start, self.curve, self.before = 0, [], None
            self.window_loss, self.window_aux, self.window_counts, self.window_steps = 0.0, 0.0, 0, 0
        self.opt = self._optimizer(saved)
        self.every = max(1, total // 20)  # points on the curve kept in report.json

    def _resume(self, tensors: dict, meta: dict) -> None:
        """The saved run's weights, stream position and record."""
        from ..training.parallel import assign

        self.base_lrs = list(meta["base_lrs"])
        for j, p in enumerate(self.params):
            assign(p, tensors[f"param.{j}"])
        self.stream.load_state({"stream.gen": tensors["stream.gen"], "stream.order": tensors["stream.order"]}, meta)
        self.start, self.curve, self.before = int(meta["step"]), list(meta["curve"]), dict(meta["before"])
        # the curve's current interval: loss, balance, steps, and its counts
        self.window_loss, self.window_aux, self.window_steps = list(meta["window"])
        self.window_counts = tensors["window.counts"].to(self.dev) if "window.counts" in tensors else 0

    def _optimizer(self, saved: tuple[dict, dict] | None) -> torch.optim.AdamW:
        """AdamW over a group per tensor at the base step sizes; a resumed run's moments put back."""
        from ..training.parallel import like

        opt = torch.optim.AdamW([{"params": [p], "lr": lr} for p, lr in zip(self.params, self.base_lrs)],
                                betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        if saved is not None:
            tensors, meta = saved
            opt.load_state_dict({"state": {j: {"step": tensors[f"opt.{j}.step"],
                                               "exp_avg": like(p, tensors[f"opt.{j}.exp_avg"]),
                                               "exp_avg_sq": like(p, tensors[f"opt.{j}.exp_avg_sq"])}
                                           for j, p in enumerate(self.params) if f"opt.{j}.step" in tensors},
                                 "param_groups": meta["param_groups"]})
        return opt

    def lr_at(self, step: int) -> float:
        warm, total = self.warm, self.total
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    def forward(self, ids: torch.Tensor):
        with self.ctx:
            res = self.model(input_ids=ids.to(self.dev), output_router_logits=True)
        ce = F.cross_entropy(res.logits[:, :-1].float().reshape(-1, res.logits.shape[-1]),
                             ids[:, 1:].reshape(-1).to(self.dev))
        aux, counts = balance(res.router_logits, self.n, self.k)
        return ce, aux, counts

    def evaluate(self) -> dict:
        held = self.held
        with torch.no_grad():
            ces, auxes, counts = [], [], 0
            for i in range(held.shape[0]):
                ce, aux, c = self.forward(held[i:i + 1])
                ces.append(ce.item())
                auxes.append(aux.item())
                counts = counts + c
        loss = sum(ces) / len(ces)
        return {"loss": round(loss, 5), "perplexity": round(math.exp(loss), 4),
                "balance": round(sum(auxes) / len(auxes), 5), **load_summary(counts)}

    def _pending(self, t: torch.Tensor):  # gathered when written, one tensor at a time (a collective)
        from ..training.steps import Pending
        from ..training.parallel import full

        par = self.par
        return Pending(tuple(t.shape), t.dtype,
                       lambda t=t: (lambda w: w.contiguous().cpu() if par.main else None)(full(t.detach())))

    def snapshot(self, done: int) -> tuple[dict, dict]:
        """The run's state after `done` steps (TuningState.checkpoint)."""
        st = self.opt.state_dict()
        tensors = {f"param.{j}": self._pending(p) for j, p in enumerate(self.params)}
        for j, s in st["state"].items():
            tensors[f"opt.{j}.step"] = s["step"].detach().cpu().reshape(1) if torch.is_tensor(s["step"]) else \
                torch.tensor([float(s["step"])])
            tensors[f"opt.{j}.exp_avg"] = self._pending(s["exp_avg"])
            tensors[f"opt.{j}.exp_avg_sq"] = self._pending(s["exp_avg_sq"])
        gen, _ = self.stream.state()
        tensors.update({k: v.contiguous() for k, v in gen.items()})
        if torch.is_tensor(self.window_counts):
            tensors["window.counts"] = self.window_counts.cpu().contiguous()
        meta = {"step": done, "total": self.total, "base_lrs": self.base_lrs, "param_groups": st["param_groups"],
                "curve": self.curve, "before": self.before, "pos": self.stream.pos, "passes": self.stream.passes,
                "window": [self.window_loss, self.window_aux, self.window_steps]}
        return tensors, meta

    def step(self, step: int, progress: Progress | None) -> None:
        """One optimizer step (0-based) on this rank's share of the step's windows, its loss, balance and expert
        counts added to the curve's interval (over every rank's tokens), a curve point where one is due."""
        par, opt = self.par, self.opt
        par.at(f"step {step + 1:,} of the training loop")
        for g, lr in zip(opt.param_groups, self.base_lrs):
            g["lr"] = lr * self.lr_at(step)
        mine = self.stream.take(self.per_step)[par.rank::par.world]  # this rank's share of the step's windows
        loss, aux, counts = train_step(self.model, mine, self.micro, self.per_rank, self.coef, self.forward)
        if par.on:  # over every rank's tokens: the mean loss and balance, the summed expert counts
            loss, aux = (par.mean(torch.tensor(v, dtype=torch.float64)).item() for v in (loss, aux))
            counts = par.mean(counts) * par.world
        self.window_loss, self.window_aux, self.window_counts = (
            self.window_loss + loss, self.window_aux + aux, self.window_counts + counts)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.window_steps += 1
        if (step + 1) % self.every == 0 or step + 1 == self.total:
            self._curve_point(step + 1)
        if progress:
            last = self.curve[-1] if self.curve else None
            note = (f"loss {last['loss']:.3f}, max load {last['max_load']:.1f}x, {last['starved']} starved"
                    if last else "")
            progress("training", (step + 1) * self.per_step * self.seq, self.total * self.per_step * self.seq, note)

    def _curve_point(self, done: int) -> None:
        """The curve's point after `done` steps: the interval's mean loss and balance and its expert load; a new
        interval begun."""
        load = load_summary(self.window_counts)
        steps = self.window_steps
        self.curve.append({"step": done, "tokens": done * self.per_step * self.seq,
                           "loss": round(self.window_loss / steps, 5), "balance": round(self.window_aux / steps, 5),
                           "max_load": load["max_load"], "starved": load["starved"]})
        self.window_loss, self.window_aux, self.window_counts, self.window_steps = 0.0, 0.0, 0, 0

    def record(self, after: dict, seconds: float) -> dict:
        """The run's record for report.json (its held-out scores after it, its seconds)."""
        opts, per_step, seq, total = self.opts, self.per_step, self.seq, self.total
        return {"objective": "next-token + load balancing", "tokens": total * per_step * seq, "steps": total,
                "step_tokens": per_step * seq, "aux_loss_coef": self.coef, "lr": opts.lr,
                "trained": [t for t, on in (("router", opts.train_router), ("experts", opts.train_experts),
                                            ("attention", opts.train_attention)) if on],
                "trained_params": sum(p.numel() for p in self.params), "seconds": round(seconds, 1),
                "resumed": self.start > 0, "device": self.dev, "processes": self.par.world,
                "offload": bool(self.par.offload),
                "tokens_per_second": round((total - self.start) * per_step * seq / max(1e-9, seconds), 1),
                "held_out_before": self.before, "held_out_after": after, "curve": self.curve,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}


__all__ = ["load_model", "train_model", "train_step"]
