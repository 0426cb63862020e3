"""Rich rendering of `moeify eval`'s results: perplexity and routing per model, the routing of each layer, and with
`--tasks` the zero-shot tasks, retention and generation health. Only moeify/cli/ prints."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .tables import human_count, table


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
    console.print(table("", ["model", "PPL", "× ref", "params", "active", "tok/s", "MoE", "CV", "<1%", "oracle"],
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
        console.print(table(f"zero-shot tasks (lm-eval {t['lm_eval']}{limit}): the same items for every model",
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
        console.print(table(f"generation health: {g['prompts']} prompts of {g['prompt_tokens']} tokens, "
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
    return table(f"routing of {label}: {m.n_experts} experts, top-{m.top_k}", [ROUTING_COLUMNS[0], head,
                 *ROUTING_COLUMNS[1:]], rows, left=(0, 1))
