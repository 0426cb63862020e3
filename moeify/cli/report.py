"""Rich rendering of plans and results. Only moeify/cli/ prints."""

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


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


# ------------------------------------------------------------------------------------------------- eval

_BARS = " ▁▂▃▄▅▆▇█"


def _load_bars(load: list[float]) -> str:
    """One character per expert, height ∝ its share of tokens (relative to the busiest expert)."""
    top = max(load) or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, round(f / top * (len(_BARS) - 1)))] for f in load)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def model_labels(n: int) -> list[str]:
    """Short row labels for the eval tables (A, B, C, ...; M27, M28, ... past Z): paths go in a legend."""
    return [chr(ord("A") + i) if i < 26 else f"M{i + 1}" for i in range(n)]


ROUTING_COLUMNS = ("layer", "min–max f", "aux", "load CV", "<1%", "oracle top-k")  # plus the load bars


def print_eval(console: Console, result) -> None:
    """`moeify eval`: one row per model (perplexity, ×reference, parameters, tokens/s, routing summary) under a
    short label, a legend with the full paths, then a per-layer routing table for each MoE model. Every row fits
    on one line of an 80-column terminal."""
    d, s = result.data, result.settings
    console.print(f"[bold]moeify eval:[/] {d['tokens']:,} tokens of {d['source']}; {d['windows']} windows of "
                  f"{s['seq_len']}, stride {s['stride']}; {s['device']} {s['dtype']}", highlight=False)
    labels = model_labels(len(result.models))
    rows = []
    for i, (label, m) in enumerate(zip(labels, result.models)):
        routing = ["–", "", "", ""]
        if m.routing:
            oracle = _mean([r.oracle_agreement for r in m.routing])
            routing = [f"E{m.n_experts} k{m.top_k} ×{len(m.routing)}", f"{_mean([r.load_cv for r in m.routing]):.2f}",
                       f"{sum(r.collapsed for r in m.routing)}/{m.n_experts * len(m.routing)}",
                       "–" if oracle is None else f"{oracle:.0%}"]
        rows.append([label, f"{m.perplexity:.3f}", "ref" if i == 0 else f"{m.ratio:.4f}", human_count(m.total_params),
                     human_count(m.active_params), _rate(m.tokens_per_s), *routing])
    console.print(_table("", ["model", "PPL", "× ref", "params", "active", "tok/s", "MoE", "CV", "<1%", "oracle"],
                         rows, left=(0, 6)))
    for label, m in zip(labels, result.models):
        kl = f", KL to {labels[0]} {m.kl:.4f}" if m.kl is not None else ""
        console.print(f"  {label}  {m.path} ({m.model_type}{', reference' if m is result.models[0] else ''}{kl})",
                      soft_wrap=True, highlight=False)
    for label, m in zip(labels, result.models):
        if m.routing:
            console.print(_routing_table(console, label, m))
    if any(m.routing for m in result.models):
        console.print("[dim]MoE: experts E, top-k, ×MoE layers. f: share of tokens routed to an expert (sums to k); "
                      "aux: N·Σ f·P (P: mean router probability; k when f or P is even); CV, load CV: std/mean of "
                      "expert loads (main table: mean over layers); <1%: experts with f < 0.01; oracle: tokens whose top-k equals the "
                      "top-k by true expert output norm. tok/s: window tokens per second of forward (routing "
                      "statistics excluded). active: parameters used per token. KL: mean KL(reference || model) of the "
                      "next-token distributions over the scored tokens (what tuning minimises).[/]")
    print_tasks(console, result, labels)


def _signed(x: float | None, spec: str = "+.4f") -> str:
    return "ref" if x is None else format(x, spec)


def print_tasks(console: Console, result, labels: list[str]) -> None:
    """`eval --tasks`: every task's metrics per model (value ± SE, difference to the first model ± paired SE), then
    the repeated n-grams of greedy continuations; rows that fit 80 columns."""
    t = result.tasks
    if t:
        rows = []
        for name, task in t["tasks"].items():
            of = f" of {task['of']:,}" if task.get("of") and task["of"] != task["n"] else ""
            first = [name, f"{task['n']:,}{of} items"]  # the task's name, then its item count, down its first rows
            for metric, entries in task["metrics"].items():
                ppl = metric == "perplexity"
                for label, e in zip(labels, entries):
                    diff = ("ref" if e["diff"] is None else f"×{e['diff']:.3f}" if ppl else _signed(e["diff"]))
                    rows.append([first.pop(0) if first else "", ("ppl" if ppl else metric), label,
                                 f"{e['value']:.4g}" if ppl else f"{e['value']:.4f}",
                                 f"{e['se']:.4g}" if ppl else f"{e['se']:.4f}", diff,
                                 "" if e["diff_se"] is None else f"{e['diff_se']:.4f}"])
        limit = f", --limit {t['limit']:,}" if t.get("limit") else ""
        console.print(_table(f"zero-shot tasks (lm-eval {t['lm_eval']}{limit}): the same items for every model",
                             ["task", "metric", "model", "value", "± SE", f"Δ {labels[0]}", "± paired"],
                             rows, left=(0, 1, 2)))
        console.print(f"[dim]Δ {labels[0]}: the difference to {labels[0]} (ppl: the ratio) and its paired SE (sd of "
                      "the per-item differences / √n). acc_norm: choices scored per character of their text; ppl: "
                      "LAMBADA's perplexity of the last word, acc: its greedy prediction.[/]", highlight=False)
        print_retention(console, t.get("retention"), labels)
    gen = [m.generation for m in result.models]
    if all(gen):
        g = result.settings["generation"]
        rows = [[label, f"{x['repeated']:.3f}", f"{x['se']:.3f}", _signed(x["diff"], "+.3f"),
                 "" if x["diff_se"] is None else f"{x['diff_se']:.3f}"] for label, x in zip(labels, gen)]
        console.print(_table(f"generation health: {g['prompts']} prompts of {g['prompt_tokens']} tokens, "
                             f"{g['new_tokens']} greedy new tokens each",
                             ["model", f"repeated {g['ngram']}-grams", "± SE", f"Δ {labels[0]}", "± paired"], rows))
        console.print(f"[dim]repeated {g['ngram']}-grams: share of a continuation's {g['ngram']}-grams that repeat "
                      "an earlier one (0: none; a degenerate model loops).[/]", highlight=False)


def print_retention(console: Console, r: dict | None, labels: list[str]) -> None:
    """One line a model: the share of the first model's accuracy it keeps, pooled over the informative tasks."""
    if not r:
        return
    left = [n for n, t in r["tasks"].items() if not t["informative"]]
    for label, m in zip(labels[1:], r["models"]):
        if "retention" not in m:
            console.print(f"retention: no task where {labels[0]} is clear of chance", highlight=False)
            continue
        vs = f"; {m['vs_first']:+.1%} ± {m['vs_first_se']:.1%} against {labels[1]}" if "vs_first" in m else ""
        console.print(f"[bold]{label}[/] keeps {m['retention']:.1%} ± {m['retention_se']:.1%} of {labels[0]}'s "
                      f"accuracy (its margin above chance: {m['margin_kept']:.1%} ± {m['margin_kept_se']:.1%}){vs}",
                      highlight=False)
    read = ", ".join(f"{n} {t['metric']}" for n, t in r["tasks"].items() if t["informative"])
    console.print(f"[dim]retention: mean over the tasks where {labels[0]} is {r['informative_ses']} SEs above "
                  f"chance ({read}) of accuracy / {labels[0]}'s; ± the paired SE"
                  + (f"; left out as no better than chance: {', '.join(left)}" if left else "") + ".[/]",
                  highlight=False)


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s < 100_000 else human_count(tokens_per_s)


def _routing_table(console: Console, label: str, m) -> Table:
    """Per-layer routing of one MoE model. The load bars get one character per expert, or per group of experts
    (the group's busiest) when there are more experts than the terminal has room for."""
    rows = [[str(r.layer), f"{min(r.load):.3f}–{max(r.load):.3f}", f"{r.aux_loss:.3f}", f"{r.load_cv:.2f}",
             str(r.collapsed), "–" if r.oracle_agreement is None else f"{r.oracle_agreement:.1%}"] for r in m.routing]
    others = sum(max(len(c), *(len(r[i]) for r in rows)) + 1 for i, c in enumerate(ROUTING_COLUMNS))
    room = max(8, console.width - others - 1)
    group = -(-m.n_experts // room)
    for row, r in zip(rows, m.routing):
        load = [max(r.load[e:e + group]) for e in range(0, len(r.load), group)]
        row.insert(1, _load_bars(load))
    head = "load per expert" if group == 1 else f"load ({group} experts/char)"
    return _table(f"routing of {label}: {m.n_experts} experts, top-{m.top_k}", [ROUTING_COLUMNS[0], head,
                  *ROUTING_COLUMNS[1:]], rows, left=(0, 1))


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
        from ..formats.config import BUNDLED_CALIB

        text = ("the bundled sample (--calib TEXT: your own; --weight-only: none)" if cfg.calib == (str(BUNDLED_CALIB),)
                else f"{len(cfg.calib)} file(s)")
        t.add_row("calibration", f"{tokens} of {text}, windows of {seq_len}; feed: {cfg.calib_feed}")
        if cfg.fit_epochs:
            t.add_row("layer tuning", f"{cfg.fit_epochs} epoch(s), step {cfg.fit_lr:g} × weight RMS")
        if cfg.tune_tokens and cfg.top_k < cfg.experts:
            what = ("experts" + (" + routers" if cfg.tune_router else "")
                    + (" + attention and norms" if cfg.tune_attention else ""))
            t.add_row("tuning", f"distil {what} to the dense model on {cfg.tune_tokens:,} tokens "
                      f"({cfg.tune_generated:.0%} self-generated); --tune-tokens 0: off")
            mem, dev, have = plan.tuning_memory()
            fits = "" if have is None else (f" of {have / 1e9:.1f} GB" + ("" if mem.peak <= have else
                                                                          ": does NOT fit; use a larger device"))
            off = (f" + {mem.host_total / 1e9:.1f} GB host" + (" (offloaded)" if mem.host else "")
                   if mem.host_total else "")
            t.add_row("tuning memory", f"{mem.peak / 1e9:.1f} GB predicted on {dev}{off}{fits} (`moeify tune "
                      "--dry-run` measures it)")
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


def calibration_summary(calib: dict) -> str:
    """How many calibration tokens were used, out of how many the text has."""
    asked = calib.get("requested_tokens")
    how = f"--calib-tokens {asked:,}" if asked else f"default: all, up to {CALIB_TOKENS_CAP:,}"
    return (f"calibrated on {calib['tokens']:,} of the text's {calib['text_tokens']:,} tokens "
            f"({calib['windows']} windows of {calib['seq_len']}; {how})")


def print_result(console: Console, report: dict, out: Path) -> None:
    console.print(f"[bold green]wrote[/] {out} in {report['seconds']:.1f}s "
                  f"({report['format']}, {len(report['layers'])} layers)", soft_wrap=True)
    if report.get("calibration"):
        console.print(calibration_summary(report["calibration"]), soft_wrap=True)
    if report.get("tuning"):
        print_tuning(console, report, header=False)


def print_tuning(console: Console, report: dict, header: bool = True, estimate: bool = False,
                 out: Path | None = None) -> None:
    """`moeify tune` (and convert's tuning): the run just finished and the output's whole tuning history; with
    estimate, `tune --dry-run`'s measured step and predicted time."""
    if estimate:
        e = report
        t = Table(title=f"moeify tune --dry-run: {e['tokens']:,} tokens on {e['device']}", title_justify="left",
                  show_header=False)
        t.add_column("")
        t.add_column("", justify="right")
        t.add_row("tuning step", f"{e['step_seconds']:.2f} s per {e['step_tokens']:,} tokens "
                  f"({e['tokens_per_second']:,.0f} tok/s)")
        if e.get("micro_windows"):
            t.add_row("step layout", f"{e['micro_windows']:,} window(s) a forward; teacher "
                      + ("in the loop" if e.get("teacher") == "inline" else "pass before the loop"))
        t.add_row("sampling", f"{e['sampled_tokens']:,} tokens, {e['sampling_seconds_per_1k']:.2f} s per 1,024"
                  + (f", {e['sample_batch']:,} windows at once" if e.get("sample_batch") else ""))
        t.add_row("estimated time", f"{_duration(e['estimated_seconds'])} (sampling "
                  f"{_duration(e['sampling_seconds'])}, teacher pass {_duration(e.get('teacher_pass_seconds', 0))})")
        for n, sec in (e.get("seconds_for_tokens") or {}).items():
            t.add_row(f"{int(n) / 2**20:g}M tokens", f"{_duration(sec)} at these rates")
        p = e["predicted"]
        t.add_row("peak memory", f"{e['peak_bytes'] / 1e9:.2f} GB measured, {p['peak'] / 1e9:.2f} GB predicted"
                  + (f" (offloaded: + {p['host_total'] / 1e9:.1f} GB host)" if e.get("offload") else ""))
        if e.get("device_bytes"):
            t.add_row("device memory", f"{e['device_bytes'] / 1e9:.1f} GB" + ("" if p["peak"] <= e["device_bytes"]
                                                                             else ": the run does NOT fit"))
        console.print(t)
        return
    history = report.get("tuning", {})
    runs = history.get("runs", [])
    if not runs:
        return
    run = runs[-1]
    if header:
        console.print(f"[bold green]wrote[/] {escape(str(out))} (tuned towards {escape(str(report.get('source', '')))})",
                      soft_wrap=True, highlight=False)
    console.print(f"tuned on {run['tokens']:,} tokens ({run['steps']} steps, {run['passes']:.2f} passes over "
                  f"{run['train_windows']} windows) in {run['seconds']:.0f}s ({run['seconds_per_1k_tokens']:.2f} s per "
                  f"1,024 tokens): held-out KL to dense {run['holdout_kl_before']:.3f} → {run['holdout_kl_after']:.3f} "
                  f"(training {run['train_kl_end']:.3f})"
                  + (f"; steps of {run['batch_tokens']:,} tokens, step sizes x {run['lr_scale']:g}"
                     if run.get("lr_scale", 1) != 1 else ""), soft_wrap=True)
    if len(runs) > 1:
        console.print(f"in all: {history['tokens']:,} tuning tokens over {len(runs)} runs, "
                      f"{_duration(history['seconds'])}", soft_wrap=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, m = seconds // 3600, seconds % 3600 // 60
    return f"{h} h {m:02d} min" if h else f"{m} min {seconds % 60:02d} s"


# ------------------------------------------------------------------------------------------- plan / inspect


def print_training(console: Console, report: dict, out: Path) -> None:
    """`moeify tune OUT` on an upcycled or merged output: the run just finished (held-out loss and expert load
    before and after) and the output's training so far."""
    from ..tuning.lm_options import STARVED

    t = report["training"]
    run = t["runs"][-1]
    b, a = run["held_out_before"], run["held_out_after"]
    tab = Table(title=f"trained {out.name}: {run['tokens']:,} tokens, {', '.join(run['trained'])}", title_justify="left")
    for col, just in (("held-out", "left"), ("before", "right"), ("after", "right")):
        tab.add_column(col, justify=just)
    tab.add_row("perplexity", f"{b['perplexity']:.3f}", f"{a['perplexity']:.3f}")
    tab.add_row("balance loss (k = uniform)", f"{b['balance']:.3f}", f"{a['balance']:.3f}")
    tab.add_row("busiest expert / uniform", f"{b['max_load']:.2f}x (layer {b['max_load_layer']})",
                f"{a['max_load']:.2f}x (layer {a['max_load_layer']})")
    tab.add_row(f"starved experts (< {STARVED:g} x uniform)", f"{b['starved']}", f"{a['starved']}")
    console.print(tab)
    rate = run["tokens"] / max(run["seconds"], 1e-9)
    console.print(f"{run['steps']:,} step(s) of {run['step_tokens']:,} tokens in {_duration(run['seconds'])} "
                  f"({rate:,.0f} tok/s, {run['device']}), load-balancing α {run['aux_loss_coef']:g}", highlight=False)
    console.print(f"{out.name} has trained on {t['tokens']:,} tokens in {len(t['runs'])} run(s)", highlight=False)


def print_alternatives(console: Console, alternatives: list[dict]) -> None:
    """The layout the preset gives for each serving format (--serve): one table, read before converting."""
    from ..formats.layout import SERVE_QUANTA

    rows = [[a["serve"], f"{a['experts'] + a['shared']} × {a['width']}",
             (f"{a['shared']} + " if a["shared"] else "") + f"top-{a['top_k']} of {a['experts']}", f"{a['active']:.1%}",
             SERVE_QUANTA[a["serve"]][1]] for a in alternatives]
    console.print(_table("the preset's layout by serving format (--serve)",
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
        return f"{_fmt(d['llama.cpp'])} {d['llama.cpp type']}" + (f"\nsize {d['file']:.2f}" if d.get("file") else "")

    rows = [["\n".join([m["model"], f"d_ff {m['d_ff']:,}", *(f"--serve {f}" for f in m["serve"])]),
             f"{m['slices']} × {m['width']}\nvs {m['base']['slices']} × {m['base']['width']}",
             pct(m["trainingfree"]), pct(m["tuned"]), llamacpp(m["decode"]),
             _fmt(m["decode"]["transformers"])] for m in measured]
    console.print(_table("measured on real models: other layouts against the preset's own",
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
    t = _table(title, ["regime", "expert\nwidth", "total\nparams", "×\ndense", "active\nparams\n/ token", "×\ndense",
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
    console.print(_table("quantized serving by stored expert width (zero-padded to ×8)",
                         ["stored width"] + [rule.name for rule in SERVING_RULES], rows))
    console.print("[dim]yes: the width is a multiple of the block size (llama.cpp 256; vLLM 128 per GPU, up to the "
                  "TP shown); no: llama.cpp falls back to another quant type, vLLM refuses or uses a slower path[/]")
    print_engine_notes(console, plan.engine_notes())
    from ..maths.memory import memory_table

    mem = memory_table(s, plan.experts)
    console.print(_table("recovery tuning: predicted peak memory per process (moeify/maths/memory.py)",
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

    table = [[f"{r['regime']}\n {r['layout']}", human_count(r["total_params"]), human_bytes(r["peak"]),
              f"{human_bytes(r['offload_peak'])}\n+{human_bytes(r['offload_host'])} host",
              needed(r["gpus_needed"]["plain"]), needed(r["gpus_needed"]["offload"])] for r in rows]
    console.print(_table(f"training an upcycle (moeify tune OUT --tune-text): peak per process on {processes} GPUs",
                         ["upcycle", "total\nparams", f"{processes} GPUs", f"{processes} GPUs\noffload",
                          f"{gpu_gb:g} GB\nGPUs\nneeded", "with\noffload"], table))
    console.print(f"[dim]bf16, FSDP2 (each decoder layer a group), 4,096 tokens a step split across the GPUs; "
                  f"offload: weights, gradients and AdamW state in host memory ({HOST_PER_GPU / 1e9:.0f} GB a GPU at "
                  "most); –: no count up to 512 fits (a layer's activations and its gathered weights exceed the GPU); "
                  "moeify/maths/memory.py's train_memory[/]")


def _fit_short(rule, tp: int) -> str:
    return "no" if not tp else "yes" if not rule.per_gpu else f"TP ≤ {tp}"


def _table(title: str, columns: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> Table:
    """A table whose cells never get cut: each column is at least as wide as its widest cell; headers
    may wrap. Columns in `left` are left-justified, the others right-justified."""
    from rich import box

    t = Table(title=title or None, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
              show_edge=False, padding=(0, 1, 0, 0))  # one space between columns: 8 columns fit 80 characters
    for c, name in enumerate(columns):
        t.add_column(name, justify="left" if c in left else "right",
                     min_width=max(len(line) for r in rows for line in r[c].split("\n")))
    for r in rows:
        t.add_row(*r)
    return t


def _fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def print_inspect(console: Console, result: dict) -> None:
    """`moeify inspect`: per analysed MoE layer, weight similarities and router R², then the data analyses."""
    dense = result.get("dense") is not None
    cols = ["layer", "S up", "S gate", "S down", "S̄ gate"] + (["S̄ gate·F"] if dense else []) + ["R² gate", "R² up", "R² down"]
    rows = []
    for e in result["layers"]:
        m, n = e["mean_expert_similarity"]["matrix"], e["mean_expert_similarity"]["neuron"]
        fit = e["router_fit"]
        row = [str(e["layer"]), _fmt(m["up"]), _fmt(m["gate"]), _fmt(m["down"]), _fmt(n["gate"])]
        if dense:
            row.append(_fmt(e["mean_dense_similarity"]["neuron"]["gate"]))
        rows.append(row + [_fmt(fit[k]["r2"] if fit[k] else None) for k in ("gate", "up", "down")])
    console.print(_table(f"moeify inspect: {result['checkpoint']} ({result['format']}, {result['n_experts']} experts, "
                         f"top-{result['top_k']})", cols, rows))
    console.print("[dim]S: mean cosine between distinct experts' flattened matrices; S̄: of their neuron-averaged vectors"
                  + ("; ·F: experts vs the dense FFN" if dense else "")
                  + "; R²: router-row similarities regressed on the S̄ matrices over expert pairs[/]")
    r2 = result["router_r2_avg"]
    console.print(f"R²_avg: gate {_fmt(r2['gate'])}, up {_fmt(r2['up'])}, down {_fmt(r2['down'])}  "
                  "[dim](paper, Mixtral 8x7B: gate 0.33, up 0.06, down 0.07)[/]")
    data = result.get("data")
    if data:
        rows = []
        for d in data["layers"]:
            share = d["selection_share"]
            busiest = max(range(len(share)), key=share.__getitem__)
            rows.append([str(d["layer"]), _fmt(d["top1_norm_is_top1_score"], ".1%"), _fmt(d["topk_norm_overlap"], ".1%"),
                         _fmt(d["active_share_mean"], ".1%"), f"{busiest} ({share[busiest]:.0%})"])
        console.print(_table(f"on {data['n_tokens']} tokens of {data['file']}",
                             ["layer", "top-1 norm = top-1 score", "top-k overlap",
                              f"|act| > {data['active_threshold']:g}", "busiest expert (share of tokens)"], rows))
        console.print("[dim]top-k overlap: share of the k experts with the largest outputs that the router selected[/]")
    if result.get("plots_skipped"):
        console.print(f"[yellow]no PNGs:[/] {result['plots_skipped']}")
    console.print(f"[bold green]wrote[/] {result['json']}" + (f" and {len(result['plots'])} PNG(s)" if result["plots"] else ""))
