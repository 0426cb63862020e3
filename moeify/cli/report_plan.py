"""Rich rendering of plans: `convert`'s (and --dry-run's) and `moeify plan`'s, with what each serving format and
engine makes of the layout. Only moeify/cli/ prints."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..formats.config import CALIB_TOKENS_CAP
from ..maths.budget import active_neuron_share, padded_width
from ..formats.card import active_share_text
from ..maths.memory import HOST_PER_GPU
from ..evaluation.planning import SERVING_RULES, measured_tradeoff, serving_advice, serving_fit
from .tables import fmt, human_bytes, human_count, table


def print_plan(console: Console, plan, out: Path) -> None:
    """`convert` (and --dry-run): the plan as label/value rows that fit an 80-column terminal."""
    from rich import box

    cfg, src, b = plan.cfg, plan.src, plan.budget
    console.print(f"[bold]moeify plan:[/] {src.path} → {out}", soft_wrap=True, highlight=False)
    t = Table(show_header=False, box=box.SIMPLE, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    t.add_row("source", f"{src.model_type}, {src.n_layers} layers, hidden {src.hidden}, d_ff {src.d_ff}")
    t.add_row("attention", f"{src.heads} heads, {src.kv_heads} kv heads")
    t.add_row("output format", f"{plan.fmt} ({str(plan.out_dtype).removeprefix('torch.')})")
    t.add_row("experts", f"{cfg.experts} routed, top-{cfg.top_k}" + (f", shared width {plan.shared_width}" if cfg.shared else ""))
    if cfg.layout is not None and cfg.layout.resolved:
        t.add_row("preset layout", f"{cfg.layout.spec()}; resolved: {cfg.layout.resolved}")
    width = f"{plan.expert_width} neurons (d_ff / {cfg.experts + cfg.shared})"
    if plan.padded_width != plan.expert_width:
        width += f", zero-padded to {plan.padded_width}"
    t.add_row("expert width", width)
    t.add_row("partition / router", f"{cfg.method} / {cfg.router}")
    if cfg.needs_calibration:
        tokens = f"{cfg.calib_tokens:,} tokens" if cfg.calib_tokens else f"all tokens, up to {CALIB_TOKENS_CAP:,}"
        seq_len = min(cfg.calib_seq_len, int(src.raw.get("max_position_embeddings") or cfg.calib_seq_len))
        from ..formats.config import BUNDLED_CALIB, BUNDLED_PROSE

        text = ("the bundled sample (--calib TEXT: your own; --weight-only: none)" if cfg.calib == (str(BUNDLED_CALIB),)
                else f"{len(cfg.calib)} file(s)")
        t.add_row("calibration", f"{tokens} of {text}, windows of {seq_len}; feed: {cfg.calib_feed}")
        if cfg.fit_epochs:
            t.add_row("layer tuning", f"{cfg.fit_epochs} epoch(s), step {cfg.fit_lr:g} × weight RMS")
        if cfg.tune_tokens and cfg.top_k < cfg.experts:
            what = ("experts" + (" + routers" if cfg.tune_router else "")
                    + (" + attention and norms" if cfg.tune_attention else ""))
            more = (" + the bundled prose" if cfg.tune_text == (str(BUNDLED_PROSE),)
                    else f" + {len(cfg.tune_text)} --tune-text file(s)" if cfg.tune_text else "")
            t.add_row("tuning", f"distil {what} to the dense model on {cfg.tune_tokens:,} tokens "
                      f"({cfg.tune_generated:.0%} self-generated{more}); --tune-tokens 0: off")
            mem, dev, have = plan.tuning_memory()
            fits = "" if have is None else (f" of {have / 1e9:.1f} GB" + ("" if mem.peak <= have else
                                                                          ": does NOT fit; use a larger device"))
            off = (f" + {mem.host_total / 1e9:.1f} GB host" + (" (offloaded)" if mem.host else "")
                   if mem.host_total else "")
            t.add_row("tuning memory", f"{mem.peak / 1e9:.1f} GB predicted on {dev}{off}{fits} (`moeify tune "
                      "--dry-run` measures it)")
        elif cfg.top_k < cfg.experts:
            t.add_row("tuning", "none: training-free (--tune-tokens N distils it to the dense model on N tokens)")
    if cfg.dense_layers:
        t.add_row("dense layers", ", ".join(map(str, cfg.dense_layers)))
    t.add_row("total params", f"{human_count(b.total_params)} ({b.total_ratio:.3f}× dense)")
    t.add_row("active params / token", f"{human_count(b.active_params)} ({b.active_ratio:.3f}× dense)")
    share = active_neuron_share(d_ff=src.d_ff, n_layers=src.n_layers, top_k=cfg.top_k, expert_width=plan.expert_width,
                                shared_width=plan.shared_width, dense_layers=len(cfg.dense_layers) or cfg.dense_auto)
    t.add_row("FFN active / token", active_share_text(share, plan.expert_width, plan.padded_width, b.flops_ratio))
    t.add_row("FFN FLOPs / token", f"{b.flops_ratio:.3f}× dense")
    t.add_row("output size", f"{human_bytes(plan.output_bytes)} in {len(plan.layout.files)} shard(s)")
    for rule, tp in serving_fit(plan.padded_width):
        t.add_row(rule.name, _fit_text(plan.padded_width, rule, tp))
    console.print(t)
    _print_serving_advice(console, src.d_ff, cfg.experts, cfg.shared, plan.padded_width)
    print_engine_notes(console, plan.engine_notes, cfg.targets)


def print_engine_notes(console: Console, notes, targets=()) -> None:
    """One line per engine that will not run the layout, or will run it slowly, with the fix."""
    for n in notes:
        style = "bold red" if n.fails and n.engine in targets else "yellow" if n.fails else "dim"
        console.print(f"[{style}]{escape(n.line())}[/]", soft_wrap=True, highlight=False)


def _fit_text(width: int, rule, tp: int) -> str:
    """One serving rule's verdict on a stored expert width, e.g. 'yes, TP ≤ 2 (width / TP a multiple of 128)'."""
    if not tp:
        return f"no: {width} is not a multiple of {rule.multiple}"
    if not rule.per_gpu:
        return f"yes ({width} = {width // rule.multiple} × {rule.multiple})"
    return f"yes, TP ≤ {tp} (width / TP a multiple of {rule.multiple})"


def _print_serving_advice(console: Console, d_ff: int, experts: int, shared: int, width: int) -> None:
    advice = serving_advice(d_ff, experts, shared, width)
    if advice:
        console.print("[dim]to make the expert width fit the formats marked no:[/]", soft_wrap=True)
        for line in advice:
            console.print(f"[dim]  {line}[/]", soft_wrap=True, highlight=False)


def print_alternatives(console: Console, alternatives: list[dict]) -> None:
    """The layout the preset gives for each serving format (--serve): one table, read before converting."""
    from ..formats.layout import SERVE_QUANTA

    rows = [[a["serve"], f"{a['experts'] + a['shared']} × {a['width']}",
             (f"{a['shared']} + " if a["shared"] else "") + f"top-{a['top_k']} of {a['experts']}", f"{a['active']:.1%}",
             SERVE_QUANTA[a["serve"]][1]] for a in alternatives]
    console.print(table("the preset's layout by serving format (--serve)",
                        ["--serve", "slices\n× width", "shared +\nrouted", "active", "for"], rows))
    print_measured_tradeoff(console, measured_tradeoff(alternatives[0]["preset_active"]) if alternatives else [])


def print_measured_tradeoff(console: Console, measured: list[dict]) -> None:
    """Other layouts against the preset's own (the --serve ones and those measured for comparison), as measured on
    real models: quality, decode speed and GGUF size."""
    if not measured:
        return
    pct = (lambda r: "–" if r is None else f"{r[0] * 100:+.0f}…{r[1] * 100:+.0f}%")

    def llamacpp(d: dict) -> str:
        if d["llama.cpp"] is None:
            return "–"
        return f"{fmt(d['llama.cpp'])} {d['llama.cpp type']}" + (f"\nsize {d['file']:.2f}" if d.get("file") else "")

    rows = [["\n".join([m["model"], f"d_ff {m['d_ff']:,}", *(f"--serve {f}" for f in m["serve"])]),
             f"{m['slices']} × {m['width']}\nvs {m['base']['slices']} × {m['base']['width']}",
             pct(m["trainingfree"]), pct(m["tuned"]), llamacpp(m["decode"]),
             fmt(m["decode"]["transformers"])] for m in measured]
    console.print(table("measured on real models: other layouts against the preset's own",
                        ["model", "layout", "quality\nuntuned", "quality\ntuned", "decode\nllama.cpp",
                         "decode\ntransf."], rows, left=(0,)))
    console.print("quality: the change in perplexity ratio − 1 on four held-out texts, least…most (negative: nearer "
                  "dense); decode: tokens/s × the preset's layout's, 1 CPU thread (size: its GGUF's); a row without "
                  "--serve was measured for comparison; BENCHMARKS.md \"Granularity and shared experts\"", style="dim")


def print_moe_plan(console: Console, plan, processes: int = 8, gpu_gb: float = 80) -> None:
    """`moeify plan`: total / active parameters and FFN FLOPs of each regime, with ratios to the dense model; what
    training the upcycles takes per GPU on `processes` GPUs, and how many GPUs of gpu_gb GB."""
    s = plan.src
    title = (f"moeify plan: {plan.experts} experts, top-{plan.top_k}" + (f", shared {plan.shared}" if plan.shared else "")
             + f" from {s.path} ({s.model_type}, {s.n_layers} layers, hidden {s.hidden}, d_ff {s.d_ff})")
    rows = [["dense", str(s.d_ff), human_count(plan.dense_params), "1.000", human_count(plan.dense_params), "1.000",
             human_count(plan.dense_ffn_flops), "1.000"]]
    for r in plan.regimes:
        b = r.budget
        rows.append([f"{r.name}\n {r.layout}", f"{r.expert_width}" + ("" if r.exact else "*"),
                     human_count(b.total_params), f"{b.total_ratio:.3f}", human_count(b.active_params),
                     f"{b.active_ratio:.3f}", human_count(b.ffn_flops), f"{b.flops_ratio:.3f}"])
    t = table(title, ["regime", "expert\nwidth", "total\nparams", "×\ndense", "active\nparams\n/ token", "×\ndense",
                      "FFN\nFLOPs\n/ token", "×\ndense"], rows)
    t.rows[0].style = "dim"
    console.print(t)
    if plan.layout is not None and plan.layout.resolved:
        console.print(f"[bold]preset layout:[/] {escape(plan.layout.spec())}\n[bold]resolved:[/] "
                      f"{escape(plan.layout.resolved)}", highlight=False)
    c = plan.carved_share()
    console.print(f"[bold]convert carves:[/] FFN active per token: "
                  f"{active_share_text(c['active_share'], c['expert_width'], c['stored_width'], c['stored_flops_ratio'])}",
                  highlight=False)
    if plan.alternatives:
        print_alternatives(console, plan.alternatives)
    notes = ["max capacity and constant compute: what `moeify upcycle` builds (E copies of the FFN in G slices); "
             "expert width: neurons per routed expert (inference saving d_ff/(N+S), the split `convert` carves)"]
    if plan.shared:
        notes.append(f"plus a shared expert {plan.shared}× that width")
    if not all(r.exact for r in plan.regimes):
        notes.append("* rounded down: d_ff is not divisible")
    notes.append(f"non-FFN parameters (embeddings, attention, norms): {human_count(plan.other_params)}; "
                 "FFN FLOPs = 2 × multiply-adds of active expert and router weights")
    console.print("[dim]" + "; ".join(notes) + "[/]")
    widths = sorted({padded_width(r.expert_width) for r in plan.regimes})
    rows = [[str(w)] + [_fit_short(rule, tp) for rule, tp in serving_fit(w)] for w in widths]
    console.print(table("quantized serving by stored expert width (zero-padded to ×8)",
                        ["stored width"] + [rule.name for rule in SERVING_RULES], rows))
    console.print("[dim]yes: the width is a multiple of the block size (llama.cpp 256; vLLM 128 per GPU, up to the "
                  "TP shown); no: llama.cpp falls back to another quant type, vLLM refuses or uses a slower path[/]")
    print_engine_notes(console, plan.engine_notes())
    from ..maths.memory import memory_table

    mem = memory_table(s, plan.experts)
    console.print(table("recovery tuning: predicted peak memory per process (moeify/maths/memory.py)",
                        ["where"] + [("CPU\nfloat32" if r["device"] == "cpu" else
                                      f"{r['processes']} GPU{'s' if r['processes'] > 1 else ''}"
                                      + ("\noffload" if r.get("offload") else "")) for r in mem],
                        [["peak"] + [human_bytes(r["peak"]) for r in mem],
                         ["+ host"] + [human_bytes(r["host"]) if r.get("host") else "" for r in mem]]))
    console.print("[dim]GPUs: bf16 autocast; across GPUs (torchrun) FSDP2 shards the teacher's layers and the "
                  "student's state; offload (--offload): the student's state in host memory; + host: the machine's "
                  "host memory for it and for the saved state[/]")
    print_training_memory(console, plan.training_memory(processes, gpu_gb * 1e9), processes, gpu_gb)
    carve = next(r for r in plan.regimes if r.name == "inference saving")
    _print_serving_advice(console, s.d_ff, plan.experts, plan.shared, padded_width(carve.expert_width))


def print_training_memory(console: Console, rows: list[dict], processes: int, gpu_gb: float) -> None:
    """The upcycles' next-token training per GPU (moeify.evaluation.planning.upcycle_training's rows)."""
    if not rows:
        return

    def needed(n) -> str:
        return "–" if n is None else str(n)

    cells = [[f"{r['regime']}\n {r['layout']}", human_count(r["total_params"]), human_bytes(r["peak"]),
              f"{human_bytes(r['offload_peak'])}\n+{human_bytes(r['offload_host'])} host",
              needed(r["gpus_needed"]["plain"]), needed(r["gpus_needed"]["offload"])] for r in rows]
    console.print(table(f"training an upcycle (moeify tune OUT --tune-text): peak per process on {processes} GPUs",
                        ["upcycle", "total\nparams", f"{processes} GPUs", f"{processes} GPUs\noffload",
                         f"{gpu_gb:g} GB\nGPUs\nneeded", "with\noffload"], cells))
    console.print(f"[dim]bf16, FSDP2 (each decoder layer a group), 4,096 tokens a step split across the GPUs; "
                  f"offload: weights, gradients and AdamW state in host memory ({HOST_PER_GPU / 1e9:.0f} GB a GPU at "
                  "most); –: no count up to 512 fits (a layer's activations and its gathered weights exceed the GPU); "
                  "moeify/maths/memory.py's train_memory[/]")


def _fit_short(rule, tp: int) -> str:
    return "no" if not tp else "yes" if not rule.per_gpu else f"TP ≤ {tp}"
