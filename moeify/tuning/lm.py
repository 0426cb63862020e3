"""Next-token training of an upcycled or merged MoE: `moeify tune OUT --tune-text TEXT --tokens N` on an output of
`moeify upcycle` or `moeify merge` (its report.json's construction).

A carve is tuned towards its dense source (run.py: distillation). An upcycle's experts start as copies of the dense
FFN and a merge's come from several fine-tunes: there is no single dense model to match, and what such a model needs
is MoE training on text: the cross-entropy of the next token plus Mixtral's load-balancing loss,
α · N · Σᵢ fᵢ Pᵢ per layer (fᵢ the share of the layer's top-k choices that went to expert i, Pᵢ its mean router
probability; k when the load is uniform), averaged over the layers, α the output's router_aux_loss_coef unless
--aux-loss-coef says otherwise. The model is the output's own transformers class (Mixtral, Qwen2-MoE, Qwen3-MoE:
the routing the output will be served with), float32 master weights, bf16 autocast on a GPU; it trains the routers
and experts (and the shared expert), the routers alone (--router-only), the experts alone (--freeze-router), and
with --tune-attention attention and norms too. Each tensor's Adam step is relative to its RMS at the start (as
tune's), warmed up over 5% of the steps (at least 5) and decayed by a cosine to a tenth.

As it trains it reports the expert load: per layer the largest expert's share against the uniform one, and the
experts that get under a tenth of the uniform share ("starved": a collapsing router); report.json keeps the curve.
Resumable as tune is: the state (trainable weights, Adam moments, the window stream's position) is saved to
OUT.moeify-tune/ every --save-every seconds and on Ctrl-C / SIGTERM, and --resume ends with the weights an
uninterrupted run would have (same machine and thread count). The output is written back all or nothing, in its own
dtype and tensor names (checked against the base's).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import CheckpointReader
from ..errors import MoeifyError
from ..writer import check_free_space, commit_output, prepare_output
from .lm_options import HOLD_OUT, TrainOptions, _counts, balance, is_trainable_output, load_summary
from .options import Progress
from .state import (
    STATE_VERSION,
    TuningState,
    _atomic_write,
    _json_file,
    _lock,
    _stop_on_signal,
    base_fingerprint,
    check_tensor_file,
    read_snapshot,
    state_dir,
)


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
    rms = p.detach().float().pow(2).mean().sqrt().item()
    return rel * (rms if rms > 0 else p.shape[-1] ** -0.5)


def _windows(out: Path, opts: TrainOptions, max_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every window of each text file; the last ones of each file held out (a twentieth, at most HOLD_OUT in all), so
    a mix of texts is judged on every one of them."""
    from ..calibrate import text_windows

    seq = min(opts.seq_len, max_len)
    per_file = [text_windows(out, [f], seq) for f in opts.text]
    n = sum(w.shape[0] for w in per_file)
    train, held = [], []
    for w in per_file:
        k = min(w.shape[0] // 20, max(1, HOLD_OUT * w.shape[0] // max(1, n)))
        train.append(w[: w.shape[0] - k])
        held.append(w[w.shape[0] - k:])
    train_w, held_w = torch.cat(train), torch.cat(held)
    if train_w.shape[0] < 1 or held_w.shape[0] < 1:
        raise MoeifyError(f"the training text holds {n} window(s) of {seq} tokens: too little to train and hold some "
                          "out", "pass more text with --tune-text (at least 20 windows)")
    return train_w, held_w, seq


def _check_resume(root: Path, out: Path, opts: TrainOptions | None, given: dict | None) -> TrainOptions:
    if not (root / "run.json").is_file():
        raise MoeifyError(f"there is no interrupted training of {out} to resume (no {root.name}/run.json)",
                          f"start one: moeify tune {out} --tune-text TEXT --tokens N")
    run = _json_file(root / "run.json")
    if run.get("objective") != "next-token" or not isinstance(run.get("options"), dict):
        raise MoeifyError(f"{root} is not the state of a next-token training of {out}", "start anew with --restart")
    try:
        saved = TrainOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in run["options"].items()})
    except TypeError as exc:
        raise MoeifyError(f"{root}/run.json is damaged ({exc})", "start anew with --restart") from None
    for k, v in (given or {}).items():
        if v is not None and getattr(saved, k) != (tuple(v) if isinstance(v, list) else v):
            raise MoeifyError(f"--resume: the interrupted run was started with {k} = {getattr(saved, k)!r}, not {v!r}",
                              "resume without that flag, or start anew with --restart")
    if base_fingerprint(out) != run.get("base_fingerprint"):
        raise MoeifyError(f"{root} was started from another {out} (the output changed since)", "start anew with --restart")
    snap = read_snapshot(root)
    if snap is not None:
        check_tensor_file(root / snap["file"])
    return saved


def train_output(out: str | Path, opts: TrainOptions | None = None, *, resume: bool = False, restart: bool = False,
                 device: str = "auto", save_every: float = 600.0, progress: Progress | None = None,
                 notify: Callable[[str], None] | None = None, given: dict | None = None,
                 memory_check: bool = True) -> dict:
    """Train the upcycled or merged output OUT on next-token prediction plus the load-balancing loss and write it
    back all or nothing. Returns the new report.json (its "training" record). resume: continue the interrupted run
    in OUT.moeify-tune/ (its own options; `given` must agree); restart: discard such a state."""
    import os

    from ..numerics import resolve_device

    out = Path(out)
    root = state_dir(out)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MoeifyError("next-token training of an upcycled or merged output runs in one process",
                          "run it without torchrun / accelerate launch")
    if resume and restart:
        raise MoeifyError("--resume and --restart contradict each other", "pass one of them")
    if not is_trainable_output(out):
        raise MoeifyError(f"{out} is not an output of moeify upcycle or moeify merge",
                          "a carve is tuned towards its dense source: moeify tune SRC OUT --tokens N")
    if resume:
        opts = _check_resume(root, out, opts, given)
    else:
        if opts is None:
            raise MoeifyError("--tokens is required", "e.g. --tokens 1048576")
        opts.validate()
        if (root / "run.json").exists() and not restart:
            raise MoeifyError(f"{out} has an interrupted run in {root}",
                              f"continue it with: moeify tune {out} --resume; or pass --restart to discard it")
    dev = resolve_device(device)
    report = json.loads((out / "report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    params = int(report.get("total_params") or 0)
    trainable_share = 1.0 if opts.train_experts else 0.05
    need = params * (4 + 12 * trainable_share)  # float32 weights; gradients and two Adam moments of what trains
    from ..memory import device_memory

    have = device_memory(dev)
    if memory_check and have and need > have:
        raise MoeifyError(f"training {out} needs about {need / 1e9:.1f} GB ({params / 1e6:.0f}M parameters in "
                          f"float32, Adam on what trains); this {dev} has {have / 1e9:.1f} GB",
                          "train the routers alone (--router-only), use a larger machine, or --no-memory-check")
    train, held, seq = _windows(out, opts, int(config.get("max_position_embeddings") or opts.seq_len))
    check_free_space(out, sum(f.stat().st_size for f in out.glob("*.safetensors")), overwrite=True)
    if not resume:
        if restart and root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        _lock(root)
        _atomic_write(root / "run.json", json.dumps({
            "version": STATE_VERSION, "objective": "next-token", "created": time.time(),
            "base_fingerprint": base_fingerprint(out), "options": dataclasses.asdict(opts)}).encode())
    else:
        _lock(root)
    state = TuningState(root, save_every)
    with _stop_on_signal(state, notify):
        model, info = _train(out, opts, train, held, seq, dev, state, progress)
    info["text"] = {"files": [str(f) for f in opts.text], "train_windows": int(train.shape[0]),
                    "held_out_windows": int(held.shape[0]), "seq_len": seq}
    return _write(out, root, model, report, info, opts)


def _train(out: Path, opts: TrainOptions, train: torch.Tensor, held: torch.Tensor, seq: int, dev: str,
           state: TuningState, progress: Progress | None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..distill import WindowStream
    from ..numerics import tuning_autocast

    hf_logging.disable_progress_bar()  # the run's own bar is on screen
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to(dev)
    model.eval()  # no dropout; the router's jitter off: a step is a function of the weights and the windows
    n, k = _counts(model.config)
    coef = opts.aux_loss_coef if opts.aux_loss_coef is not None else float(
        getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    named = [(name, p) for name, p in model.named_parameters() if _selected(name, opts)]
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in named:
        p.requires_grad_(True)
    params = [p for _, p in named]
    per_step = max(1, opts.step_tokens // seq)
    total = max(1, math.ceil(opts.tokens / (per_step * seq)))
    warm = min(total, max(5, total // 20))  # Adam's first steps move every weight by the whole step: warm up
    micro = per_step if dev.startswith("cuda") else 1  # windows a forward
    ctx = tuning_autocast(dev, "auto")[0]
    stream = WindowStream(train, opts.seed)
    saved = state.load()
    if saved is not None:
        tensors, meta = saved
        base_lrs = list(meta["base_lrs"])
        with torch.no_grad():
            for j, p in enumerate(params):
                p.copy_(tensors[f"param.{j}"].to(p.device, p.dtype))
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
                                           "exp_avg": tensors[f"opt.{j}.exp_avg"].to(p.device),
                                           "exp_avg_sq": tensors[f"opt.{j}.exp_avg_sq"].to(p.device)}
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

    def snapshot() -> tuple[dict, dict]:
        st = opt.state_dict()
        tensors = {f"param.{j}": p.detach().cpu().contiguous() for j, p in enumerate(params)}
        for j, s in st["state"].items():
            tensors[f"opt.{j}.step"] = s["step"].detach().cpu().reshape(1) if torch.is_tensor(s["step"]) else \
                torch.tensor([float(s["step"])])
            tensors[f"opt.{j}.exp_avg"] = s["exp_avg"].detach().cpu().contiguous()
            tensors[f"opt.{j}.exp_avg_sq"] = s["exp_avg_sq"].detach().cpu().contiguous()
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
    step = start - 1
    for step in range(start, total):
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * lr_at(step)
        batch = stream.take(per_step)
        for s in range(0, per_step, micro):
            ce, aux, counts = forward(batch[s:s + micro])
            ((ce + coef * aux) * (batch[s:s + micro].shape[0] / per_step)).backward()
            window_loss += ce.item() / (per_step // micro)
            window_aux += aux.item() / (per_step // micro)
            window_counts = window_counts + counts
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
    info = {"objective": "next-token + load balancing", "tokens": total * per_step * seq, "steps": total,
            "step_tokens": per_step * seq, "aux_loss_coef": coef, "lr": opts.lr,
            "trained": [t for t, on in (("router", opts.train_router), ("experts", opts.train_experts),
                                        ("attention", opts.train_attention)) if on],
            "trained_params": sum(p.numel() for p in params), "seconds": round(time.time() - t0, 1),
            "resumed": start > 0, "device": dev, "held_out_before": before, "held_out_after": after, "curve": curve,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return model, info


def _write(out: Path, root: Path, model, report: dict, info: dict, opts: TrainOptions) -> dict:
    """The trained weights in OUT's dtype and tensor names (transformers' own saving, checked against the base's
    names, shapes and dtypes), OUT's config, tokenizer and files, report.json with the run, the card: all or nothing."""
    from ..card import write as write_card

    base = CheckpointReader(out)
    try:
        dtype = next(iter(base.tensors.values())).dtype
        expected = {name: (tuple(t.shape), t.dtype) for name, t in base.tensors.items()}
    finally:
        base.close()
    report = copy.deepcopy(report)
    runs = list(report.get("training", {}).get("runs", [])) + [info]
    report["training"] = {"tokens": sum(r["tokens"] for r in runs), "seconds": round(sum(r["seconds"] for r in runs), 1),
                          "held_out_perplexity": info["held_out_after"]["perplexity"], "runs": runs}
    tmp = prepare_output(out, overwrite=True)
    try:
        weights = tmp / "weights"
        model.to(dtype).save_pretrained(weights, safe_serialization=True, max_shard_size="5GB")
        written = CheckpointReader(weights)
        try:
            got = {name: (tuple(t.shape), t.dtype) for name, t in written.tensors.items()}
        finally:
            written.close()
        if got != expected:
            diff = sorted(set(got) ^ set(expected)) or sorted(n for n in got if got[n] != expected[n])
            raise RuntimeError(f"output check failed: the trained tensors differ from {out}'s in names, shapes or "
                               f"dtypes (e.g. {diff[:3]})")
        for f in weights.iterdir():
            if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
                f.rename(tmp / f.name)
        shutil.rmtree(weights)
        for f in out.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json") and not (
                    tmp / f.name).exists():
                shutil.copyfile(f, tmp / f.name)
        (tmp / "report.json").write_text(json.dumps(report) + "\n")
        toml = (out / "moeify.toml").read_text().split("\n[training]")[0].rstrip("\n")
        t = report["training"]
        toml += (f"\n\n[training]\ntokens = {t['tokens']}\nruns = {len(runs)}\n"
                 f"held_out_perplexity = {t['held_out_perplexity']}\nseconds = {t['seconds']}\n")
        (tmp / "moeify.toml").write_text(toml)
        write_card(tmp, name=out.resolve().name)
        commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(root, ignore_errors=True)
    return report


__all__ = ["TrainOptions", "balance", "is_trainable_output", "load_summary", "train_output"]
