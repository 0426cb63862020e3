"""`moeify upcycle`: parses its flags, calls moeify.api.upcycle's two halves, renders the plan and the result.
Registered on the app by cli/app.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..formats.card import nats
from ..errors import MoeifyError
from .terminal import console, fail, fail_on_rank, json_option, progress_bars, stage_callback, tables, write_json


def _millions(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _print_plan(out_console, plan, out: Path) -> None:
    lay, s = plan.layout, plan.settings
    t = Table(title=f"upcycle {plan.src.path.name} -> {out.name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    kind = "full width" if lay.granularity == 1 else f"{lay.granularity} slices each"
    t.add_row("format", f"{plan.fmt} (top-k renormalised)")
    t.add_row("experts", f"{lay.copies} copies x {lay.granularity} = {lay.n_experts} of {lay.expert_width} "
              f"neurons ({kind}), top-{lay.top_k}")
    if lay.shared_width:
        t.add_row("shared expert", f"{lay.shared_width} neurons, always on")
    t.add_row("FFN params", f"x{lay.params_ratio:.2f} dense")
    t.add_row("FFN compute", f"x{lay.compute_ratio:.2f} dense per token")
    t.add_row("parameters", f"{_millions(plan.total_params)} total, {_millions(plan.active_params)} active")
    t.add_row("output", f"{plan.output_bytes / 1e9:.2f} GB, {len(plan.shards.files)} shard(s), "
              f"{str(plan.out_dtype).removeprefix('torch.')}")
    t.add_row("to train it", f"~{plan.summary()['training_state_bytes'] / 1e9:.1f} GB of AdamW state "
              "(16 B a parameter, mixed precision), before activations")
    t.add_row("training / GPU", _training_text(plan))
    sym = {"none": "none: identical copies, exact",
           "permute": "permute: slices of each copy shuffled, exact",
           "drop": f"drop: {s.drop_share:.0%} of each expert's neurons re-initialised, not exact",
           "noise": f"noise: {s.noise_scale:g} x each matrix's std, not exact"}[s.symmetry]
    t.add_row("symmetry", sym)
    out_console.print(t)
    _print_notes(out_console, plan)


def _print_notes(out_console, plan) -> None:
    """What each engine says of the planned output (moeify.formats.engines), one line a note."""
    for n in plan.engine_notes:
        colour = "red" if n.fails else "yellow"
        out_console.print(f"[{colour}]{escape(n.engine)}:[/] {escape(n.what)} ({escape(n.fix)})", highlight=False,
                          soft_wrap=True)


def _training_text(plan, processes: int = 8, gpu_gb: float = 80) -> str:
    """What `moeify tune OUT --tune-text` needs per GPU (moeify.evaluation.planning.training_needs): on 1 and `processes`
    GPUs, offloaded, and how many GPUs of gpu_gb GB."""
    from ..evaluation.planning import training_needs

    lay = plan.layout
    one, many = (training_needs(plan.src, lay.n_experts, lay.top_k, lay.expert_width, lay.shared_width, n,
                                gpu_gb * 1e9) for n in (1, processes))
    need = many["gpus_needed"]
    plain = f"{need['plain']}" if need["plain"] else "more than 512"
    off = f", {need['offload']} offloaded" if need["offload"] else ""
    return (f"{one['peak'] / 1e9:.1f} GB on 1 GPU, {many['peak'] / 1e9:.1f} GB each on {processes} "
            f"({many['offload_peak'] / 1e9:.1f} GB + {many['offload_host'] / 1e9:.1f} GB host offloaded); "
            f"{gpu_gb:g} GB GPUs: {plain}{off} (bf16, FSDP2)")


def _print_result(shown, report: dict, out: Path, json_dest: Optional[str]) -> None:
    """What the end-of-run check measured, where the output is, and --json."""
    c = report["check"]
    if c.get("exact_model"):
        shown.print(f"[green]checked[/] {escape(c['exact_model'])} against {escape(Path(report['source']).name)}: max "
                    f"|logit difference| {c['max_logit_diff']:.3g} (max |logit| {c['logit_scale']:.3g})",
                    highlight=False, soft_wrap=True)
    shown.print(f"as written: KL to {escape(Path(report['source']).name)} {nats(c['kl_to_source'])} nats; "
                f"{report['experts']} experts of {report['expert_width']} neurons, top-{report['top_k']}",
                highlight=False, soft_wrap=True)
    shown.print(f"[bold green]wrote[/] {escape(str(out))} in {report['seconds']:.1f} s, checked as it was written",
                highlight=False)
    if json_dest:
        write_json(report, json_dest)


def _interrupted() -> None:
    console.print("[bold red]interrupted[/]: the partial output was removed; nothing was left behind")
    raise typer.Exit(130)


def upcycle_cmd(
    src: Path = typer.Argument(..., help="Dense checkpoint: a directory or a Hugging Face Hub id, org/name[@revision]."),
    out: Path = typer.Argument(..., help="Output directory (must not exist unless --overwrite)."),
    copies: int = typer.Option(8, "--copies", "-e", help="Copies of each FFN (E)."),
    granularity: int = typer.Option(1, "--granularity", "-g", help="Slices per copy (G): N = E x G experts of d_ff/G "
                                    "neurons; the top-k must be a multiple of G."),
    top_k: int = typer.Option(2, "--top-k", "-k", help="Experts a token uses (a multiple of G): FFN compute is "
                              "top-k/G x dense."),
    shared_width: int = typer.Option(0, help="Neurons of each FFN kept apart in an always-on shared expert "
                                     "(Qwen2-MoE); the copies hold the rest."),
    symmetry: str = typer.Option("drop", help="How the copies are made to differ, so the router learns: drop "
                                 "(Drop-Upcycling: --drop-share of each expert's neurons re-initialised; the default: "
                                 "best trained in its paper and 2% ahead of identical copies in ours, but far from "
                                 "the source at first, KL 9.3 nats on SmolLM2) | permute (fine-grained: each copy's "
                                 "neurons shuffled before slicing; still exact) | noise (--noise-scale; KL 0.0014 on "
                                 "SmolLM2) | none (identical copies: exact, but the router gets almost no gradient "
                                 "until they differ)."),
    drop_share: float = typer.Option(0.5, help="With --symmetry drop: share of each expert's neurons re-initialised "
                                     "from the source matrices' mean and std."),
    noise_scale: float = typer.Option(0.01, help="With --symmetry noise: noise std relative to each matrix's."),
    router_std: float = typer.Option(0.0, help="Std of the random router rows [default: the source's "
                                     "initializer_range, or 0.02]."),
    aux_loss_coef: float = typer.Option(0.01, help="config.json's router_aux_loss_coef: the weight of the "
                                        "load-balancing loss transformers adds when the model is trained with "
                                        "output_router_logits=True (the literature: 1e-2 to 1e-3)."),
    format: str = typer.Option("auto", "--format", help="mixtral | qwen2_moe | qwen3_moe | auto (Mixtral for "
                               "Llama/Mistral, Qwen2-MoE for Qwen2 or with --shared-width, Qwen3-MoE for Qwen3)."),
    dtype: str = typer.Option("auto", help="Output dtype: auto (the source's) | bfloat16 | float16 | float32."),
    max_shard_size: Optional[str] = typer.Option(None, help="Max bytes per output shard [default: 5GB]."),
    seed: int = typer.Option(0, help="Seed of the routers, the re-initialisation, shuffles and noise."),
    target: Optional[list[str]] = typer.Option(None, "--target", help="A serving engine the output must run "
                                               "exactly: transformers | vllm | llama.cpp (repeatable); refuses a "
                                               "layout a target cannot."),
    force: bool = typer.Option(False, "--force", help="Write a layout that a --target engine cannot run."),
    check_text: Optional[list[Path]] = typer.Option(None, "--check-text", help="Text for the KL to the source of "
                                                    "the model as written [default: the bundled sample; an "
                                                    "exact output: 64 random tokens]."),
    check_tokens: int = typer.Option(512, min=64, help="Tokens of --check-text scored."),
    allow_pickle: bool = typer.Option(False, help="Read pytorch_model*.bin weights (torch.load(weights_only=True))."),
    overwrite: bool = typer.Option(False, help="Replace OUT if it exists."),
    dry_run: bool = typer.Option(False, help="Print the plan (experts, parameters, compute, training memory, "
                                 "engines) from config.json alone (a Hub id fetches nothing else) and write nothing."),
    json_dest: Optional[str] = json_option("The plan (--dry-run) or the report (OUT/report.json)."),
) -> None:
    """Make an MoE for training from a dense model: every FFN copied into experts (full width, or fine-grained
    slices), a router per layer. Exact at initialisation under the class's own top-k routing, checked against the
    source before anything is committed; --symmetry says how the copies are made to differ, and the card reports by
    how much (KL to the source). Then train it: `moeify tune` or any trainer.

    \b
    Examples:
      moeify upcycle path/to/Llama-3-8B out/llama-8x --copies 8 --top-k 2           # x8 FFN params, x2 compute
      moeify upcycle Qwen/Qwen2.5-0.5B out/qwen-fg --copies 8 --granularity 4 --top-k 4   # x8 params, x1 compute
      moeify upcycle path/to/SmolLM2 out/exact --symmetry none                       # identical copies
    """
    from ..api import prepare_upcycle, run_upcycle_plan

    try:
        plan = prepare_upcycle(str(src), copies=copies, granularity=granularity, top_k=top_k,
                               shared_width=shared_width, symmetry=symmetry, drop_share=drop_share,
                               noise_scale=noise_scale, router_std=router_std, aux_loss_coef=aux_loss_coef,
                               format=format, dtype=dtype,
                               max_shard_size=max_shard_size, seed=seed,
                               targets=None if target is None else ",".join(target), allow_pickle=allow_pickle,
                               force=force, weights=not dry_run)  # a dry run reads config.json alone
        if not dry_run:  # before the plan is printed: nothing to read on the way to this error
            from ..formats.output import check_output_path

            check_output_path(out, overwrite, plan.src.path)
        shown = tables(json_dest)
        _print_plan(shown, plan, out)
        if dry_run:
            shown.print("[dim]--dry-run: nothing written[/]")
            if json_dest:
                write_json(plan.summary(), json_dest)
            return
        with progress_bars() as bar:
            report = run_upcycle_plan(plan, out, overwrite=overwrite, progress=stage_callback(bar),
                                      check_text=check_text, check_tokens=check_tokens)
        _print_result(shown, report, out, json_dest)
    except MoeifyError as exc:
        fail(exc)
    except KeyboardInterrupt:
        _interrupted()


def merge_cmd(
    out: Path = typer.Argument(..., help="Output directory (must not exist unless --overwrite)."),
    sources: Optional[list[Path]] = typer.Argument(None, help="Two or more fine-tunes of one base (directories or Hub "
                                                   "ids; the same family, shapes and tokenizer): each one's FFN "
                                                   "becomes an expert [default: the --config's experts]."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="A mergekit-moe YAML (base_model, experts with "
                                          "their prompts, gate_mode, experts_per_token, architecture, dtype, "
                                          "residual_scale), read as mergekit reads it; the flags here override it."),
    base: Optional[Path] = typer.Option(None, help="Where attention, norms and embeddings come from (with "
                                        "--attention base) and the router's input is computed [default: the config's "
                                        "base_model, else the first source]."),
    granularity: int = typer.Option(1, "--granularity", "-g", help="Slices per source's FFN (fine-grained experts)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", "-k", help="Experts a token uses, a multiple of G "
                                        "[default: the config's experts_per_token, else 2 sources' worth]."),
    attention: str = typer.Option("base", help="base (the base's attention, norms, embeddings) | average (the "
                                  "sources' mean)."),
    gate_mode: Optional[str] = typer.Option(None, "--gate-mode", help="How each layer's router rows are made: hidden "
                                            "| hidden_avg | cheap_embed (mergekit's, from the prompts) | random | "
                                            "uniform_random | router_input (moeify's: the router's own input on the "
                                            "prompts or --router-text, centred) [default: the config's, router_input "
                                            "with --router-text, else random]."),
    router_text: Optional[list[Path]] = typer.Option(None, "--router-text", help="One text file per source, in "
                                                     "order: each layer's router row for a source is its text's mean "
                                                     "router input (post-attention-norm hidden states, every token, "
                                                     "through the base), centred."),
    router_tokens: int = typer.Option(2048, min=64, help="Tokens of each --router-text used."),
    format: str = typer.Option("auto", "--format", help="mixtral | qwen2_moe | qwen3_moe | auto [default: the "
                               "config's architecture, else the family's]."),
    dtype: str = typer.Option("auto", help="Output dtype: auto (the config's, else the base's) | bfloat16 | float16 | "
                              "float32."),
    max_shard_size: Optional[str] = typer.Option(None, help="Max bytes per output shard [default: 5GB]."),
    seed: int = typer.Option(0, help="Seed of random router rows."),
    check_text: Optional[list[Path]] = typer.Option(None, "--check-text", help="Text for the KL of the merge to the "
                                                    "base [default: the bundled sample; a merge that computes the "
                                                    "base as written: 64 random tokens]."),
    allow_pickle: bool = typer.Option(False, help="Read pytorch_model*.bin weights (torch.load(weights_only=True))."),
    overwrite: bool = typer.Option(False, help="Replace OUT if it exists."),
    json_dest: Optional[str] = json_option("The report (OUT/report.json)."),
) -> None:
    """Merge several fine-tunes of one base into one MoE (Branch-Train-MiX, "clown car" merges): each source's FFN an
    expert, a router per layer from each source's prompts or text, or random; attention from the base or averaged.
    Reads mergekit-moe's YAML as it is. Then train the routers (and experts) on mixed text.

    \b
    Examples:
      moeify merge out/moe path/to/base-code path/to/base-math --router-text code.txt --router-text math.txt
      moeify merge out/moe ft-a ft-b ft-c ft-d --base path/to/base --top-k 2 --attention average
      moeify merge out/moe --config clown-car.yml
      moeify merge out/moe --config clown-car.yml --gate-mode router_input
    """
    from ..api import merge

    try:
        shown = tables(json_dest)
        with progress_bars() as bar:
            report = merge([str(s) for s in sources or []], out, config=config,
                           base=None if base is None else str(base), granularity=granularity, top_k=top_k,
                           attention=attention, gate_mode=gate_mode, router_text=router_text,
                           router_tokens=router_tokens, format=format, dtype=dtype, max_shard_size=max_shard_size,
                           seed=seed, check_text=check_text, allow_pickle=allow_pickle, overwrite=overwrite,
                           progress=stage_callback(bar), on_plan=lambda plan: _print_notes(shown, plan))
        _print_result(shown, report, out, json_dest)
    except MoeifyError as exc:
        fail(exc)
    except KeyboardInterrupt:
        _interrupted()


NOT_FOR_TRAINING = {"tune_generated": "--tune-generated", "schedule": "--schedule", "dry_run": "--dry-run"}


def train_cmd(out: Path, src: Optional[Path], args: dict, refused: dict) -> None:
    """`moeify tune OUT` on an output of upcycle or merge: next-token training (moeify.api.train); under torchrun
    every rank trains and rank 0 reports (a rank that lost the others says so itself)."""
    import os

    rank = int(os.environ.get("RANK", "0"))
    try:
        _train(out, src, args, refused, rank)
    except MoeifyError as exc:
        fail_on_rank(exc, rank)
    except (KeyboardInterrupt, Exception) as exc:
        from ..tuning import TuningInterrupted

        if not isinstance(exc, (KeyboardInterrupt, TuningInterrupted)):
            raise
        if rank:
            raise typer.Exit(130)
        _training_interrupted(out)


def _train(out: Path, src: Optional[Path], args: dict, refused: dict, rank: int) -> None:
    from ..api import train
    from .report import print_training

    json_dest = args.pop("json_dest")
    flag = next((NOT_FOR_TRAINING[k] for k, v in refused.items() if v is not None), None)
    if flag:
        raise MoeifyError(f"{flag} is for tuning a carve towards its dense source; {out} is an upcycled or "
                          "merged output, trained on text", f"drop {flag}")
    from ..tuning.lm import is_trainable_output

    if not is_trainable_output(out):
        raise MoeifyError(f"{out} is not an output of moeify upcycle or moeify merge",
                          "a carve is tuned towards its dense source: moeify tune SRC OUT --tokens N")
    if src is not None and not rank:
        console.print(f"[yellow]{escape(str(out))} trains on text alone (next-token loss); {escape(str(src))} "
                      "is not read[/]", highlight=False, soft_wrap=True)
    if args.pop("router_only"):
        args["train_experts"] = False
    text = args.pop("text")
    run = {k: args.pop(k) for k in ("resume", "restart", "device", "save_every", "memory_check", "offload",
                                    "timeout")}
    tokens = args.pop("tokens")
    if tokens is None and not run["resume"]:
        raise MoeifyError("--tokens is required (the training budget of this run)",
                          f"e.g. moeify tune {out} --tune-text corpus.txt --tokens 1048576")
    if rank:  # a process of a torchrun / accelerate launch other than the first: rank 0 reports
        train(out, tokens, text=text, **run, **args)
        return
    with progress_bars() as bar:
        report = train(out, tokens, text=text, progress=stage_callback(bar), **run,
                       notify=lambda msg: console.print(f"[yellow]{escape(msg)}[/]", highlight=False), **args)
    print_training(tables(json_dest), report, out)
    if json_dest:
        write_json(report, json_dest)


def _training_interrupted(out: Path) -> None:
    from ..tuning import TuningState, state_dir

    done = TuningState(state_dir(out)).progress()
    if done is None:
        console.print(f"[bold red]interrupted[/]: {escape(str(out))} was left as it was")
        raise typer.Exit(130)
    console.print(f"[bold red]interrupted[/]: training saved at step {done[0]:,} of {done[1]:,} in "
                  f"{escape(str(state_dir(out)))}; continue it with:\n  moeify tune {escape(str(out))} --resume",
                  highlight=False, soft_wrap=True)
    raise typer.Exit(130)


__all__ = ["upcycle_cmd", "merge_cmd", "train_cmd"]
