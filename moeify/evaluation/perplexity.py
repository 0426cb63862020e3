"""Perplexity (same tokens, same windows for every model) and routing statistics of MoE models.

    text ──► tokenized once (first model's tokenizer; every other must match) ──► windows ──► each model in turn:
    load → forward window batches → NLL of the new tokens of each window (+ router hooks on MoE layers) → free

Windows follow the standard sliding-window method: window j covers tokens [j·stride, j·stride + seq_len) and
scores only the tokens no earlier window scored (with stride = seq_len: every token but the window's first).
Routing statistics count every token exactly once (the new tokens of each window).

Generation health (with `--tasks`): greedy continuations of the same prompts from the text (GEN_PROMPTS prompts of
GEN_PROMPT_TOKENS tokens, GEN_NEW_TOKENS new tokens each) and the share of their n-grams that repeat. Task accuracy is
moeify.evaluation.tasks' (lm-eval), run on each model while it is loaded (evaluate's `visit`).

Pure maths (mean ± SE and paired differences, repeated n-grams) are plain functions the tests call directly; routing
statistics, oracle top-k and finding a model's MoE layers are moeify.evaluation.routing's; the text, its tokens and
the windows are moeify.formats.text's.
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import MoeifyError
from ..maths.numerics import bf16_fast
from ..maths.stats import mean_and_se, paired_difference  # noqa: F401  (re-exported: moeify.evaluation.perplexity.mean_and_se)
from ..formats.text import (Window, batch_windows, check_same_tokenizer, first_line, load_tokenizer, make_windows,
                   read_text, tokenize)
from .routing import (LayerRouting, MoeLayer, RoutingAccumulator, count_params, find_moe_layers, oracle_topk,
                      expert_output_norms, routing_stats, same_topk_sets)  # noqa: F401  (the last three: re-exported for tests, scripts)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_SEQ_LEN = 2048
GEN_PROMPTS, GEN_PROMPT_TOKENS, GEN_NEW_TOKENS, GEN_NGRAM = 16, 32, 64, 4  # generation health

Progress = Callable[[str, int, int], None]  # (model label, windows done, windows total)


@dataclass(frozen=True)
class EvalSettings:
    seq_len: int | None = None  # None: min(2048, the smallest model context)
    stride: int | None = None  # None: seq_len (non-overlapping windows)
    max_tokens: int | None = None  # None: the whole text
    batch_size: int = 4
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | bfloat16 | float16 | float32
    oracle: bool = True  # also score router top-k against the top-k by true expert output norm
    kl: bool = True  # also the mean KL(first model || model) of the next-token distributions
    generation: bool | None = None  # also the repeated n-grams of greedy continuations of prompts from the text


# ------------------------------------------------------------------------ statistics and generation (pure)


def repeated_ngram_share(tokens: Sequence[int], n: int = GEN_NGRAM) -> float:
    """Share of a sequence's n-grams that repeat an earlier n-gram of it: 1 − distinct / all (rep-n of Welleck et
    al. 2019, "Neural text degeneration with unlikelihood training"); 0 when it has no n-gram."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def generation_prompts(ids: torch.Tensor, n: int = GEN_PROMPTS, length: int = GEN_PROMPT_TOKENS) -> torch.Tensor:
    """(n, length): n prompts spread evenly over the text's tokens (fewer when it is short)."""
    count = min(n, len(ids) // length)
    if count == 0:
        raise MoeifyError(f"the text has {len(ids)} tokens: too few for a generation prompt of {length}",
                          "give more text with --data")
    step = len(ids) // count
    return torch.stack([ids[i * step:i * step + length] for i in range(count)])


@torch.no_grad()
def greedy_repetition(model, prompts: torch.Tensor, new_tokens: int = GEN_NEW_TOKENS, n: int = GEN_NGRAM) -> list[float]:
    """Each prompt's greedy continuation of `new_tokens` tokens (end-of-text suppressed, so each has all of them):
    its share of repeated n-grams."""
    device = next(model.parameters()).device
    out = model.generate(prompts.to(device), attention_mask=torch.ones_like(prompts, device=device), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                         temperature=None, top_p=None, top_k=None)
    return [repeated_ngram_share(row[prompts.shape[1]:].tolist(), n) for row in out.cpu()]


# ------------------------------------------------------------------------------------------- scoring


@dataclass
class ModelResult:
    path: str
    model_type: str
    dtype: str
    device: str
    perplexity: float
    mean_nll: float
    ratio: float  # perplexity / reference perplexity
    scored_tokens: int
    total_params: int
    active_params: int
    tokens_per_s: float  # window tokens through the forward per second (router-statistics time excluded)
    seconds: float
    n_experts: int | None = None
    top_k: int | None = None
    routing: list[LayerRouting] | None = None
    kl: float | None = None  # mean KL(reference || this model) of the next-token distributions over the scored tokens
    generation: dict | None = None  # repeated n-grams of greedy continuations (mean ± SE; to the reference, paired)


@dataclass
class EvalResult:
    data: dict
    settings: dict
    models: list[ModelResult] = field(default_factory=list)
    tasks: dict | None = None  # task accuracy (moeify.evaluation.tasks.compare_tasks), with --tasks

    def to_json(self) -> dict:
        return {"data": self.data, "settings": self.settings, "models": [asdict(m) for m in self.models],
                **({"tasks": self.tasks} if self.tasks is not None else {})}


class _RouterHooks:
    """Forward hooks on every router: accumulate statistics of the rows in `mask` (the new tokens of each window)."""

    def __init__(self, moe_layers: list[MoeLayer], oracle: bool):
        self.layers = moe_layers
        self.acc = {m.layer_idx: RoutingAccumulator(m.layer_idx, m.n_experts, m.top_k) for m in moe_layers}
        self.mask: torch.Tensor | None = None  # (B·L,) bool, set before each forward
        self.seconds = 0.0  # time spent here, excluded from tokens/s
        self.handles = [m.router.register_forward_hook(self._hook(m, oracle)) for m in moe_layers]

    def _hook(self, m: MoeLayer, oracle: bool):
        def hook(module, args, output):
            t0 = _clock(args[0])
            logits, _, indices = output
            mask = self.mask.to(logits.device)
            oracle_idx = None
            if oracle and m.oracle_applies:
                hidden = args[0].reshape(-1, args[0].shape[-1])[mask]
                ex = m.experts
                oracle_idx = oracle_topk(hidden, ex.gate_up_proj, ex.down_proj, ex.act_fn, m.top_k)
            self.acc[m.layer_idx].add(logits[mask], indices[mask], oracle_idx)
            self.seconds += _clock(args[0]) - t0
        return hook

    def remove(self) -> list[LayerRouting]:
        for h in self.handles:
            h.remove()
        return [self.acc[m.layer_idx].result() for m in self.layers]


def _clock(t: torch.Tensor) -> float:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return time.perf_counter()


@torch.no_grad()
def score_model(model, ids: torch.Tensor, windows: list[Window], batch_size: int = 4, oracle: bool = True,
                progress: Callable[[int, int], None] | None = None, keep_states: bool = False,
                ref: dict | None = None) -> dict:
    """NLL sum over the scored tokens of every window, routing statistics, forward time.

    keep_states: also return the final hidden states of the scored positions (CPU) and the output head, so that a
    later model's KL(reference || model) can be computed (`ref`: that return value) without holding two models or
    a (tokens x vocab) tensor."""
    device = next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    moe_layers = find_moe_layers(model)
    hooks = _RouterHooks(moe_layers, oracle) if moe_layers else None
    rows_per_chunk = max(1, 2 ** 25 // model.config.vocab_size)  # ~128 MB of float32 logits at a time
    nll, scored, fed, seconds, done, kl = 0.0, 0, 0, 0.0, 0, 0.0
    batches = batch_windows(windows, batch_size)
    kept = []
    try:
        # untimed warm-up on the first batch's shape (no statistics): one-off start-up costs (kernel selection,
        # allocator) would otherwise count against the first model's tokens/s
        warm = torch.stack([ids[w.begin:w.end] for w in batches[0]]).to(device)
        if hooks:
            hooks.mask = torch.zeros(warm.numel(), dtype=torch.bool)
        decoder(input_ids=warm)
        for b_idx, batch in enumerate(batches):
            w0 = batch[0]
            x = torch.stack([ids[w.begin:w.end] for w in batch]).to(device)  # (B, L)
            if hooks:
                new = torch.arange(w0.length) >= w0.new_from
                hooks.mask = new.repeat(len(batch))
                hooks.seconds = 0.0
            t0 = _clock(x)
            h = decoder(input_ids=x).last_hidden_state  # (B, L, H)
            s = max(w0.new_from, 1)
            states = h[:, s - 1:-1].reshape(-1, h.shape[-1])  # predict positions s..L-1
            targets = x[:, s:].reshape(-1)
            for c in range(0, len(targets), rows_per_chunk):
                logits = head(states[c:c + rows_per_chunk]).float()
                nll += F.cross_entropy(logits, targets[c:c + rows_per_chunk], reduction="sum").item()
            seconds += _clock(x) - t0 - (hooks.seconds if hooks else 0.0)
            if keep_states:
                kept.append(states.cpu())
            if ref is not None:
                kl += _kl_sum(states, ref["states"][b_idx].to(device), ref["head"], head, rows_per_chunk)
            scored += len(targets)
            fed += x.numel()
            done += len(batch)
            if progress:
                progress(done, len(windows))
    finally:
        routing = hooks.remove() if hooks else None
    total, active = count_params(model, moe_layers)
    return {"nll": nll, "scored": scored, "fed": fed, "seconds": seconds, "routing": routing, "total": total,
            "active": active, "moe_layers": moe_layers, "kl": kl / scored if ref is not None else None,
            "states": kept if keep_states else None, "head": head if keep_states else None}


def _kl_sum(states: torch.Tensor, ref_states: torch.Tensor, ref_head, head, rows: int) -> float:
    """Sum over positions of KL(reference || model) of the next-token distributions, `rows` positions at a time."""
    total = 0.0
    for c in range(0, states.shape[0], rows):
        t = F.log_softmax(ref_head(ref_states[c:c + rows]).float(), -1)
        m = F.log_softmax(head(states[c:c + rows]).float(), -1)
        total += (t.exp() * (t - m)).sum().item()
    return total


# ---------------------------------------------------------------------------------------- pipeline


SLOW_BF16 = ("moeify eval: --dtype bfloat16 on a CPU without AVX512-BF16 or AMX: its products are emulated, about "
             "100x slower than float32 on an AVX2 EPYC; use --dtype float32 (or auto) on this machine")


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device not in DEVICES:
        raise MoeifyError(f"--device {device} is not one of {', '.join(DEVICES)}")
    if dtype != "auto" and dtype not in DTYPES:
        raise MoeifyError(f"--dtype {dtype} is not one of auto, {', '.join(DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoeifyError("--device cuda: no CUDA device is available", "use --device cpu (or auto)")
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype == "bfloat16" and dev.type == "cpu" and not bf16_fast("cpu"):
        warnings.warn(SLOW_BF16, stacklevel=2)
    return dev, DTYPES[dtype]


def _load_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise MoeifyError(f"{path}: not a model directory (no config.json)",
                          "give checkpoint directories, e.g. moeify eval path/to/dense out/llama-moe")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise MoeifyError(f"{path}/config.json cannot be read by transformers ({first_line(exc)})") from None


def _load_model(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our own progress bar is on screen
    try:
        kw = {"device_map": str(device)} if device.type == "cuda" else {}
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval().to(device)
    except Exception as exc:
        raise MoeifyError(f"{path}: transformers cannot load this model ({first_line(exc)})") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _check_settings(s: EvalSettings, context: int | None, context_path: Path | None) -> tuple[int, int]:
    for flag, value, minimum in (("--seq-len", s.seq_len, 2), ("--stride", s.stride, 1),
                                 ("--max-tokens", s.max_tokens, 2), ("--batch-size", s.batch_size, 1)):
        if value is not None and value < minimum:
            raise MoeifyError(f"{flag} {value} must be at least {minimum}")
    seq_len = s.seq_len or min(DEFAULT_MAX_SEQ_LEN, context or DEFAULT_MAX_SEQ_LEN)
    if context is not None and seq_len > context:
        raise MoeifyError(f"--seq-len {seq_len} is larger than the context of {context_path} "
                          f"(max_position_embeddings {context})", f"use --seq-len {context} or less")
    stride = s.stride or seq_len
    if stride > seq_len:
        raise MoeifyError(f"--stride {stride} is larger than --seq-len {seq_len}: tokens between windows would "
                          "never be scored", "use --stride <= --seq-len")
    return seq_len, stride


def evaluate(model_paths: list[str | Path], data: str | Path | None = None, settings: EvalSettings = EvalSettings(),
             progress: Progress | None = None, visit: Callable[[object, Path, str], None] | None = None) -> EvalResult:
    """Perplexity of every model on the same tokens and windows; routing statistics for MoE models; with
    settings.generation, the repeated n-grams of greedy continuations. visit(model, path, label) is called with
    each loaded model before it is freed (moeify.api runs the tasks there)."""
    paths = [Path(p) for p in model_paths]
    if not paths:
        raise MoeifyError("no model given", "moeify eval path/to/dense out/llama-moe")
    # everything that can fail cheaply fails before any model is loaded
    device, dtype = resolve_device(settings.device, settings.dtype)
    configs = [_load_config(p) for p in paths]
    contexts = [(getattr(c, "max_position_embeddings", None), p) for c, p in zip(configs, paths)]
    context, context_path = min(((c, p) for c, p in contexts if c), default=(None, None), key=lambda cp: cp[0])
    seq_len, stride = _check_settings(settings, context, context_path)
    text, label = read_text(data)
    tokenizer = load_tokenizer(paths[0])
    for p in paths[1:]:
        check_same_tokenizer(tokenizer, paths[0], load_tokenizer(p), p, text[:4000])
    ids = tokenize(tokenizer, text, settings.max_tokens)
    if len(ids) < 2:
        raise MoeifyError(f"--data {label} has {len(ids)} token(s): nothing to score", "give more text")
    windows = make_windows(len(ids), seq_len, stride)
    prompts = generation_prompts(ids) if settings.generation else None

    result = EvalResult(
        data={"source": label, "chars": len(text), "tokens": len(ids), "windows": len(windows),
              "scored_tokens": sum(w.scored for w in windows)},
        settings={"seq_len": seq_len, "stride": stride, "max_tokens": settings.max_tokens,
                  "batch_size": settings.batch_size, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                  "oracle": settings.oracle},
    )
    if prompts is not None:
        result.settings["generation"] = {"prompts": len(prompts), "prompt_tokens": prompts.shape[1],
                                         "new_tokens": GEN_NEW_TOKENS, "ngram": GEN_NGRAM}
    ref = None  # the reference's final hidden states and head, for every later model's KL
    for n, (path, config) in enumerate(zip(paths, configs), 1):
        model = _load_model(path, dtype, device)
        t0 = time.perf_counter()
        label = f"{n}/{len(paths)} {path.name}"
        tick = (lambda done, total, name=label: progress(f"scoring {name}", done, total)) if progress else None
        r = score_model(model, ids, windows, settings.batch_size, settings.oracle, tick,
                        keep_states=settings.kl and n == 1 and len(paths) > 1, ref=ref)
        if r["states"] is not None:
            ref = {"states": r["states"], "head": r["head"]}
        mean_nll = r["nll"] / r["scored"]
        ppl = math.exp(mean_nll)
        moe = r["moe_layers"]
        result.models.append(ModelResult(
            path=str(path), model_type=config.model_type, dtype=str(dtype).removeprefix("torch."), device=str(device),
            perplexity=ppl, mean_nll=mean_nll, ratio=ppl / result.models[0].perplexity if result.models else 1.0,
            scored_tokens=r["scored"], total_params=r["total"], active_params=r["active"],
            tokens_per_s=r["fed"] / r["seconds"] if r["seconds"] > 0 else float("inf"),
            seconds=time.perf_counter() - t0,
            n_experts=moe[0].n_experts if moe else None, top_k=moe[0].top_k if moe else None, routing=r["routing"],
            kl=r["kl"],
        ))
        if prompts is not None:
            result.models[-1].generation = _generation(greedy_repetition(model, prompts), result.models[0].generation)
        if visit is not None:
            visit(model, path, label)
        del model, r, moe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _generation(shares: list[float], reference: dict | None) -> dict:
    mean, se = mean_and_se(shares)
    diff, diff_se = paired_difference(reference["per_prompt"], shares) if reference else (None, None)
    return {"repeated": mean, "se": se, "diff": diff, "diff_se": diff_se, "per_prompt": shares}


# -------------------------------------------------------------------------------------------- plotting


def require_matplotlib() -> None:
    """Fail before any work when --plot is given without the optional `plot` extra."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MoeifyError("--plot needs matplotlib, which is not installed", "pip install 'moeify[plot]'")


def plot_routing(result: EvalResult, path: str | Path) -> Path:
    """One heatmap per MoE model: share of tokens (f_i) per layer (rows) and expert (columns)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [m for m in result.models if m.routing]
    if not moe:
        raise MoeifyError("--plot: none of the models is a MoE model, there is no routing to draw")
    path = Path(path)
    fig, axes = plt.subplots(1, len(moe), figsize=(1.5 + 4.5 * len(moe), 1.2 + 0.3 * max(len(m.routing) for m in moe)),
                             squeeze=False)
    for ax, m in zip(axes[0], moe):
        load = [r.load for r in m.routing]
        im = ax.imshow(load, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
        ax.set_title(f"{Path(m.path).name}: share of tokens per expert (top-{m.top_k})", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(m.routing)), [str(r.layer) for r in m.routing], fontsize=7)
        if m.n_experts <= 32:
            ax.set_xticks(range(m.n_experts))
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=f"f (even = {m.top_k / m.n_experts:.3f})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
