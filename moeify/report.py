"""Rich rendering of plans and results. Only cli.py and report.py print."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


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


def print_plan(console: Console, plan, out: Path) -> None:
    cfg, src, b = plan.cfg, plan.src, plan.budget
    t = Table(title=f"moeify plan: {src.path} → {out}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("source", f"{src.model_type}, {src.n_layers} layers, hidden {src.hidden}, d_ff {src.d_ff}, "
                        f"{src.heads} heads / {src.kv_heads} kv heads")
    t.add_row("output format", f"{plan.fmt} ({str(plan.out_dtype).removeprefix('torch.')})")
    t.add_row("experts", f"{cfg.experts} routed, top-{cfg.top_k}" + (f", shared width {plan.shared_width}" if cfg.shared else ""))
    t.add_row("expert width", f"{plan.expert_width} neurons (d_ff / {cfg.experts + cfg.shared})")
    t.add_row("partition / router", f"{cfg.method} / {cfg.router}")
    if cfg.dense_layers:
        t.add_row("dense layers", ", ".join(map(str, cfg.dense_layers)))
    t.add_row("total parameters", f"{human_count(b.total_params)} ({b.total_ratio:.3f}× dense)")
    t.add_row("active parameters / token", f"{human_count(b.active_params)} ({b.active_ratio:.3f}× dense)")
    t.add_row("FFN FLOPs / token", f"{b.flops_ratio:.3f}× dense")
    t.add_row("output size", f"{human_bytes(plan.output_bytes)} in {len(plan.layout.files)} shard(s)")
    console.print(t)


def print_result(console: Console, report: dict, out: Path) -> None:
    console.print(f"[bold green]wrote[/] {out} in {report['seconds']:.1f}s "
                  f"({report['format']}, {len(report['layers'])} layers)")
