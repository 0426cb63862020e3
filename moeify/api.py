"""moeify from Python: convert, tune, evaluate and plan, with typed arguments, results as objects, errors as
MoeifyError (never an exit of the process) and progress through a callback. The command line parses its flags,
calls these and renders what they return.

    import moeify

    result = moeify.convert("Qwen/Qwen2.5-0.5B", "out/qwen-moe", preset="active-50", tune=False)
    print(result.report["ffn_flops_ratio"], result.out / "README.md")
    moeify.tune("Qwen/Qwen2.5-0.5B", "out/qwen-moe", tokens=262_144)
    scores = moeify.evaluate(["Qwen/Qwen2.5-0.5B", "out/qwen-moe"], data="valid.txt")
    print(moeify.plan("meta-llama/Llama-3.1-70B", preset="active-25").regimes)   # config.json only

A checkpoint is a folder or a Hugging Face Hub id (`org/name`, `org/name@revision`; moeify.formats.hub). progress is called
as progress(stage, done, total) (and a note, for tuning), as the command line's progress bars are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .formats.config import DEFAULT_PRESET, ConvertConfig, build_config
from .errors import MoeifyError
from .formats.hub import resolve

Progress = Callable[..., None]
LAYOUT_FLAGS = ("experts", "top_k", "shared")


@dataclass
class Conversion:
    """What `convert` did: where the output is, its report.json, and the notes on how the settings resolved."""

    out: Path
    report: dict
    notes: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)  # source tensors with NaN/Inf converted as they were


def prepare_conversion(src: str | Path, *, preset: str | Path | None = None, tune: bool | int | None = None,
                       weight_only: bool = False, calib: Sequence[str | Path] | None = None,
                       serve: str | None = None, allow_pickle: bool = False, allow_nonfinite: bool = False,
                       force: bool = False, **settings):
    """The conversion's plan (moeify.carving.conversion.ConversionPlan: layout, tensors, budget, engine notes) and the notes
    on how the settings resolved, before anything is written (`moeify convert --dry-run` prints this).

    No preset and no --experts/--top-k/--shared: the recommended preset (DEFAULT_PRESET), said in a note. tune:
    None as the preset says, False none, an int that many tokens. serve: the serving format the preset's layout is
    resolved for (moeify.formats.layout.SERVE_QUANTA: k-quants, fp8, q8_0, bf16; default: the preset's own widths)."""
    from .carving.conversion import plan_conversion

    notes: list[str] = []
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(ConvertConfig)} - {"max_shard_size"})
    if unknown:
        raise MoeifyError(f"convert() got unknown setting(s): {', '.join(unknown)}",
                          "the settings are ConvertConfig's fields (moeify.formats.config), as `moeify convert --help` names them")
    if weight_only and calib:
        raise MoeifyError("--weight-only and --calib contradict each other", "pass one of them")
    if preset is None and all(settings.get(k) is None for k in LAYOUT_FLAGS):
        preset = DEFAULT_PRESET
        notes.append(f"no layout given: the {DEFAULT_PRESET} preset (half the FFN active: a shared expert and "
                     "fine-grained routed experts; --preset active-25 for a quarter, --experts/--top-k/--shared "
                     "for your own)")
    source = resolve(src)
    if tune is False:
        settings.update(tune_tokens=0, fit_epochs=0)
    elif tune is not None and tune is not True:
        settings["tune_tokens"] = int(tune)
    cfg = build_config(preset, default_calib=not weight_only, source=source, weight_only=weight_only, notes=notes,
                       serve=serve, calib=None if calib is None else tuple(str(c) for c in calib), **settings)
    plan = plan_conversion(source, cfg, allow_pickle=allow_pickle, allow_nonfinite=allow_nonfinite, force=force)
    return plan, notes


def run_prepared(plan, out: str | Path, notes: list[str] | None = None, *, overwrite: bool = False,
                 progress: Progress | None = None, memory_check: bool = True) -> Conversion:
    """Write the output a prepared conversion plans (and tune it, if its settings say so)."""
    from .carving.conversion import run_conversion

    report = run_conversion(plan, out, overwrite=overwrite, progress=progress, memory_check=memory_check)
    return Conversion(Path(out), report, list(notes or []), list(plan.reader.nonfinite))


def convert(src: str | Path, out: str | Path, *, preset: str | Path | None = None, tune: bool | int | None = None,
            calib: Sequence[str | Path] | None = None, weight_only: bool = False, serve: str | None = None,
            overwrite: bool = False, progress: Progress | None = None, memory_check: bool = True,
            allow_pickle: bool = False, allow_nonfinite: bool = False, force: bool = False,
            **settings) -> Conversion:
    """Carve the dense checkpoint `src` (a folder or a Hub id) into the MoE checkpoint `out`, all or nothing.

    preset: a preset by name ("active-50", "active-25", "active-75") or a TOML file; none and no experts/top_k/shared: the
    recommended one. tune: None as the preset says (active-50 and active-25: 262,144 tokens of recovery tuning;
    active-75: none), False none, or a token count. calib: calibration text files (default: the preset's, else the
    bundled sample). serve: the serving format the preset's layout suits (k-quants, fp8, q8_0, bf16; README "Presets
    at your model's shape"). settings: any other conversion setting (experts, top_k, shared, format, dtype,
    max_shard_size, ...), as `moeify convert` names them with '_' for '-'. Returns the output's path, report.json and
    the notes on how the settings resolved."""
    plan, notes = prepare_conversion(src, preset=preset, tune=tune, weight_only=weight_only, calib=calib,
                                     serve=serve, allow_pickle=allow_pickle, allow_nonfinite=allow_nonfinite, force=force,
                                     **settings)
    return run_prepared(plan, out, notes, overwrite=overwrite, progress=progress, memory_check=memory_check)


def tune(src: str | Path, out: str | Path, tokens: int | None = None, *, resume: bool = False, restart: bool = False,
         device: str = "auto", save_every: float = 600.0, progress: Progress | None = None,
         notify: Callable[[str], None] | None = None, memory_check: bool = True, offload: bool | None = None,
         timeout: float | None = None, **options) -> dict:
    """Recovery tuning of the moeify output `out` towards its dense source `src` (a folder or a Hub id) on `tokens`
    fresh tokens; written back to `out` all or nothing. Returns the new report.json. resume: continue an interrupted
    run (its own settings; options given must agree). options: lr, generated, calib, tune_text, train_router,
    train_experts, train_attention, seed, schedule, step_tokens, hidden_weight (moeify.tuning.TuneOptions). Under
    torchrun each process calls it."""
    from .formats.config import text_path
    from .tuning import TuneOptions, tune_output

    given = {k: v for k, v in options.items() if v is not None}
    for key in ("calib", "tune_text"):  # as convert records them: absolute (a resume from elsewhere finds them), a
        if key in given:  # text moeify ships named bundled:NAME
            files = [given[key]] if isinstance(given[key], (str, Path)) else given[key]
            given[key] = tuple(text_path(f) for f in files)
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(TuneOptions)} - {"tokens"})
    if unknown:
        raise MoeifyError(f"tune() got unknown option(s): {', '.join(unknown)}",
                          f"the options are TuneOptions' fields: {', '.join(f.name for f in dataclasses.fields(TuneOptions))}")
    opts = None
    if not resume:
        if tokens is None:
            raise MoeifyError("tokens is required (the tuning budget of this run)",
                              f"e.g. moeify tune {src} {out} --tokens 262144; or resume an interrupted run")
        opts = TuneOptions(tokens=tokens, **given)
    given = {"tokens": tokens, **given} if resume else None
    return tune_output(resolve(src), out, opts, resume=resume, restart=restart, device=device, save_every=save_every,
                       progress=progress, notify=notify, given=given, memory_check=memory_check, offload=offload,
                       timeout=timeout)


def train(out: str | Path, tokens: int | None = None, *, text: Sequence[str | Path] = (), resume: bool = False,
          restart: bool = False, device: str = "auto", save_every: float = 600.0, progress: Progress | None = None,
          notify: Callable[[str], None] | None = None, memory_check: bool = True, offload: bool = False,
          timeout: float | None = None, **options) -> dict:
    """Train an output of `upcycle` or `merge` on `text` for `tokens` tokens: next-token loss plus Mixtral's
    load-balancing loss, the expert load recorded as it trains (moeify.tuning.lm); written back to `out` all or
    nothing. Returns the new report.json (its "training" record). options: lr, train_router, train_experts,
    train_attention, aux_loss_coef, seq_len, step_tokens, seed (moeify.tuning.lm.TrainOptions). resume: continue
    an interrupted run with its own settings (options given must agree). Under torchrun the model is sharded
    across the processes; offload: its state in host memory; timeout: seconds a rank waits for the others."""
    from .tuning.lm import TrainOptions, train_output

    given = {k: v for k, v in options.items() if v is not None}
    names = [f.name for f in dataclasses.fields(TrainOptions)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise MoeifyError(f"train() got unknown option(s): {', '.join(unknown)}",
                          f"the options are TrainOptions' fields: {', '.join(names)}")
    files = tuple(str(f) for f in text)
    if resume:
        return train_output(out, None, resume=True, device=device, save_every=save_every, progress=progress,
                            notify=notify, memory_check=memory_check, offload=offload, timeout=timeout,
                            given={**given, **({"text": files} if files else {}),
                                   **({"tokens": tokens} if tokens is not None else {})})
    if tokens is None:
        raise MoeifyError("tokens is required (the training budget of this run)",
                          f"e.g. moeify tune {out} --tune-text corpus.txt --tokens 1048576")
    return train_output(out, TrainOptions(tokens=tokens, text=files, **given), restart=restart, device=device,
                        save_every=save_every, progress=progress, notify=notify, memory_check=memory_check,
                        offload=offload, timeout=timeout)


def evaluate(models: Sequence[str | Path], data: str | Path | None = None, *, tasks: str | Sequence[str] | None = None,
             task_dir: str | Path | None = None, task_data: str | Path | None = None, limit: int | None = None,
             task_batch_size: int = 16, task_cache: str | Path | None = None, progress: Progress | None = None,
             **settings):
    """Perplexity of every model (folders or Hub ids; the first is the reference) on the same tokens and windows,
    with parameters, tokens/s and routing statistics (moeify.evaluation.perplexity.EvalResult). settings: seq_len, stride,
    max_tokens, batch_size, device, dtype, oracle, kl, generation (moeify.evaluation.perplexity.EvalSettings).

    tasks ("arc_easy,piqa" or a list; needs `pip install 'moeify[tasks]'`): also zero-shot accuracy through
    lm-evaluation-harness on the same items for every model (result.tasks: value ± SE, difference to the first model
    ± paired SE), and generation health (each model's .generation) unless generation=False. A task is looked up in
    task_dir (lm-eval task YAMLs), then among the six bundled definitions over the files in task_data (or
    $MOEIFY_TASK_DATA), then in lm-eval's registry (data from the Hub). limit: the first N items of each task;
    task_batch_size: contexts (with their choices) per forward. task_cache: a folder where each model's answers are kept as
    they are computed (moeify.evaluation.tasks.AnswerCache): an interrupted run resumes there, a model scored before is not
    scored again.
    Each moeify output among the others records its numbers beside the first model's in its card (OUT/README.md,
    OUT/evaluation.json)."""
    from dataclasses import asdict

    from .formats.card import record_evaluation
    from .evaluation.perplexity import EvalSettings, evaluate as run
    from .formats.hub import hub_origin

    loaded, scored, visit = None, [], None
    if tasks is not None:  # every task file and name checked before any model is loaded
        from .evaluation.tasks import compare_tasks, load_tasks, score_tasks
        from .formats.text import load_tokenizer

        loaded = load_tasks(tasks, task_dir=task_dir, task_data=task_data, limit=limit)
        if settings.get("generation") is None:
            settings["generation"] = True

        def visit(model, path: Path, label: str) -> None:
            tick = (lambda done, total: progress(f"tasks {label}", done, total)) if progress else None
            scored.append(score_tasks(model, load_tokenizer(path), loaded, path, task_batch_size, tick, task_cache))
    elif task_dir is not None or task_data is not None or limit is not None or task_cache is not None:
        raise MoeifyError("--task-dir, --task-data, --limit and --task-cache go with --tasks", "name the tasks, "
                          "e.g. --tasks arc_easy,piqa")
    result = run([resolve(m, what="model") for m in models], data, EvalSettings(**settings), progress=progress,
                 visit=visit)
    if loaded is not None:
        result.tasks = compare_tasks(loaded, scored)
    whole = result.to_json()
    for m in result.models[1:]:  # a moeify output here (not a Hub download) keeps its numbers in its card
        path = Path(m.path)
        if (path / "moeify.toml").is_file() and (path / "report.json").is_file() and hub_origin(path) is None:
            record_evaluation(path, whole, asdict(result.models[0]), asdict(m))
    return result


def plan(src: str | Path, *, preset: str | Path | None = None, experts: int | None = None,
         top_k: int | None = None, shared: int | None = None, expert_width: int | None = None,
         serve: str | None = None):
    """Parameters, active parameters and FFN FLOPs per token of the MoE a preset (or explicit counts) makes of
    `src`: a folder, a config.json, or a Hub id (only its config.json is fetched); with a preset, for the serving
    format `serve`, and the layout every format would get (.alternatives). Returns moeify.evaluation.planning.MoePlan."""
    from .formats.families import read_source_config
    from .evaluation.planning import plan_moe, plan_preset

    source = read_source_config(resolve(src, config_only=True))
    if preset is None and all(v is None for v in (experts, top_k, shared)):
        preset = DEFAULT_PRESET
    if preset is not None:
        return plan_preset(source, preset, experts=experts, shared=shared, top_k=top_k, expert_width=expert_width,
                           serve=serve)
    if serve is not None:
        raise MoeifyError(f"--serve {serve} chooses among a preset's layouts; explicit counts leave none to choose",
                          "pass a preset (e.g. --preset active-50), or drop --serve")
    return plan_moe(source, experts=8 if experts is None else experts, top_k=2 if top_k is None else top_k,
                    shared=0 if shared is None else shared, expert_width=expert_width)


def serve_layouts(src: str | Path, *, preset: str | Path | None = None, **counts) -> list[dict]:
    """The layout the preset (default: the recommended one, when no count is given) gets for each serving format."""
    from .formats.config import load_preset
    from .formats.families import read_source_config
    from .evaluation.planning import serve_alternatives

    given = {k: counts.get(k) for k in LAYOUT_FLAGS if counts.get(k) is not None}
    if preset is None and not given:
        preset = DEFAULT_PRESET
    if preset is None:
        return []
    values = {**load_preset(preset), **given}
    return serve_alternatives(values, read_source_config(resolve(src, config_only=True)), given)


def prepare_upcycle(src: str | Path, *, allow_pickle: bool = False, force: bool = False, max_shard_size=None,
                    weights: bool = True, **settings):
    """The upcycle's plan (moeify.upcycling.upcycle.UpcyclePlan: layout, parameters, engine notes) before anything is written
    (`moeify upcycle --dry-run` prints it). settings: UpcycleSettings' fields (copies, granularity, top_k,
    shared_width, format, symmetry, drop_share, noise_scale, router_std, aux_loss_coef, dtype, seed, targets).
    weights=False: from config.json alone (a Hub id fetches nothing else), a plan to print, not to run."""
    from .formats.config import parse_size
    from .upcycling.upcycle import UpcycleSettings, plan_upcycle

    known = {f.name for f in dataclasses.fields(UpcycleSettings)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise MoeifyError(f"upcycle() got unknown setting(s): {', '.join(unknown)}",
                          f"the settings are UpcycleSettings' fields: {', '.join(sorted(known))}")
    given = {k: v for k, v in settings.items() if v is not None}
    if max_shard_size is not None:
        given["max_shard_bytes"] = parse_size(max_shard_size)
    if isinstance(given.get("targets"), str):
        given["targets"] = tuple(t.strip() for t in given["targets"].split(",") if t.strip())
    elif given.get("targets") is not None:
        given["targets"] = tuple(given["targets"])
    return plan_upcycle(resolve(src, config_only=not weights), UpcycleSettings(**given), allow_pickle=allow_pickle,
                        force=force, weights=weights)


def run_upcycle_plan(plan, out: str | Path, *, overwrite: bool = False, progress: Progress | None = None,
                     check_text: Sequence[str | Path] | None = None, check_tokens: int = 512) -> dict:
    """Write the upcycle a prepared plan describes, checked against the source; returns report.json. The KL of the
    model as written is measured on check_text (default: the bundled sample; random tokens for a source without a
    tokenizer, and for an output that is the exact construction as written, whose KL its logit difference bounds
    and whose exactness any tokens show: no tokenizer is loaded). The text is read first; it is tokenized on the
    check's thread as the writing starts, and a tokenizer or text that fails stops the writer there, leaving
    nothing."""
    from functools import partial

    from .formats.text import read_texts, first_windows
    from .formats.config import BUNDLED_CALIB
    from .upcycling.upcycle import run_upcycle

    ids = None
    if check_text or not plan.exact and any((plan.src.path / f).is_file() for f in ("tokenizer.json",
                                                                                    "tokenizer.model")):
        text = read_texts(list(check_text) if check_text else [BUNDLED_CALIB])
        ids = partial(first_windows, plan.src.path, text, check_tokens, "--check-text")
    return run_upcycle(plan, out, overwrite=overwrite, progress=progress, check_ids=ids)


def upcycle(src: str | Path, out: str | Path, *, copies: int = 8, granularity: int = 1, top_k: int = 2,
            overwrite: bool = False, progress: Progress | None = None, check_text: Sequence[str | Path] | None = None,
            check_tokens: int = 512, allow_pickle: bool = False, force: bool = False, **settings) -> dict:
    """An MoE whose experts are copies of each dense FFN of `src` (a folder or a Hub id), for MoE training:
    `copies` copies, each cut into `granularity` slices (fine-grained experts), `top_k` (a multiple of granularity)
    a token; exact at initialisation under the class's own routing (checked against the source before the output is
    committed) unless settings' symmetry breaking (drop, noise) makes the copies differ. settings: shared_width,
    format, symmetry, drop_share, noise_scale, router_std, dtype, seed, targets, max_shard_size. check_text: text
    files for the KL to the source of the model as written (default: the bundled sample). Returns report.json."""
    plan = prepare_upcycle(src, copies=copies, granularity=granularity, top_k=top_k, allow_pickle=allow_pickle,
                           force=force, **settings)
    return run_upcycle_plan(plan, out, overwrite=overwrite, progress=progress, check_text=check_text,
                            check_tokens=check_tokens)


def merge(sources: Sequence[str | Path] | None, out: str | Path, *, config: str | Path | None = None,
          base: str | Path | None = None, granularity: int = 1, top_k: int | None = None, attention: str = "base",
          gate_mode: str | None = None, router_text: Sequence[str | Path] | None = None, router_tokens: int = 2048,
          overwrite: bool = False, progress: Progress | None = None, check_text: Sequence[str | Path] | None = None,
          check_tokens: int = 512, allow_pickle: bool = False, force: bool = False,
          on_plan: Callable[[object], None] | None = None, **settings) -> dict:
    """One MoE from several fine-tunes of one base (folders or Hub ids, same shapes and tokenizer): each source's FFN
    one expert (or `granularity` slices), top_k of them a token (default: 2 sources' worth); attention, norms and
    embeddings the base's (default: the first source) or the sources' average (attention="average").
    config: a mergekit-moe YAML (moeify.merging.spec) naming the base, the sources, their prompts and the rest;
    arguments given here override it (sources then None). Its shared expert (shared_experts, Qwen2-MoE) is its
    source's whole FFN beside the routed ones, each half of the layer's output at its resting gate (so a merge of
    the base's FFN everywhere computes the base), gated by its prompts' row when it has prompts. gate_mode: how the
    router rows are made (moeify.merging.spec.GATE_MODES; default: the config's, router_input with router_text, else
    random).
    router_text: one text file per source, in order (gate mode router_input). settings: format, dtype, seed,
    symmetry (default none), targets, max_shard_size, router_std. on_plan: called with the plan
    (moeify.upcycling.upcycle.UpcyclePlan: its layout, engine_notes) before anything is written. Returns report.json."""
    from .merging.merge import prepare_merge

    plan = prepare_merge(sources, out, config=config, base=base, granularity=granularity, top_k=top_k,
                         attention=attention, gate_mode=gate_mode, router_text=router_text,
                         router_tokens=router_tokens, overwrite=overwrite, allow_pickle=allow_pickle, force=force,
                         progress=progress, **settings)
    if on_plan is not None:
        on_plan(plan)
    return run_upcycle_plan(plan, out, overwrite=overwrite, progress=progress, check_text=check_text,
                            check_tokens=check_tokens)


__all__ = ["Conversion", "convert", "tune", "train", "evaluate", "plan", "prepare_conversion", "run_prepared", "serve_layouts",
           "upcycle", "prepare_upcycle", "run_upcycle_plan", "merge", "MoeifyError"]
