"""Zero-shot task accuracy through lm-evaluation-harness (lm-eval 0.4): the one module that imports lm-eval.

    --tasks NAMES ──► specs: a task in --task-dir's YAMLs; else one of the six bundled definitions
                      (moeify/data/tasks/*.yaml) over --task-data's files; else lm-eval's own registry (Hub data)
                  ──► loaded once, before any model (a missing name, a bad file, absent data: one clear line)
                  ──► each model in turn: lm-eval's HFLM over the already-loaded model, lm_eval.evaluator.evaluate
                      with log_samples: every item's metric values (acc, acc_norm; LAMBADA's per-item
                      log-likelihood for its perplexity), as the harness computed them; with a cache folder, each
                      answer kept as it is computed (AnswerCache), so an interrupted run resumes and a model
                      scored before is not scored again
                  ──► compare_tasks: every model on the same items; value ± SE, and the difference to the first
                      model ± its paired SE (moeify.evaluation.perplexity.paired_difference)

Nothing else in moeify imports lm_eval; without it installed `--tasks` says what to install (require_lm_eval).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from . import loglik
from ..errors import MoeifyError
from ..maths.stats import kept_share, kept_share_difference, mean_and_se, paired_difference, pooled
from ..formats.text import first_line

BUNDLED = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "boolq", "lambada_openai")
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "data" / "tasks"  # the YAMLs; their data paths are relative
TASK_DATA_ENV = "MOEIFY_TASK_DATA"  # the folder of the six tasks' files when --task-data is not given
INSTALL = "pip install 'moeify[tasks]' (lm-eval 0.4 and accelerate)"
OFFLINE_HINT = (f"offline: --task-data DIR (a folder of the six tasks' files, e.g. shared/tasks; or ${TASK_DATA_ENV}) "
                "or --task-dir DIR (your own lm-eval task YAMLs over local files)")
# each task's reading (the metric the field reports it by: length-normalised where choices differ in length)
PRIMARY = {"arc_easy": "acc", "arc_challenge": "acc_norm", "piqa": "acc_norm", "hellaswag": "acc_norm",
           "boolq": "acc", "lambada_openai": "acc"}
INFORMATIVE_SES = 3  # a task counts towards retention when the first model is this many SEs above chance
TOKENS_PER_ROW = 256  # a forward holds up to batch_size contexts and batch_size x this many tokens (padded)


@dataclass
class LoadedTasks:
    """The tasks of one `--tasks`, loaded once and run on every model."""

    names: list[str]  # leaf task names, in the order given
    task_dict: dict  # lm-eval's TaskManager.load() result
    origin: dict[str, str]  # task name -> where its definition and data come from
    limit: int | None
    lm_eval_version: str


@dataclass
class ModelTasks:
    """One model's per-item values, task -> metric -> {doc_id: value}, as the harness logged them."""

    path: str
    items: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    chance: dict[str, dict[int, float]] = field(default_factory=dict)  # task -> {doc_id: accuracy by chance}
    seconds: float = 0.0
    reused: int = 0  # answers read from the cache, not computed (their time is not in seconds)


class AnswerCache:
    """One model's log-likelihood answers, (log-likelihood, greedy) per (context, continuation), kept in a JSON Lines
    file that grows as they are computed (floats written exactly): a run stopped part-way resumes from them, and a
    model scored before is not scored again. The file is named by what the answers depend on (cache_key), so a
    model rewritten in place, another dtype, device type or batch size, or another lm-eval gets a file of its own;
    a line cut short by an interruption is skipped."""

    def __init__(self, path: Path):
        self.path = path
        self.answers: dict[str, tuple[float, bool]] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.answers[rec["k"]] = (float(rec["ll"]), bool(rec["greedy"]))
                except (ValueError, KeyError, TypeError):
                    continue

    @staticmethod
    def key(args) -> str:
        return hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()[:32]

    def add(self, keys: list[str], answers: list) -> None:
        """Keep these answers (appended and flushed: an interruption loses at most the batch being written)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = False
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                cut = fh.read(1) != b"\n"
        with open(self.path, "a") as fh:
            if cut:  # a line an interruption cut short: the next record starts on a line of its own
                fh.write("\n")
            for k, (ll, greedy) in zip(keys, answers):
                fh.write(json.dumps({"k": k, "ll": float(ll), "greedy": bool(greedy)}) + "\n")
                self.answers[k] = (float(ll), bool(greedy))


def cache_key(path: str | Path, model, batch_size: int) -> str:
    """What a model's task answers depend on: its config and weights (moeify.formats.checkpoint.weights_fingerprint), the
    dtype and device type it runs in, the batch size (padding changes the last bits), and lm-eval's version."""
    import lm_eval

    from ..formats.checkpoint import hash_files, weights_fingerprint

    h = hashlib.sha256(b"moeify task answers 2")
    hash_files(h, Path(path), ["config.json"])
    weights_fingerprint(h, Path(path))
    h.update(f"{model.dtype}|{model.device.type}|{batch_size}|{lm_eval.__version__}".encode())
    return h.hexdigest()[:16]


def require_lm_eval() -> None:
    """Fail, before any work, when lm-eval (or the accelerate package its HFLM wrapper imports) is missing."""
    try:
        import lm_eval.evaluator  # noqa: F401
        import lm_eval.models.huggingface  # noqa: F401
        import lm_eval.tasks._yaml_loader  # noqa: F401  (0.4.13+)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "lm_eval"
        raise MoeifyError(f"--tasks needs lm-evaluation-harness, and {missing} cannot be imported", INSTALL) from None


def task_names(tasks: str | Sequence[str]) -> list[str]:
    """'arc_easy, piqa' or ['arc_easy', 'piqa'] -> ['arc_easy', 'piqa'] (each once, in order)."""
    parts = tasks.split(",") if isinstance(tasks, str) else [p for t in tasks for p in str(t).split(",")]
    names = list(dict.fromkeys(p.strip() for p in parts if p.strip()))
    if not names:
        raise MoeifyError("--tasks names no task", f"e.g. --tasks {','.join(BUNDLED[:3])}")
    return names


def task_data_dir(task_data: str | Path | None) -> Path | None:
    """--task-data, else $MOEIFY_TASK_DATA, else None (the six tasks then come from lm-eval's registry and the Hub)."""
    given = task_data if task_data is not None else os.environ.get(TASK_DATA_ENV) or None
    if given is None:
        return None
    d = Path(given)
    flag = "--task-data" if task_data is not None else f"${TASK_DATA_ENV}"
    if not d.is_dir():
        raise MoeifyError(f"{flag} {d}: no such folder", "give the folder that holds arc_easy/test.jsonl, "
                          "piqa/validation.jsonl, ... (the layout of shared/tasks; docs/evaluating.md)")
    return d


def bundled_config(name: str, data: Path) -> dict:
    """The bundled definition of task `name` with its data files found in the folder `data`."""
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(BUNDLED_DIR / f"{name}.yaml", resolve_func=True)
    files = cfg["dataset_kwargs"]["data_files"]
    for split, rel in files.items():
        path = data / rel
        if not path.is_file():
            raise MoeifyError(f"--task-data {data}: no {rel} (the {name} {split} file)",
                              f"give the folder that holds {rel} (the layout of shared/tasks; docs/evaluating.md)")
        files[split] = str(path.resolve())
    return cfg


def _scan_task_dir(task_dir: Path) -> dict[str, Path]:
    """{task or group name: YAML file} of --task-dir; a file lm-eval cannot read is an error naming it (lm-eval
    itself would skip it silently, and the task would look missing)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not task_dir.is_dir():
        raise MoeifyError(f"--task-dir {task_dir}: no such folder", "give a folder of lm-eval task YAML files")
    found = {}
    for f in sorted(task_dir.rglob("*.yaml")):
        try:
            cfg = load_yaml(f, resolve_func=False)
        except Exception as exc:
            raise MoeifyError(f"--task-dir: {f} is not a valid lm-eval task file ({first_line(exc)})",
                              "fix it or move it out of the folder") from None
        name = cfg.get("task") if isinstance(cfg.get("task"), str) else cfg.get("group")
        if not isinstance(name, str):
            raise MoeifyError(f"--task-dir: {f} names no task (no 'task:' or 'group:' key)",
                              "an lm-eval task file starts with task: NAME")
        found.setdefault(name, f)
    return found


def load_tasks(tasks: str | Sequence[str], *, task_dir: str | Path | None = None,
               task_data: str | Path | None = None, limit: int | None = None) -> LoadedTasks:
    """Every named task's definition and data, loaded once (lm-eval's TaskManager), before any model is loaded."""
    require_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    names = task_names(tasks)
    if limit is not None and limit < 1:
        raise MoeifyError(f"--limit {limit} must be at least 1 (items per task)")
    local = _scan_task_dir(Path(task_dir)) if task_dir is not None else {}
    data = task_data_dir(task_data)
    specs, origin = [], {}
    for name in names:
        if name in local:
            specs.append((name, name, f"--task-dir {local[name]}"))
        elif name in BUNDLED and data is not None:
            specs.append((name, bundled_config(name, data), f"bundled definition over {data}"))
        else:
            specs.append((name, name, "lm-eval's registry (data from the Hugging Face Hub)"))
    registry = any(how.startswith("lm-eval's") for _, _, how in specs)
    with _quiet():
        manager = TaskManager(include_path=str(task_dir) if local else None, include_defaults=registry)
        loaded: dict = {"tasks": {}, "groups": {}, "group_map": {}}
        for name, spec, how in specs:
            if isinstance(spec, str) and spec not in manager.all_tasks:
                where = [f"--task-dir {task_dir}"] if task_dir is not None else []
                raise MoeifyError(f"--tasks {name}: no such task ({' or '.join(where + ['lm-eval registry'])} has "
                                  "none of that name)", f"the bundled definitions: {', '.join(BUNDLED)} (with "
                                  "--task-data); or give its YAML with --task-dir")
            try:
                part = manager.load([spec])
            except MoeifyError:
                raise
            except Exception as exc:
                hint = ("fix the task file" if how.startswith("--task-dir")
                        else OFFLINE_HINT if how.startswith("lm-eval's") else "check the data files")
                raise MoeifyError(f"--tasks {name} ({how}): lm-eval cannot load it ({type(exc).__name__}: "
                                  f"{first_line(exc)})", hint) from None
            for key in loaded:
                loaded[key].update(part.get(key, {}))
            for leaf in part["tasks"]:
                origin[leaf] = how
    for task in loaded["tasks"].values():  # as lm_eval.simple_evaluate prepares them: zero-shot unless the file says
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)
    return LoadedTasks(list(loaded["tasks"]), loaded, origin, limit, lm_eval.__version__)


@contextlib.contextmanager
def _quiet():
    """lm-eval's and datasets' own progress bars and info lines off: the command line draws its own progress."""
    from unittest import mock

    import datasets
    import lm_eval.api.task as task_module
    from tqdm import tqdm

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with mock.patch.object(task_module, "tqdm", lambda *a, **k: tqdm(*a, **{**k, "disable": True})):
            yield
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def score_tasks(model, tokenizer, loaded: LoadedTasks, path: str | Path, batch_size: int = 16,
                progress: Callable[[int, int], None] | None = None, cache: str | Path | None = None) -> ModelTasks:
    """Every task on the already-loaded `model`, through lm-eval's HFLM and evaluator; per-item values from the
    harness's per-sample log (log_samples). cache: a folder where the model's answers are kept as they are computed
    (AnswerCache: a run stopped part-way resumes there; answers found there are not computed again)."""
    import time

    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    reused = [0]
    kept = (AnswerCache(Path(cache) / f"{Path(path).name}-{cache_key(path, model, batch_size)}.jsonl")
            if cache is not None else None)

    class Counted(HFLM):  # lm-eval's requests, tokenization and metrics; the scoring packed (moeify.evaluation.loglik)
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            keys = [AnswerCache.key(r.args) for r in requests] if kept else []
            todo = [i for i, k in enumerate(keys) if k not in kept.answers] if kept else list(range(len(requests)))
            reused[0] += len(requests) - len(todo)
            out: dict[int, tuple[float, bool]] = {}

            def done(indices: list[int], answers: list[tuple[float, bool]]) -> None:
                if kept:
                    kept.add([keys[todo[j]] for j in indices], answers)
                out.update((todo[j], a) for j, a in zip(indices, answers))
                if progress:
                    progress(len(requests) - len(todo) + len(out), len(requests))

            if progress and not todo:  # every answer kept from before
                progress(len(requests), len(requests))
            self.answered = done
            if todo:
                super().loglikelihood([requests[i] for i in todo], disable_tqdm=True)
            return [out[i] if i in out else kept.answers[keys[i]] for i in range(len(requests))]

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            return loglik.score(self.model, [(ctx, cont) for _, ctx, cont in requests], self.max_length,
                                max_rows=batch_size, max_tokens=TOKENS_PER_ROW * batch_size, done=self.answered)

    t0 = time.perf_counter()
    with _quiet():
        lm = Counted(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = evaluate(lm=lm, task_dict=loaded.task_dict, limit=loaded.limit, bootstrap_iters=0, log_samples=True)
    result = ModelTasks(str(path), seconds=time.perf_counter() - t0, reused=reused[0])
    for name in loaded.names:
        per_metric: dict[str, dict[int, float]] = {}
        for sample in out["samples"][name]:
            for metric in sample["metrics"]:
                per_metric.setdefault(metric, {})[int(sample["doc_id"])] = float(sample[metric])
        result.items[name] = per_metric
        result.chance[name] = chance_by_item(out["samples"][name],
                                             loaded.task_dict["tasks"][name].get_config("output_type"))
    return result


def chance_by_item(samples: list[dict], output_type: str | None) -> dict[int, float]:
    """{doc_id: the accuracy of guessing}: 1 / the number of choices for a multiple-choice item; where every item
    offers the same choices (BoolQ's no / yes), the share of the commonest right answer (what always giving it
    scores); 0 for a task that is not multiple choice (LAMBADA's word)."""
    ids = [int(s["doc_id"]) for s in samples]
    if output_type != "multiple_choice":
        return dict.fromkeys(ids, 0.0)
    choices = [tuple(str(a[1]) for a in s["arguments"]) for s in samples]
    if len(set(choices)) == 1 and len(samples) > 1:
        targets = [str(s["target"]) for s in samples]
        return dict.fromkeys(ids, max(targets.count(t) for t in set(targets)) / len(targets))
    return {i: 1 / len(c) for i, c in zip(ids, choices)}


def compare_tasks(loaded: LoadedTasks, models: list[ModelTasks]) -> dict:
    """Per task and metric, every model's value ± SE on the same items, and its difference to the first model ±
    the paired SE. `perplexity` (LAMBADA) is exp(−mean log-likelihood): its SE by the delta method, and its
    difference to the first model as a ratio (×) with the paired SE of that ratio."""
    tasks = {}
    for name in loaded.names:
        ref = models[0].items[name]
        rows = {}
        for metric, ref_values in ref.items():
            ids = sorted(ref_values)
            for m in models[1:]:
                if sorted(m.items[name].get(metric, {})) != ids:
                    raise RuntimeError(f"{name}: {m.path} was scored on other items than {models[0].path}")
            a = [ref_values[i] for i in ids]
            entries = []
            for m in models:
                b = [m.items[name][metric][i] for i in ids]
                entries.append({"path": m.path, **_metric_entry(metric, a, b, m is models[0])})
            rows[metric] = entries
        task = loaded.task_dict["tasks"][name]
        tasks[name] = {"n": len(next(iter(ref.values()), {})), "of": _size(task), "origin": loaded.origin[name],
                       "num_fewshot": task.get_config("num_fewshot"), "metrics": rows}
    return {"lm_eval": loaded.lm_eval_version, "limit": loaded.limit, "tasks": tasks,
            "retention": retention(loaded, models), "seconds": [round(m.seconds, 1) for m in models],
            "reused": [m.reused for m in models]}


def primary_metric(task: str, metrics) -> str | None:
    """The metric a task is read by: PRIMARY's, else acc_norm, else acc (None: no accuracy to keep)."""
    for metric in (PRIMARY.get(task), "acc_norm", "acc"):
        if metric in metrics:
            return metric
    return None


def retention(loaded: LoadedTasks, models: list[ModelTasks]) -> dict:
    """How much of the first model's accuracy each other model keeps: per task (its primary metric) the ratio of
    accuracies and the share of the margin above chance kept, each ± its paired SE (stats.kept_share); pooled
    over the informative tasks (those where the first model is at least INFORMATIVE_SES standard errors above
    chance) as their mean ± sqrt(Σ SE²) / n."""
    ref = models[0]
    per_task, informative = {}, []
    for name in loaded.names:
        metric = primary_metric(name, ref.items[name])
        if metric is None:
            continue
        ids = sorted(ref.items[name][metric])
        a = [ref.items[name][metric][i] for i in ids]
        c = [ref.chance[name][i] for i in ids]
        value, se = mean_and_se(a)
        chance = math.fsum(c) / len(c)
        clear = value > chance and value - chance >= INFORMATIVE_SES * se
        per_task[name] = {"metric": metric, "chance": chance, "informative": clear}
        if per_task[name]["informative"]:
            informative.append(name)
    out = [_kept(ref, m, models[1] if m is not models[1] else None, per_task) for m in models[1:]]
    return {"tasks": per_task, "informative": informative, "informative_ses": INFORMATIVE_SES, "models": out}


def _kept(ref: ModelTasks, m: ModelTasks, first: ModelTasks | None, per_task: dict) -> dict:
    """One model's retention of `ref`'s accuracy, per informative task and pooled; with `first` (the first model
    compared), also the difference to its retention on the same items ± the paired SE (a lever against a baseline,
    a seed against its twin)."""
    tasks = {}
    for name, t in per_task.items():
        if not t["informative"]:
            continue
        ids = sorted(ref.items[name][t["metric"]])
        a, b = ([x.items[name][t["metric"]][i] for i in ids] for x in (ref, m))
        c = [ref.chance[name][i] for i in ids]
        (r, r_se), (k, k_se) = kept_share(a, b), kept_share(a, b, c)
        tasks[name] = {"retention": r, "retention_se": r_se, "margin_kept": k, "margin_kept_se": k_se}
        if first is not None:
            tasks[name]["vs_first"], tasks[name]["vs_first_se"] = kept_share_difference(
                a, [first.items[name][t["metric"]][i] for i in ids], b)
    entry: dict = {"path": m.path, "tasks": tasks}
    keys = ("retention", "margin_kept") + (("vs_first",) if first is not None else ())
    for key in keys if tasks else ():
        entry[key], entry[key + "_se"] = pooled([(t[key], t[key + "_se"]) for t in tasks.values()])
    return entry


def _metric_entry(metric: str, ref: list[float], values: list[float], is_ref: bool) -> dict:
    """One model's value ± SE of one metric, and (unless it is the reference) its difference to the reference on the
    same items ± the paired SE, and that difference relative to the reference's value."""
    if metric != "perplexity":
        value, se = mean_and_se(values)
        entry = {"value": value, "se": se, "diff": None, "diff_se": None, "relative": None}
        if not is_ref:
            diff, diff_se = paired_difference(ref, values)
            base = mean_and_se(ref)[0]
            entry.update(diff=diff, diff_se=diff_se, relative=diff / base if base else None)
        return entry
    mean_ll, se_ll = mean_and_se(values)  # per-item log-likelihoods of the target word
    ppl = math.exp(-mean_ll)
    entry = {"value": ppl, "se": ppl * se_ll, "diff": None, "diff_se": None, "relative": None}
    if not is_ref:
        d, d_se = paired_difference(values, ref)  # mean(ll_ref − ll_model): log of the perplexity ratio
        entry.update(diff=math.exp(d), diff_se=math.exp(d) * d_se, relative=math.exp(d) - 1)
    return entry


def _size(task) -> int | None:
    try:
        return len(task.eval_docs)
    except Exception:  # a task whose documents cannot be counted
        return None


__all__ = ["BUNDLED", "AnswerCache", "LoadedTasks", "ModelTasks", "load_tasks", "score_tasks", "compare_tasks",
           "require_lm_eval", "task_names"]
