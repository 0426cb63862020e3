"""moeify command line: parses flags, calls the library, renders with rich. Only moeify/cli/ prints."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import MoeifyError
from .terminal import JSON_HELP, console, out_console, progress_bars, stage_callback  # noqa: F401
from .terminal import fail as _fail, json_option as _json_option, tables as _tables, write_json as _write_json

app = typer.Typer(
    help="Carve a dense LLaMA/Mistral/Qwen2/Qwen3 checkpoint into a Mixture-of-Experts checkpoint, and measure the cost.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts say "[default: ...]"; as rich markup those brackets would vanish
)


def _version(value: bool) -> None:
    if value:
        from ..version import __version__

        typer.echo(f"moeify {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print moeify's version and exit.")) -> None:
    """Carve a dense LLaMA/Mistral/Qwen2/Qwen3 checkpoint into a Mixture-of-Experts checkpoint, and measure the cost."""


# the options convert and plan share, word for word
_EXPERTS = typer.Option(None, "--experts", "-n", help="Routed experts per layer [default: the preset's; with "
                        "--top-k/--shared but no preset, 8].")
_TOP_K = typer.Option(None, "--top-k", "-k", help="Routed experts active per token [default: the preset's; without "
                      "a preset, 2].")
_SERVE = typer.Option(None, "--serve", help="The serving format the preset's layout is resolved for: k-quants "
                      "(llama.cpp Q4_K_M: widths of 256) | fp8 (vLLM FP8 block, Marlin: 128) | q8_0 (llama.cpp "
                      "Q8_0/Q4_0: 32) | bf16 (any width) [default: the preset's own: experts of 128 where d_ff has "
                      "them, else 256, 128, 32].")


def _run_eval(models: list[Path], data: Optional[str], settings, json_dest: Optional[str] = None,
              plot: Optional[Path] = None, tables: Optional[Console] = None, **tasks) -> None:
    """Shared by `eval` and `convert --eval`: perplexity and routing of every model, one table (tasks: `eval
    --tasks`' options: also task accuracy and generation health)."""
    from ..api import evaluate
    from ..evaluation.perplexity import plot_routing, require_matplotlib
    from .report_eval import print_eval

    if plot:
        require_matplotlib()
    with progress_bars() as bar:
        result = evaluate(models, data, progress=stage_callback(bar), **tasks, **dataclasses.asdict(settings))
    print_eval(tables or _tables(json_dest), result)
    if json_dest:
        _write_json(result.to_json(), json_dest)
    if plot:
        console.print(f"[bold green]wrote[/] {plot_routing(result, plot)}")


def eval_cmd(
    models: list[Path] = typer.Argument(..., help="Model directories; the first is the reference (e.g. the dense "
                                        "source). All must share its tokenizer."),
    data: Optional[str] = typer.Option(None, "--data", help="Text to score: .txt, or .jsonl with a 'text' field "
                                       "[default: the bundled WikiText-2 validation sample]."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Window length [default: min(2048, the models' "
                                          "max_position_embeddings)]."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Step between windows; < seq-len scores only the new "
                                         "tokens of each window (sliding window) [default: seq-len]."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Use only the first N tokens of the data "
                                             "[default: all]."),
    batch_size: int = typer.Option(4, "--batch-size", help="Windows per forward."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on cuda, float32 on cpu) | bfloat16 | float16 "
                              "| float32."),
    oracle: bool = typer.Option(True, "--oracle/--no-oracle", help="Also run every expert on every token to score "
                                "the router against the top-k by true expert output norm (costs a dense FFN)."),
    kl: bool = typer.Option(True, "--kl/--no-kl", help="Also the mean KL divergence of each model's next-token "
                            "distributions from the first model's (what recovery tuning minimises)."),
    json_dest: Optional[str] = _json_option("Every number (per layer, per expert)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of per-layer expert load heatmaps (needs "
                                        "matplotlib: pip install 'moeify[plot]')."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Also zero-shot accuracy on these lm-eval tasks, e.g. "
                                        "arc_easy,piqa (the same items for every model; needs pip install "
                                        "'moeify[tasks]'), and generation health on prompts from --data."),
    task_dir: Optional[Path] = typer.Option(None, "--task-dir", help="Your own lm-eval task YAMLs (looked in first)."),
    task_data: Optional[Path] = typer.Option(None, "--task-data", help="Folder of the six bundled tasks' files "
                                             "(arc_easy/test.jsonl, ...), offline [default: $MOEIFY_TASK_DATA, "
                                             "else lm-eval's registry and the Hub]."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N items of each task [default: all]."),
    task_cache: Optional[Path] = typer.Option(None, "--task-cache", help="Keep each model's task answers in this "
                                              "folder as they are computed (a file per model, named by its weights, "
                                              "dtype and batch size): an interrupted --tasks run resumes there, and "
                                              "a model scored before is not scored again."),
) -> None:
    """Perplexity of every model on the same tokens and windows, parameters, tokens/s, and MoE routing statistics;
    with --tasks, zero-shot task accuracy (lm-evaluation-harness) and repeated n-grams in greedy continuations.

    Example: moeify eval path/to/dense out/llama-moe --tasks arc_easy,piqa --task-data shared/tasks --limit 500
    """
    from ..evaluation.perplexity import EvalSettings

    try:
        settings = EvalSettings(seq_len=seq_len, stride=stride, max_tokens=max_tokens, batch_size=batch_size,
                                device=device, dtype=dtype, oracle=oracle, kl=kl)
        _run_eval(models, data, settings, json_dest, plot, tasks=tasks, task_dir=task_dir, task_data=task_data,
                  limit=limit, task_cache=task_cache)
    except MoeifyError as exc:
        _fail(exc)


# convert's options' help texts, by parameter name (in the signature's order, which is --help's)
_HELP = {
    "shared": "Always-on shared width, in units of one expert (every expert is d_ff/(experts+shared) wide) "
              "[default: 0].",
    "method": "Neuron partition: contiguous | random | gate-cluster (balanced k-means of gate_proj rows) | activation "
              "| coactivation (both need calibration) [default: activation; with --weight-only: gate-cluster].",
    "router": "Router rows: mean-gate (EMoE) | representative (CMoE) | fitted (ridge fit to the experts' true output "
              "norms, needs calibration) [default: fitted; with --weight-only: representative].",
    "format": "Output format: mixtral | qwen2_moe | qwen3_moe | auto (qwen2_moe when --shared or --dense-layers or a "
              "Qwen2 source's biases need it; qwen3_moe for a Qwen3 source) [default: auto].",
    "dense_layers": "Layers kept dense (qwen2_moe, qwen3_moe): a list, e.g. 0,31, or auto:M for the M layers most hurt "
                    "by carving on the calibration data.",
    "gate_tolerance": "Max relative error of each unit gate vs 1/k; sets the router scale (smaller = closer to exact, "
                      "more float ties) [default: 1e-3].",
    "seed": "Seed for random/k-means partitions [default: 0].",
    "kmeans_iters": "Lloyd iterations of balanced k-means [default: 8].",
    "dtype": "Output dtype: auto (keep source) | bfloat16 | float16 | float32.",
    "max_shard_size": "Max bytes per output shard, e.g. 5GB, 500MB [default: 5GB].",
    "pad_experts_to": "Zero-pad every routed expert's width to a multiple of this (exact: zero neurons add nothing), "
                      "e.g. 128 or 256 for quantized serving; --dry-run says which formats a width suits [default: 8].",
    "untie_embeddings": "Write an explicit lm_head copy for tied-embedding sources [default: keep tied].",
    "calib": "Calibration text (.txt, or .jsonl with a 'text' field) from your domain; repeat for several files "
             "[default: the bundled sample, ~200 KB of Wikipedia and a novel].",
    "weight_only": "Carve from the weights alone (no calibration: fast, much worse quality; see BENCHMARKS.md). With "
                   "--preset: the preset's layout, its calibrated settings replaced by weight-only ones (gate-cluster, "
                   "representative router, no refit, no tuning; each said in a note).",
    "calib_tokens": "Calibration tokens, in windows spread evenly over the text; more than the text has is an error "
                    "[default: all of the text, up to 65536].",
    "calib_seq_len": "Calibration window length [default: 512, capped at the model's max_position_embeddings].",
    "calib_feed": "Next layer's calibration input: dense (the dense layer's output) | moe (the carved layer's output) "
                  "| corrected (the carved output, and each layer is fitted to restore the dense model's hidden "
                  "states, correcting earlier layers' error) [default: corrected].",
    "tune_tokens": "Recovery tuning: distil the carved experts and routers towards the dense model's next-token "
                   "distributions on this many fresh tokens (your --calib text, the bundled broad sample, the preset's "
                   "--tune-text and text the dense model samples itself); teacher and student on --device. About "
                   "7-12 seconds per 1,024 tokens for a 135M model on 2 CPU cores; use GPUs for 7B+. An interrupted "
                   "tuning resumes, and a tuned output tunes further, with `moeify tune` (0 = off) [default: the "
                   "preset's (active-50 and active-25: 262,144; active-75: 0, its tune paid on neither model "
                   "measured), else 0].",
    "no_tune": "Turn tuning off (a preset's --tune-tokens and --fit-epochs): the training-free carve only.",
    "tune_generated": "Share of the tuning tokens sampled from the dense model itself (label-free: what the teacher "
                      "knows is what the student is taught) [default: 0.5].",
    "tune_text": "More tuning text (.txt/.jsonl) besides --calib and the bundled sample; repeatable. A few hundred "
                 "thousand tokens of real prose kept task accuracy that the sample and sampled text alone lost "
                 "(BENCHMARKS.md) [default: the presets' bundled prose, ~300,000 tokens of Wikipedia and a novel; "
                 "yours replaces it; --tune-text bundled:tune_prose.txt names it beside yours].",
    "tune_router": "Also train the routers (exported as plain Mixtral / Qwen2-MoE routers) [default: on].",
    "tune_attention": "Recovery tuning also trains every layer's attention projections and RMSNorm weights (at a third "
                      "of the experts' step), so they adapt to the carved FFNs: 1-2% better on SmolLM2, +10% time, "
                      "more memory [default: the preset's, else off].",
    "tune_model_lr": "Recovery tuning step size, relative to each weight's RMS: half or twice the default measured "
                     "worse on unseen text (BENCHMARKS.md) [default: 0.003].",
    "fit_epochs": "Layer-local fitting after carving: this many passes of Adam over the calibration tokens on each "
                  "layer's experts, towards its target output (weak: see BENCHMARKS.md; 0 = off; was --tune-epochs) "
                  "[default: 0].",
    "fit_lr": "Layer-local fitting step size, relative to each weight's RMS [default: 0.01].",
    "compensate": "Refit down_proj by ridge least squares under the actual routing [default: on with --calib].",
    "stats": "Reuse neuron statistics (OUT/calibration/stats.safetensors of an earlier calibrated run) instead of "
             "recomputing them.",
    "device": "Where calibration, k-means clustering and router fitting run: auto (a GPU if there is one) | cpu | cuda "
              "[default: auto].",
    "preset": "A preset by name (active-50, active-25, active-75) or a TOML file; flags override it. Its [layout] "
              "(shares of d_ff) is resolved for SRC: the expert count whose width quantized kernels take; --dry-run "
              "prints how [default: active-50 when no --experts/--top-k/--shared is given].",
    "target": "A serving engine the output must run in: transformers | vllm | llama.cpp (repeatable, or "
              "comma-separated); convert refuses a layout a target cannot run. The presets name all three "
              "[default: none: only warnings].",
    "force": "Write a layout that a --target engine cannot run.",
    "memory_check": "Refuse, before calibrating, a tuning run whose predicted peak memory exceeds the device's.",
    "allow_pickle": "Read pytorch_model*.bin weights when SRC has no safetensors, with torch.load(weights_only=True) "
                    "(tensors only, no code runs).",
    "allow_nonfinite": "Convert tensors that contain NaN/Inf (with a warning) instead of refusing them.",
    "overwrite": "Replace OUT (and any leftover OUT.moeify-partial) if it exists.",
    "dry_run": "Print the plan (sizes, parameters, FLOPs, which quantized serving formats the expert width suits) and "
               "write nothing.",
    "eval_data": "After converting, compare source and output (`moeify eval SRC OUT --data EVAL`): a .txt/.jsonl file, "
                 "or 'sample' for the bundled sample.",
}


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Dense checkpoint: a directory (config.json, *.safetensors, tokenizer) or "
                                "a Hugging Face Hub id, org/name[@revision] (fetched into the Hub cache)."),
    out: Path = typer.Argument(..., help="Output directory for the MoE checkpoint (must not exist unless --overwrite)."),
    experts: Optional[int] = _EXPERTS,
    top_k: Optional[int] = _TOP_K,
    shared: Optional[int] = typer.Option(None, "--shared", help=_HELP["shared"]),
    method: Optional[str] = typer.Option(None, "--method", help=_HELP["method"]),
    router: Optional[str] = typer.Option(None, "--router", help=_HELP["router"]),
    format: Optional[str] = typer.Option(None, "--format", help=_HELP["format"]),
    dense_layers: Optional[str] = typer.Option(None, "--dense-layers", help=_HELP["dense_layers"]),
    gate_tolerance: Optional[float] = typer.Option(None, "--gate-tolerance", help=_HELP["gate_tolerance"]),
    seed: Optional[int] = typer.Option(None, "--seed", help=_HELP["seed"]),
    kmeans_iters: Optional[int] = typer.Option(None, "--kmeans-iters", help=_HELP["kmeans_iters"]),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=_HELP["dtype"]),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help=_HELP["max_shard_size"]),
    pad_experts_to: Optional[int] = typer.Option(None, "--pad-experts-to", help=_HELP["pad_experts_to"]),
    untie_embeddings: Optional[bool] = typer.Option(None, "--untie-embeddings/--keep-tied", help=_HELP["untie_embeddings"]),
    calib: Optional[list[Path]] = typer.Option(None, "--calib", help=_HELP["calib"]),
    weight_only: bool = typer.Option(False, "--weight-only", help=_HELP["weight_only"]),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", help=_HELP["calib_tokens"]),
    calib_seq_len: Optional[int] = typer.Option(None, "--calib-seq-len", help=_HELP["calib_seq_len"]),
    calib_feed: Optional[str] = typer.Option(None, "--calib-feed", help=_HELP["calib_feed"]),
    tune_tokens: Optional[int] = typer.Option(None, "--tune-tokens", help=_HELP["tune_tokens"]),
    no_tune: bool = typer.Option(False, "--no-tune", help=_HELP["no_tune"]),
    tune_generated: Optional[float] = typer.Option(None, "--tune-generated", help=_HELP["tune_generated"]),
    tune_text: Optional[list[Path]] = typer.Option(None, "--tune-text", help=_HELP["tune_text"]),
    tune_router: Optional[bool] = typer.Option(None, "--tune-router/--freeze-router", help=_HELP["tune_router"]),
    tune_attention: Optional[bool] = typer.Option(None, "--tune-attention/--experts-only", help=_HELP["tune_attention"]),
    tune_model_lr: Optional[float] = typer.Option(None, "--tune-model-lr", help=_HELP["tune_model_lr"]),
    fit_epochs: Optional[int] = typer.Option(None, "--fit-epochs", help=_HELP["fit_epochs"]),
    fit_lr: Optional[float] = typer.Option(None, "--fit-lr", help=_HELP["fit_lr"]),
    compensate: Optional[bool] = typer.Option(None, "--compensate/--no-compensate", help=_HELP["compensate"]),
    stats: Optional[Path] = typer.Option(None, "--stats", help=_HELP["stats"]),
    device: Optional[str] = typer.Option(None, "--device", help=_HELP["device"]),
    preset: Optional[Path] = typer.Option(None, "--preset", help=_HELP["preset"]),
    serve: Optional[str] = _SERVE,
    target: Optional[list[str]] = typer.Option(None, "--target", help=_HELP["target"]),
    force: bool = typer.Option(False, "--force", help=_HELP["force"]),
    memory_check: bool = typer.Option(True, "--memory-check/--no-memory-check", help=_HELP["memory_check"]),
    allow_pickle: bool = typer.Option(False, help=_HELP["allow_pickle"]),
    allow_nonfinite: bool = typer.Option(False, help=_HELP["allow_nonfinite"]),
    overwrite: bool = typer.Option(False, help=_HELP["overwrite"]),
    dry_run: bool = typer.Option(False, help=_HELP["dry_run"]),
    json_dest: Optional[str] = _json_option("The plan (--dry-run) or the conversion report (OUT/report.json)."),
    eval_data: Optional[str] = typer.Option(None, "--eval", help=_HELP["eval_data"]),
) -> None:
    """Split every FFN into experts and write a Mixtral / Qwen2-MoE / Qwen3-MoE checkpoint that stock transformers loads.

    \b
    Examples:
      moeify convert Qwen/Qwen2.5-0.5B out/qwen-moe --preset active-50
      moeify convert path/to/Llama-3-8B out/llama-moe --experts 8 --top-k 2 --no-tune
    """
    from ..api import prepare_conversion, run_prepared
    from .report import print_result
    from .report_plan import print_plan

    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would write OUT at once
            raise MoeifyError("convert runs in one process, not under torchrun / accelerate launch",
                              f"carve in one process (moeify convert {src} {out} --no-tune ...), then tune across "
                              f"processes: torchrun --nproc-per-node G -m moeify tune {src} {out} --tokens N")
        if eval_data:  # a bad --eval file fails before the conversion, not after it
            from ..formats.text import read_text

            read_text(eval_data)
        plan, notes = prepare_conversion(
            str(src), preset=preset, tune=False if no_tune else tune_tokens, weight_only=weight_only, calib=calib,
            serve=serve, allow_pickle=allow_pickle, allow_nonfinite=allow_nonfinite, force=force,
            experts=experts, top_k=top_k, shared=shared, method=method, router=router, format=format,
            dense_layers=dense_layers, gate_tolerance=gate_tolerance, seed=seed, kmeans_iters=kmeans_iters,
            dtype=dtype, max_shard_size=max_shard_size, pad_experts_to=pad_experts_to,
            untie_embeddings=untie_embeddings, calib_tokens=calib_tokens, calib_seq_len=calib_seq_len,
            calib_feed=calib_feed, compensate=compensate, stats=str(stats) if stats else None, device=device,
            fit_epochs=fit_epochs, fit_lr=fit_lr, tune_generated=tune_generated, tune_text=tune_text,
            tune_router=tune_router, tune_attention=tune_attention, tune_model_lr=tune_model_lr,
            targets=None if target is None else ",".join(target))
        tables = _tables(json_dest)
        for note in notes:
            tables.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
        print_plan(tables, plan, out)
        if dry_run:
            from ..api import serve_layouts
            from .report_plan import print_alternatives

            alternatives = serve_layouts(str(src), preset=preset, experts=experts, top_k=top_k, shared=shared)
            if alternatives:
                print_alternatives(tables, alternatives)
            tables.print("[dim]--dry-run: nothing written[/]")
            if json_dest:
                _write_json(plan.summary(), json_dest)
            return
        with progress_bars() as bar:
            done = run_prepared(plan, out, notes, overwrite=overwrite, progress=stage_callback(bar),
                                memory_check=memory_check)
        print_result(tables, done.report, out)
        if json_dest:
            _write_json(done.report, json_dest)
        if done.nonfinite:
            bad = done.nonfinite
            console.print(f"[bold yellow]warning:[/] {len(bad)} source tensor(s) had NaN/Inf values and were converted "
                          f"as they are (--allow-nonfinite): {', '.join(list(bad)[:5])}{' ...' if len(bad) > 5 else ''}",
                          highlight=False, soft_wrap=True)
        if eval_data:
            from ..evaluation.perplexity import EvalSettings

            _run_eval([plan.src.path, out], eval_data, EvalSettings(), tables=tables)
    except MoeifyError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        from ..tuning import state_dir

        if (state_dir(out) / "run.json").is_file():
            _interrupted_tuning(src, out)
        console.print("[bold red]interrupted[/]: the partial output was removed; nothing was left behind")
        raise typer.Exit(130)


from .tune import interrupted_tuning as _interrupted_tuning, tune_cmd  # noqa: E402 (here: the order of --help)

app.command("tune")(tune_cmd)
app.command("eval")(eval_cmd)  # listed in --help in the order of use: convert, tune, eval


@app.command("plan")
def plan_cmd(
    src: Path = typer.Argument(..., help="Dense checkpoint directory, a config.json file, or a Hub id (org/name"
                                "[@revision]: only its config.json is fetched; no weights needed)."),
    experts: Optional[int] = _EXPERTS,
    top_k: Optional[int] = _TOP_K,
    shared: Optional[int] = typer.Option(None, "--shared", help="Always-on shared expert, in units of one expert's "
                                         "width [default: the preset's; without a preset, 0]."),
    preset: Optional[Path] = typer.Option(None, help="A preset by name (active-50, active-25, active-75) or a TOML file: plan the "
                                          "layout it resolves to for this model (its shares of d_ff, the widths "
                                          "quantized kernels take); --experts/--shared/--top-k override it "
                                          "[default: active-50 when no count is given]."),
    expert_width: Optional[int] = typer.Option(None, "--expert-width", help="Add a row for this expert width."),
    serve: Optional[str] = _SERVE,
    gpus: int = typer.Option(8, "--gpus", min=1, help="GPUs (processes) the upcycles' training memory is given for."),
    gpu_memory: float = typer.Option(80.0, "--gpu-memory", min=1.0, help="GB of one GPU: how many the upcycles' "
                                     "training needs."),
    json_dest: Optional[str] = _json_option("The numbers of every regime, with serving fit."),
) -> None:
    """Parameters, activated parameters and FFN FLOPs per token of an MoE built from a dense config, for the
    max-capacity (`moeify upcycle`'s E8 top-2), constant-compute (E8 fine-grained, G4 top-4: dense compute),
    inference-saving (d_ff/N, what convert carves) and custom-width regimes, with ratios to the dense model; and
    the upcycles' training memory per GPU, plain and offloaded, with the GPUs it needs.

    \b
    Examples:
      moeify plan meta-llama/Llama-3.1-70B --preset active-25
      moeify plan path/to/Llama-3-8B/config.json --experts 8 --top-k 2
    """
    from ..api import plan
    from .report_plan import print_moe_plan

    try:
        result = plan(str(src), preset=preset, experts=experts, top_k=top_k, shared=shared, expert_width=expert_width,
                      serve=serve)
        print_moe_plan(_tables(json_dest), result, gpus, gpu_memory)
        if json_dest:
            _write_json(result.to_dict(gpus, gpu_memory * 1e9), json_dest)
    except MoeifyError as exc:
        _fail(exc)


@app.command("inspect")
def inspect_cmd(
    out: Path = typer.Argument(..., help="MoE checkpoint directory (mixtral, qwen2_moe or qwen3_moe, e.g. written by convert)."),
    dense: Optional[Path] = typer.Option(None, "--dense", help="The dense source: adds the dense FFN as row F."),
    data: Optional[Path] = typer.Option(None, "--data", help="Text file: routing, norm-vs-score ranks, activations."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Tokens of --data to run."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Comma-separated MoE layers [default: all]."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Where inspect.json and PNGs go "
                                              "[default: OUT/inspect]."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG figures (needs matplotlib: moeify[plot])."),
    json_dest: Optional[str] = _json_option("Every number (also written to OUTPUT_DIR/inspect.json)."),
) -> None:
    """Expert/router similarity analyses of "A Closer Look into Mixture-of-Experts in LLMs", per MoE layer.

    Example: moeify inspect out/llama-moe --dense path/to/Llama-3-8B --data text.txt
    """
    from ..evaluation.analysis import run_inspect
    from ..formats.hub import resolve
    from .report import print_inspect

    try:
        with progress_bars() as bar:
            on_progress = stage_callback(bar)
            result = run_inspect(resolve(out, what="OUT"), dense=None if dense is None else resolve(dense, what="--dense"),
                                 data=data, max_tokens=max_tokens, layers=layers,
                                 out_dir=output_dir, plots=plots, progress=on_progress)
    except MoeifyError as exc:
        _fail(exc)
    print_inspect(_tables(json_dest), result)
    if json_dest:
        try:
            _write_json(result, json_dest)
        except MoeifyError as exc:
            _fail(exc)


@app.command("verify")
def verify_cmd(
    out: Path = typer.Argument(..., help="MoE checkpoint directory (mixtral, qwen2_moe or qwen3_moe, e.g. written by convert)."),
    against: Optional[Path] = typer.Option(None, help="The dense source (a folder or a Hub id): also check that every "
                                           "tensor and the un-permuted experts match it bit for bit, and compare "
                                           "logits."),
    logits: bool = typer.Option(True, "--logits/--no-logits", help="With --against: compare logits with every expert "
                                "active (loads both models in float32, one at a time)."),
    values: bool = typer.Option(True, "--values/--headers-only", help="Read every tensor to look for NaN/Inf."),
    allow_pickle: bool = typer.Option(False, help="Read a pickled (pytorch_model*.bin) source with "
                                      "torch.load(weights_only=True)."),
    seq_len: int = typer.Option(16, min=1, help="Tokens of the random input for the logits comparison."),
    json_dest: Optional[str] = _json_option("The checks, skips, problems and logit difference."),
) -> None:
    """Check a converted checkpoint: config, index and headers agree, every tensor has its shape and dtype, no NaN/Inf;
    with --against SRC, the experts un-permute to the source FFN bit for bit and all-experts-active logits match.

    Exit code 0 when every check passes, 2 when one fails (each problem on one line).
    Example: moeify verify out/llama-moe --against path/to/Llama-3-8B
    """
    from rich.markup import escape

    from ..formats.hub import resolve
    from ..evaluation.verify import verify_checkpoint

    try:
        with progress_bars() as bar:
            on_progress = stage_callback(bar)
            against = None if against is None else resolve(against, what="--against")
            result = verify_checkpoint(out, against, values=values, logits=logits, allow_pickle=allow_pickle,
                                       seq_len=seq_len, progress=on_progress)
    except MoeifyError as exc:
        _fail(exc)
    tables = _tables(json_dest)
    for line in result.checked:
        tables.print(f"[green]checked[/] {escape(line)}", highlight=False, soft_wrap=True)
    for line in result.skipped:
        tables.print(f"[yellow]skipped[/] {escape(line)}", highlight=False, soft_wrap=True)
    if json_dest:
        try:
            _write_json(result.to_json(), json_dest)
        except MoeifyError as exc:
            _fail(exc)
    if result.problems:
        for line in result.problems:
            console.print(f"[bold red]problem:[/] {escape(line)}", highlight=False, soft_wrap=True)
        console.print(f"[bold red]error:[/] {out} failed verification ({len(result.problems)} problem(s))",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    tables.print(f"[bold green]OK[/] {escape(str(out))}", highlight=False, soft_wrap=True)


from .upcycle import merge_cmd, upcycle_cmd  # noqa: E402 (after the commands above: the order of --help)

app.command("upcycle")(upcycle_cmd)
app.command("merge")(merge_cmd)


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # same clean-up as Ctrl-C: the partial output is removed


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app()
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]: no output was left behind")
        sys.exit(130)


if __name__ == "__main__":
    main()
