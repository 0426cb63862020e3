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
    from ..training.distill import Pending, WindowStream
    from ..maths.numerics import tuning_autocast
    from ..training.parallel import assign, full, like

    n, k = _counts(model.config)
    coef = opts.aux_loss_coef if opts.aux_loss_coef is not None else float(
        getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    per_step = max(1, opts.step_tokens // seq)
    per_rank = per_step // par.world
    total = max(1, math.ceil(opts.tokens / (per_step * seq)))
    warm = min(total, max(5, total // 20))  # Adam's first steps move every weight by the whole step: warm up
    micro = per_rank if dev.startswith("cuda") else 1  # windows a forward
    # FSDP2 computes in bf16 by its policy where the model is sharded; autocast in one process
    ctx = contextlib.nullcontext() if par.sharded else tuning_autocast(dev, "auto")[0]
    stream = WindowStream(train, opts.seed)
    saved = state.load()
    if saved is not None:
        tensors, meta = saved
        base_lrs = list(meta["base_lrs"])
        for j, p in enumerate(params):
            assign(p, tensors[f"param.{j}"])
        stream.load_state({"stream.gen": tensors["stream.gen"], "stream.order": tensors["stream.order"]}, meta)
        start, curve, before = int(meta["step"]), list(meta["curve"]), dict(meta["before"])
        window = list(meta["window"])  # the curve's current interval: loss, balance, steps, and its counts
        window.insert(2, tensors["window.counts"].to(dev) if "window.counts" in tensors else 0)
    else:
        base_lrs = [_base_lr(p, opts.lr) for p in params]
        start, curve, before, window = 0, [], None, [0.0, 0.0, 0, 0]
    opt = torch.optim.AdamW([{"params": [p], "lr": lr} for p, lr in zip(params, base_lrs)], betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.0)
    if saved is not None:
        tensors = saved[0]
        opt.load_state_dict({"state": {j: {"step": tensors[f"opt.{j}.step"],
                                           "exp_avg": like(p, tensors[f"opt.{j}.exp_avg"]),
                                           "exp_avg_sq": like(p, tensors[f"opt.{j}.exp_avg_sq"])}
                                       for j, p in enumerate(params) if f"opt.{j}.step" in tensors},
                             "param_groups": meta["param_groups"]})

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    def forward(ids: torch.Tensor):
        with ctx:
            res = model(input_ids=ids.to(dev), output_router_logits=True)
        ce = F.cross_entropy(res.logits[:, :-1].float().reshape(-1, res.logits.shape[-1]), ids[:, 1:].reshape(-1).to(dev))
        aux, counts = balance(res.router_logits, n, k)
        return ce, aux, counts

    def evaluate() -> dict:
        with torch.no_grad():
            ces, auxes, counts = [], [], 0
            for i in range(held.shape[0]):
                ce, aux, c = forward(held[i:i + 1])
                ces.append(ce.item())
                auxes.append(aux.item())
                counts = counts + c
        loss = sum(ces) / len(ces)
        return {"loss": round(loss, 5), "perplexity": round(math.exp(loss), 4),
                "balance": round(sum(auxes) / len(auxes), 5), **load_summary(counts)}

    def pending(t: torch.Tensor) -> Pending:  # gathered when written, one tensor at a time (a collective)
        return Pending(tuple(t.shape), t.dtype,
                       lambda t=t: (lambda w: w.contiguous().cpu() if par.main else None)(full(t.detach())))

    def snapshot() -> tuple[dict, dict]:
        st = opt.state_dict()
        tensors = {f"param.{j}": pending(p) for j, p in enumerate(params)}
        for j, s in st["state"].items():
            tensors[f"opt.{j}.step"] = s["step"].detach().cpu().reshape(1) if torch.is_tensor(s["step"]) else \
                torch.tensor([float(s["step"])])
            tensors[f"opt.{j}.exp_avg"] = pending(s["exp_avg"])
            tensors[f"opt.{j}.exp_avg_sq"] = pending(s["exp_avg_sq"])
        gen, _ = stream.state()
        tensors.update({k: v.contiguous() for k, v in gen.items()})
        if torch.is_tensor(window_counts):
            tensors["window.counts"] = window_counts.cpu().contiguous()
        meta = {"step": step + 1, "total": total, "base_lrs": base_lrs, "param_groups": st["param_groups"],
                "curve": curve, "before": before, "pos": stream.pos, "passes": stream.passes,
                "window": [window_loss, window_aux, window_steps]}
        return tensors, meta

    t0 = time.time()
    if before is None:
        before = evaluate()
    every = max(1, total // 20)  # points on the curve kept in report.json
    window_loss, window_aux, window_counts, window_steps = window
    par.arrive("the training loop")
    step = start - 1
    for step in range(start, total):
        par.at(f"step {step + 1:,} of the training loop")
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * lr_at(step)
        mine = stream.take(per_step)[par.rank::par.world]  # this rank's share of the step's windows
        loss, aux, counts = train_step(model, mine, micro, per_rank, coef, forward)
        if par.on:  # over every rank's tokens: the mean loss and balance, the summed expert counts
            loss, aux = (par.mean(torch.tensor(v, dtype=torch.float64)).item() for v in (loss, aux))
            counts = par.mean(counts) * par.world
        window_loss, window_aux, window_counts = window_loss + loss, window_aux + aux, window_counts + counts
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window_steps += 1
        if (step + 1) % every == 0 or step + 1 == total:
            load = load_summary(window_counts)
            curve.append({"step": step + 1, "tokens": (step + 1) * per_step * seq,
                          "loss": round(window_loss / window_steps, 5), "balance": round(window_aux / window_steps, 5),
                          "max_load": load["max_load"], "starved": load["starved"]})
            window_loss, window_aux, window_counts, window_steps = 0.0, 0.0, 0, 0
        if progress:
            last = curve[-1] if curve else None
            note = (f"loss {last['loss']:.3f}, max load {last['max_load']:.1f}x, {last['starved']} starved"
                    if last else "")
            progress("training", (step + 1) * per_step * seq, total * per_step * seq, note)
        state.checkpoint(step + 1, total, snapshot)
    after = evaluate()
    seconds = time.time() - t0
    return {"objective": "next-token + load balancing", "tokens": total * per_step * seq, "steps": total,
            "step_tokens": per_step * seq, "aux_loss_coef": coef, "lr": opts.lr,
            "trained": [t for t, on in (("router", opts.train_router), ("experts", opts.train_experts),
                                        ("attention", opts.train_attention)) if on],
            "trained_params": sum(p.numel() for p in params), "seconds": round(seconds, 1),
            "resumed": start > 0, "device": dev, "processes": par.world, "offload": bool(par.offload),
            "tokens_per_second": round((total - start) * per_step * seq / max(1e-9, seconds), 1),
            "held_out_before": before, "held_out_after": after, "curve": curve,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}


__all__ = ["load_model", "train_model", "train_step"]
