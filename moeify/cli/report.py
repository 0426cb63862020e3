"""Rich rendering of results: a conversion's, a tuning run's (and `tune --dry-run`'s estimate), an upcycle's training,
`moeify inspect`'s. Plans are moeify.cli.report_plan's, `moeify eval`'s results moeify.cli.report_eval's. Only
moeify/cli/ prints."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..formats.config import CALIB_TOKENS_CAP
from .report_eval import print_eval, print_retention  # noqa: F401  (re-exported: tests import them from here)
from .report_plan import print_moe_plan, print_plan  # noqa: F401  (re-exported: tests import them from here)
from .tables import fmt, table


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
    from ..formats.card import kept_as_carved

    if kept_as_carved(run):
        later = min(k for s, k in run["holdout_curve"] if s > 0)
        console.print(f"[yellow]warning:[/] no held-out check beat the weights this run started from (KL "
                      f"{run['holdout_kl_before']:.3f}, the best later {later:.3f}), so they were kept: "
                      f"{escape(str(out))} is unchanged by this run. A carve this near its dense model may need a "
                      "smaller step (--lr) or none (--no-tune).", soft_wrap=True, highlight=False)
    if len(runs) > 1:
        console.print(f"in all: {history['tokens']:,} tuning tokens over {len(runs)} runs, "
                      f"{_duration(history['seconds'])}", soft_wrap=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, m = seconds // 3600, seconds % 3600 // 60
    return f"{h} h {m:02d} min" if h else f"{m} min {seconds % 60:02d} s"


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


def print_inspect(console: Console, result: dict) -> None:
    """`moeify inspect`: per analysed MoE layer, weight similarities and router R², then the data analyses."""
    dense = result.get("dense") is not None
    cols = ["layer", "S up", "S gate", "S down", "S̄ gate"] + (["S̄ gate·F"] if dense else []) + ["R² gate", "R² up", "R² down"]
    rows = []
    for e in result["layers"]:
        m, n = e["mean_expert_similarity"]["matrix"], e["mean_expert_similarity"]["neuron"]
        fit = e["router_fit"]
        row = [str(e["layer"]), fmt(m["up"]), fmt(m["gate"]), fmt(m["down"]), fmt(n["gate"])]
        if dense:
            row.append(fmt(e["mean_dense_similarity"]["neuron"]["gate"]))
        rows.append(row + [fmt(fit[k]["r2"] if fit[k] else None) for k in ("gate", "up", "down")])
    console.print(table(f"moeify inspect: {result['checkpoint']} ({result['format']}, {result['n_experts']} experts, "
                        f"top-{result['top_k']})", cols, rows))
    console.print("[dim]S: mean cosine between distinct experts' flattened matrices; S̄: of their neuron-averaged vectors"
                  + ("; ·F: experts vs the dense FFN" if dense else "")
                  + "; R²: router-row similarities regressed on the S̄ matrices over expert pairs[/]")
    r2 = result["router_r2_avg"]
    console.print(f"R²_avg: gate {fmt(r2['gate'])}, up {fmt(r2['up'])}, down {fmt(r2['down'])}  "
                  "[dim](paper, Mixtral 8x7B: gate 0.33, up 0.06, down 0.07)[/]")
    data = result.get("data")
    if data:
        rows = []
        for d in data["layers"]:
            share = d["selection_share"]
            busiest = max(range(len(share)), key=share.__getitem__)
            rows.append([str(d["layer"]), fmt(d["top1_norm_is_top1_score"], ".1%"), fmt(d["topk_norm_overlap"], ".1%"),
                         fmt(d["active_share_mean"], ".1%"), f"{busiest} ({share[busiest]:.0%})"])
        console.print(table(f"on {data['n_tokens']} tokens of {data['file']}",
                            ["layer", "top-1 norm = top-1 score", "top-k overlap",
                             f"|act| > {data['active_threshold']:g}", "busiest expert (share of tokens)"], rows))
        console.print("[dim]top-k overlap: share of the k experts with the largest outputs that the router selected[/]")
    if result.get("plots_skipped"):
        console.print(f"[yellow]no PNGs:[/] {result['plots_skipped']}")
    console.print(f"[bold green]wrote[/] {result['json']}" + (f" and {len(result['plots'])} PNG(s)" if result["plots"] else ""))
