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
uninterrupted run would have (same machine, thread count and number of processes). The output is written back all or
nothing, in its own dtype and tensor names (checked against the base's).

Across processes (torchrun, accelerate launch) it runs as carve tuning does (moeify.training.parallel): every rank checks the
inputs and one rank's refusal is every rank's, the ranks meet at each phase within the collective timeout, rank 0
writes the state and the output; the model is sharded by FSDP2 and each step's windows are split by rank
(moeify.tuning.lm_loop). This module: the run's checks and state directory, and the output written.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..formats.checkpoint import CheckpointReader
from ..errors import MoeifyError
from ..formats.output import check_free_space, commit_output, prepare_output
from ..formats.writer import ShardLayout, ShardWriter, check_written
from .across import run_across
from .lm_options import HOLD_OUT, TrainOptions, balance, is_trainable_output, load_summary, moe_shape
from .lm_weights import planned, write_weights
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


def _windows(out: Path, opts: TrainOptions, max_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every window of each text file; the last ones of each file held out (a twentieth, at most HOLD_OUT in all), so
    a mix of texts is judged on every one of them."""
    from ..formats.text import text_windows

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
                 memory_check: bool = True, offload: bool = False, timeout: float | None = None) -> dict:
    """Train the upcycled or merged output OUT on next-token prediction plus the load-balancing loss and write it
    back all or nothing. Returns the new report.json (its "training" record). resume: continue the interrupted run
    in OUT.moeify-tune/ (its own options; `given` must agree); restart: discard such a state. Under torchrun (or
    accelerate launch) the model is sharded across the processes (moeify.tuning.lm_loop); offload: its weights,
    gradients and AdamW state in host memory (FSDP2 CPU offload). timeout: across processes, the seconds a rank
    waits for the others (moeify.training.parallel.collective_timeout)."""
    from ..maths.numerics import map_large_allocations, resolve_device
    from ..training.parallel import setup

    out = Path(out)
    par = setup(resolve_device(device), timeout)
    if par.device == "cpu":  # what a step frees goes back to the system (train_memory counts no fragmented heap)
        map_large_allocations()
    par.resume_hint = f"moeify tune {out} --resume"
    return run_across(par, out, lambda: _train_across(
        out, par, opts, resume=resume, restart=restart, save_every=save_every, progress=progress if par.main else None,
        notify=notify if par.main else None, given=given, memory_check=memory_check, offload=offload))


def _check(out: Path, root: Path, par, opts: TrainOptions | None, resume: bool, restart: bool, given: dict | None,
           memory_check: bool, offload: bool):
    """Every refusal of a run, before any work, on every rank: (options, training and held-out windows, seq)."""
    if resume and restart:
        raise MoeifyError("--resume and --restart contradict each other", "pass one of them")
    if not is_trainable_output(out):
        raise MoeifyError(f"{out} is not an output of moeify upcycle or moeify merge",
                          "a carve is tuned towards its dense source: moeify tune SRC OUT --tokens N")
    if resume:
        opts = _check_resume(root, out, opts, given)
        world = _json_file(root / "run.json").get("world_size", 1)
        if world != par.world:
            raise MoeifyError(f"{root} was saved by a run across {world} process(es); this one has {par.world}",
                              "resume with the same number of processes (the windows are split by rank), or start "
                              "anew with --restart")
    else:
        if opts is None:
            raise MoeifyError("--tokens is required", "e.g. --tokens 1048576")
        opts.validate()
        if (root / "run.json").exists() and not restart:
            raise MoeifyError(f"{out} has an interrupted run in {root}",
                              f"continue it with: moeify tune {out} --resume; or pass --restart to discard it")
    config = json.loads((out / "config.json").read_text())
    seq = min(opts.seq_len, int(config.get("max_position_embeddings") or opts.seq_len))
    if (opts.step_tokens // seq) % par.world:
        raise MoeifyError(f"--step-tokens {opts.step_tokens} makes {opts.step_tokens // seq} windows of {seq} tokens "
                          f"a step, which {par.world} processes cannot share evenly",
                          f"use a multiple of {par.world * seq}, e.g. --step-tokens {par.world * seq * 8}")
    if memory_check:
        check_memory(out, config, opts, seq, par, offload)
    train, held, seq = _windows(out, opts, int(config.get("max_position_embeddings") or opts.seq_len))
    if par.main:
        check_free_space(out, sum(f.stat().st_size for f in out.glob("*.safetensors")), overwrite=True)
    return opts, train, held, seq


def check_memory(out: Path, config: dict, opts: TrainOptions, seq: int, par, offload: bool) -> None:
    """Refuse a run whose predicted peak per process (moeify.maths.memory.train_memory, from OUT's config) exceeds the
    device's memory, naming how many processes would hold it."""
    from ..maths.memory import PROCESS_COUNTS, device_memory

    have = device_memory(par.device)
    mem = predicted_memory(config, opts, seq, par.device, par.world, offload)
    if not have or mem.peak <= have:
        return
    fits = next((g for g in PROCESS_COUNTS if predicted_memory(config, opts, seq, par.device, g, offload).peak
                 <= have), None)
    hint = (f"run it across {fits} processes: torchrun --nproc-per-node {fits} -m moeify tune {out} ..."
            if fits and fits > par.world else "train the routers alone (--router-only), or use a larger machine")
    raise MoeifyError(f"training {out} needs about {mem.peak / 1e9:.1f} GB a process on {par.device} across "
                      f"{par.world} process(es) (predicted: moeify/maths/memory.py's train_memory), and it has "
                      f"{have / 1e9:.1f} GB", f"{hint}; or --no-memory-check")


def predicted_memory(config: dict, opts: TrainOptions, seq: int, dev: str, world: int = 1, offload: bool = False):
    """moeify.maths.memory.train_memory of this run (OUT's config, the options, the windows a forward on each process)."""
    from ..maths.memory import train_memory
    from ..maths.numerics import tuning_autocast

    per_rank = max(1, opts.step_tokens // seq // world)
    return train_memory(**moe_shape(config), seq=seq, windows=per_rank if dev.startswith("cuda") else 1,
                        world=world, offload=offload, device=dev, bf16=tuning_autocast(dev, "auto")[1],
                        train_router=opts.train_router, train_experts=opts.train_experts,
                        train_attention=opts.train_attention)


def _begin(root: Path, out: Path, opts: TrainOptions, resume: bool, restart: bool, world: int) -> None:
    """The state directory (rank 0): locked, and for a new run emptied and described in run.json."""
    if resume:
        _lock(root)
        return
    if restart and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    _lock(root)
    _atomic_write(root / "run.json", json.dumps({
        "version": STATE_VERSION, "objective": "next-token", "created": time.time(), "world_size": world,
        "base_fingerprint": base_fingerprint(out), "options": dataclasses.asdict(opts)}).encode())


def _train_across(out: Path, par, opts: TrainOptions | None, *, resume: bool, restart: bool, save_every: float,
                  progress, notify, given: dict | None, memory_check: bool, offload: bool) -> dict:
    """train_output's run on every rank (one, or each of a torchrun's): its checks agreed, rank 0 writing."""
    from ..maths.numerics import tuning_autocast
    from .lm_loop import load_model, train_model

    root = state_dir(out)
    opts, train, held, seq = par.agree(lambda: _check(out, root, par, opts, resume, restart, given, memory_check,
                                                      offload), "checking the inputs")
    par.agree(lambda: par.main and _begin(root, out, opts, resume, restart, par.world), "beginning the state directory")
    if offload:
        from ..training.parallel import with_offload

        par = with_offload(par)
    report = json.loads((out / "report.json").read_text())
    bf16 = tuning_autocast(par.device, "auto")[1]
    model = par.agree(lambda: load_model(out, par.device, par, opts, bf16), "loading the model")
    state = TuningState(root, save_every, par)
    with _stop_on_signal(state, notify):
        info = train_model(model, opts, train, held, seq, par.device, state, progress, par, bf16)
    info["text"] = {"files": [str(f) for f in opts.text], "train_windows": int(train.shape[0]),
                    "held_out_windows": int(held.shape[0]), "seq_len": seq}
    from .sizing import peak_memory

    info["peak_bytes"], info["peak_what"] = peak_memory(par.device)
    info["largest_peak_bytes"] = par.most(info["peak_bytes"])  # of any process (a collective)
    info["predicted_peak_bytes"] = predicted_memory(json.loads((out / "config.json").read_text()), opts, seq,
                                                    par.device, par.world, bool(par.offload)).peak
    par.arrive("writing the output")
    return _write(out, root, model, report, info, opts, par)


def _write(out: Path, root: Path, model, report: dict, info: dict, opts: TrainOptions, par) -> dict:
    """The trained weights in OUT's dtype and tensor names (checked against the base's names, shapes and dtypes
    before and after), OUT's config, tokenizer and files, report.json with the run, the card: all or nothing. A
    sharded model is gathered to rank 0 one parameter at a time as it writes (moeify.tuning.lm_weights)."""
    base = CheckpointReader(out)
    try:
        dtype = next(iter(base.tensors.values())).dtype
        order = planned(model, base.tensors)  # the base's names and shapes, or refused before any gathering
    finally:
        base.close()
    if not par.main:
        write_weights(model, None, None, dtype, par)
        return report
    report = copy.deepcopy(report)
    runs = list(report.get("training", {}).get("runs", [])) + [info]
    report["training"] = {"tokens": sum(r["tokens"] for r in runs), "seconds": round(sum(r["seconds"] for r in runs), 1),
                          "held_out_perplexity": info["held_out_after"]["perplexity"], "runs": runs}
    _write_main(out, model, report, order, dtype, par)
    shutil.rmtree(root, ignore_errors=True)
    return report


def _write_main(out: Path, model, report: dict, order: list, dtype: torch.dtype, par) -> None:
    """Rank 0's part of _write: OUT.moeify-partial written whole, then put in OUT's place."""
    from ..formats.card import write as write_card

    runs = report["training"]["runs"]
    tmp = prepare_output(out, overwrite=True)
    try:
        writer = ShardWriter(tmp, ShardLayout.plan(order, 5 * 10**9))
        write_weights(model, writer, {t.name for t in order}, dtype, par)
        writer.finish()
        check_written(tmp, order)
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


__all__ = ["TrainOptions", "balance", "is_trainable_output", "load_summary", "train_output"]
