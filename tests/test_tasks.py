"""`moeify eval --tasks`: zero-shot accuracy through lm-evaluation-harness against a hand computation of the same
log-likelihoods, the paired SE, the bundled task definitions against the harness's own, errors, card, 80 columns."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_dense, corpus_text
from test_eval import error_line, run_cli
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError
from moeify.evaluation.perplexity import (generation_prompts, greedy_repetition, mean_and_se, paired_difference,
                               repeated_ngram_share)

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install -e '.[tasks]'")

WORDS = corpus_text(6000).split()
MC_ITEMS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """A dense llama and its top-2-of-4 Mixtral carve (a moeify output, so it has a card)."""
    root = tmp_path_factory.mktemp("tasks")
    dense = build_dense(root / "dense", tokenizer_dir)
    run_conversion(plan_conversion(dense, build_config(experts=4, top_k=2)), root / "moe")
    return dense, root / "moe"


def mc_items() -> list[dict]:
    """Multiple-choice items from real words: 2-4 choices of different lengths, the answer anywhere."""
    items = []
    for i in range(MC_ITEMS):
        w = WORDS[i * 40:i * 40 + 40]
        n = 2 + i % 3
        items.append({"question": " ".join(w[:8]), "choices": [" ".join(w[10 + 5 * c:12 + 5 * c + c]) for c in range(n)],
                      "label": i % n})
    return items


def lastword_items() -> list[dict]:
    return [{"text": " ".join(WORDS[500 + 30 * i:500 + 30 * i + 12 + i])} for i in range(6)]


MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

LASTWORD_YAML = """task: tiny_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("task_dir")
    (d / "tiny_mc.yaml").write_text(MC_YAML.format(data=write_jsonl(d / "mc.jsonl", mc_items())))
    (d / "tiny_lastword.yaml").write_text(LASTWORD_YAML.format(data=write_jsonl(d / "lw.jsonl", lastword_items())))
    return d


# ------------------------------------------------------------------------------------ by hand


@torch.no_grad()
def loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) as the harness defines it: the continuation's tokens are those of
    context + continuation past the context's own tokens; and whether greedy decoding gives exactly them."""
    ctx = tok(context)["input_ids"]
    whole = tok(context + continuation)["input_ids"]
    cont = whole[len(ctx):]
    logits = model(torch.tensor([whole[:-1]])).logits[0, -len(cont):].float()
    logp = torch.log_softmax(logits, -1)
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logits.argmax(-1) == target).all())


def by_hand(path: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    acc, acc_norm, margins = [], [], []
    for item in mc_items():
        lls = [loglikelihood(model, tok, f"Question: {item['question']}\nAnswer:", " " + c)[0] for c in item["choices"]]
        norm = [ll / len(c) for ll, c in zip(lls, item["choices"])]
        acc.append(float(max(range(len(lls)), key=lls.__getitem__) == item["label"]))
        acc_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == item["label"]))
        margins += [sorted(lls)[-1] - sorted(lls)[-2], sorted(norm)[-1] - sorted(norm)[-2]]
    lw = [loglikelihood(model, tok, context, " " + word)
          for context, word in (i["text"].rsplit(" ", 1) for i in lastword_items())]
    return {"acc": acc, "acc_norm": acc_norm, "ll": [x[0] for x in lw], "greedy": [float(x[1]) for x in lw],
            "margin": min(margins)}


def test_accuracy_and_paired_se_equal_a_hand_computation_of_the_same_loglikelihoods(models, task_dir):
    import moeify

    dense, moe = models
    result = moeify.evaluate([dense, moe], tasks="tiny_mc,tiny_lastword", task_dir=task_dir, device="cpu",
                             max_tokens=256, seq_len=64, oracle=False, kl=False, generation=False)
    hand = [by_hand(dense), by_hand(moe)]
    assert hand[0]["margin"] > 1e-3 and hand[1]["margin"] > 1e-3  # no near-tie a float rounding could flip
    assert hand[0]["acc"] != hand[1]["acc"]  # the two models differ on some item: the paired SE is not trivially 0
    tasks = result.tasks["tasks"]
    assert tasks["tiny_mc"]["n"] == MC_ITEMS and tasks["tiny_lastword"]["n"] == 6
    for metric in ("acc", "acc_norm"):
        ref, moe_entry = tasks["tiny_mc"]["metrics"][metric]
        for entry, h in zip((ref, moe_entry), hand):
            assert (entry["value"], entry["se"]) == pytest.approx(mean_and_se(h[metric]), abs=1e-12)
        diffs = [b - a for a, b in zip(hand[0][metric], hand[1][metric])]
        mean = sum(diffs) / len(diffs)
        paired = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
        assert (moe_entry["diff"], moe_entry["diff_se"]) == pytest.approx((mean, paired), abs=1e-12)
        assert ref["diff"] is None and moe_entry["path"] == str(moe)
    ppl = tasks["tiny_lastword"]["metrics"]["perplexity"]
    for entry, h in zip(ppl, hand):
        assert entry["value"] == pytest.approx(math.exp(-sum(h["ll"]) / len(h["ll"])), rel=1e-4)
    ratio = math.exp(sum(a - b for a, b in zip(hand[0]["ll"], hand[1]["ll"])) / len(hand[0]["ll"]))
    assert ppl[1]["diff"] == pytest.approx(ratio, rel=1e-4)
    for entry, h in zip(tasks["tiny_lastword"]["metrics"]["acc"], hand):
        assert entry["value"] == pytest.approx(sum(h["greedy"]) / len(h["greedy"]))
    assert all(m.generation is None for m in result.models)  # generation=False: accuracy alone


def test_kept_answers_resume_an_interrupted_run_and_spare_a_model_scored_before(models, task_dir, tmp_path):
    """--task-cache: each answer kept as computed; a run stopped part-way resumes from them (a line a kill cut short
    skipped), a model scored before computes nothing, and every item's value is the uncached run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moeify
    import moeify.evaluation.tasks as tasks

    dense, _ = models
    loaded = tasks.load_tasks("tiny_mc,tiny_lastword", task_dir=task_dir)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(dense)
    plain = tasks.score_tasks(model, tok, loaded, dense, 4)
    n = 23 + 6  # the multiple-choice items' 2-4 choices, and the last-word items: one request each
    stopped = []

    def stop(done, total):  # a tick a forward: up to 2 contexts (their 2-4 choices each) with batch size 2
        if done >= 10:
            stopped.append(done)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tasks.score_tasks(model, tok, loaded, dense, 2, stop, cache=tmp_path / "kept")
    (kept,) = (tmp_path / "kept").glob("*.jsonl")
    assert 10 <= stopped[0] < n and kept.name.startswith("dense-")
    assert len(kept.read_text().splitlines()) == stopped[0]  # every answer given before the stop kept
    with open(kept, "a") as fh:
        fh.write('{"k": "0123", "ll": -1.')  # a kill in the middle of a line
    ticks = []
    resumed = tasks.score_tasks(model, tok, loaded, dense, 2, lambda d, t: ticks.append((d, t)),
                                cache=tmp_path / "kept")
    assert resumed.reused == stopped[0] and stopped[0] < ticks[0][0] < n and ticks[-1] == (n, n)
    again = tasks.score_tasks(model, tok, loaded, dense, 2, cache=tmp_path / "kept")
    assert again.reused == n and len(tasks.AnswerCache(kept).answers) == n
    for got in (resumed, again):
        for task, metrics in plain.items.items():
            for metric, values in metrics.items():
                assert got.items[task][metric] == pytest.approx(values, abs=1e-5), (task, metric)
    assert again.items == resumed.items  # the kept floats read back exactly
    tasks.score_tasks(model, tok, loaded, dense, 4, cache=tmp_path / "kept")  # another batch size: its own file
    assert len(list((tmp_path / "kept").glob("dense-*.jsonl"))) == 2
    with pytest.raises(MoeifyError, match="--task-cache go with --tasks"):
        moeify.evaluate([dense], task_cache=tmp_path / "kept")


def test_paired_and_unpaired_statistics():
    assert mean_and_se([1.0, 0.0, 1.0, 0.0]) == pytest.approx((0.5, math.sqrt(1 / 3 / 4)))
    assert mean_and_se([0.25]) == (0.25, 0.0)
    # the same items right and wrong: the paired SE of the difference is 0, the unpaired one would not be
    a, b = [1.0, 0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0, 0.0]
    diff, se = paired_difference(a, b)
    assert diff == pytest.approx(-0.2) and se == pytest.approx(math.sqrt(0.2 * 0.8 * 5 / 4 / 5))
    assert paired_difference(a, a) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same items"):
        paired_difference(a, b[:3])


def test_repeated_ngram_share():
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 / 5)  # (1,2,3,4) twice in 5
    assert repeated_ngram_share([7] * 10, 4) == pytest.approx(6 / 7)  # a loop: every 4-gram but the first repeats
    assert repeated_ngram_share(list(range(64)), 4) == 0.0
    assert repeated_ngram_share([1, 2, 3], 4) == 0.0  # no 4-gram at all
    assert repeated_ngram_share([1, 2, 1, 2, 1], 2) == pytest.approx(1 - 2 / 4)


@torch.no_grad()
def test_greedy_repetition_equals_a_hand_greedy_loop(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense, _ = models
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(dense)
    prompts = generation_prompts(torch.tensor(tok(corpus_text(4000))["input_ids"]), n=3, length=16)
    shares = greedy_repetition(model, prompts, new_tokens=24)
    for prompt, share in zip(prompts, shares):
        ids = prompt.tolist()
        for _ in range(24):
            logits = model(torch.tensor([ids])).logits[0, -1]
            logits[tok.eos_token_id] = -math.inf  # as min_new_tokens does: every continuation is 24 tokens
            ids.append(int(logits.argmax()))
        assert share == pytest.approx(repeated_ngram_share(ids[16:], 4))
    with pytest.raises(MoeifyError, match="too few"):
        generation_prompts(torch.arange(10), length=32)


# --------------------------------------------------------------------- the bundled definitions


HARNESS = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml",
           "hellaswag": "hellaswag/hellaswag.yaml", "boolq": "super_glue/boolq/default.yaml",
           "lambada_openai": "lambada/lambada_openai.yaml"}
ITEMS = {  # a few items in the fields of shared/tasks (its README), with what the prompts must handle
    "arc_easy/test.jsonl": [
        {"id": "a1", "question": "Which gas do plants take in?", "choices": {"text": ["oxygen", "carbon dioxide",
         "helium", "neon"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
        {"id": "a2", "question": "What are genes composed of?", "choices": {"text": ["DNA", "salt", "air"],
         "label": ["A", "B", "C"]}, "answerKey": "A"}],
    "arc_challenge/test.jsonl": [
        {"id": "c1", "question": "A student heats water. What happens?", "choices": {"text": ["it boils", "it freezes",
         "nothing", "it glows", "it sings"], "label": ["A", "B", "C", "D", "E"]}, "answerKey": "A"}],
    "piqa/validation.jsonl": [
        {"goal": "How do I ready a cage?", "sol1": "Add  bedding.", "sol2": "Add water to the floor. ", "label": 0}],
    "hellaswag/validation.jsonl": [
        {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
         "ctx": "A man is sitting on a roof. he", "endings": ["is using wrap.", "is ripping tiles off.",
                                                             "is holding a cube.", "starts pulling up roofing."],
         "label": "3"},
        {"activity_label": "Home and Garden", "ctx_a": "[header] How to clean a grill [title] Heat it.", "ctx_b": "",
         "ctx": "[header] How to clean a grill [title] Heat it.", "endings": ["[step] Scrub it.", "Sing.", "Paint it.",
                                                                             "[substeps] Leave."], "label": "0"}],
    "boolq/validation.jsonl": [
        {"question": "is ethanol a fuel", "passage": "Ethanol fuel -- Ethanol is burned as fuel.", "idx": 0,
         "label": 1}],
    "lambada_openai/test.jsonl": [
        {"text": "He looked at the door.\n\n\"Come in,\" she said, and he walked through the door"},
        {"text": "The  cat sat on the mat"}],
}


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("task_data")
    for rel, items in ITEMS.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(d / rel, items)
    return d


REQUESTS = {"arc_easy": 7, "arc_challenge": 5, "piqa": 2, "hellaswag": 8, "boolq": 2, "lambada_openai": 2}


def requests_of(cfg: dict) -> list:
    """The (context, continuation) pairs lm-eval builds for every item."""
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_defaults=False).load([cfg])["tasks"][cfg["task"]]
    task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    return [inst.args for inst in task.instances]


@pytest.mark.parametrize("name", list(HARNESS))
def test_bundled_definition_gives_the_harness_prompts(name, task_data):
    """Each bundled YAML against the harness's own installed config for the task, read from the same local files:
    the same contexts and continuations for every item, the same metrics (only the data source differs)."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    from moeify.evaluation.tasks import bundled_config

    ours = bundled_config(name, task_data)
    theirs = load_yaml(Path(lm_eval.tasks.__file__).parent / HARNESS[name], resolve_func=True)
    splits = ours["dataset_kwargs"]["data_files"]
    theirs.update(dataset_path="json", dataset_name=None, dataset_kwargs=ours["dataset_kwargs"],
                  **{f"{s}_split": (s if s in splits else None) for s in ("training", "validation", "test")})
    assert theirs["task"] == name and ours["output_type"] == theirs["output_type"]
    assert [m["metric"] for m in ours["metric_list"]] == [m["metric"] for m in theirs["metric_list"]]
    our_requests = requests_of(ours)
    assert our_requests == requests_of(theirs)
    assert len(our_requests) == REQUESTS[name]  # every choice of every item (one request per LAMBADA passage)
    if name == "hellaswag":  # the harness's preprocess ran: markup gone, ctx_b capitalised
        assert our_requests[0][0] == "Roof shingle removal: A man is sitting on a roof. He"
        assert "[" not in our_requests[4][0] and our_requests[4][1] == "  Scrub it."


# ------------------------------------------------------------------------------------ errors, CLI, card


def test_errors_are_one_line_and_exit_2_before_any_model_loads(models, task_dir, task_data, tmp_path, monkeypatch):
    dense, moe = models
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    code, out = run_cli("eval", dense, moe, "--tasks", "broken", "--task-dir", bad)
    assert code == 2 and "--task-dir" in error_line(out) and "broken.yaml" in out
    (tmp_path / "empty").mkdir()
    code, out = run_cli("eval", dense, "--tasks", "arc_easy", "--task-data", tmp_path / "empty")
    line = error_line(out)
    assert code == 2 and "--task-data" in line and "arc_easy/test.jsonl" in line
    code, out = run_cli("eval", dense, "--task-data", task_data)
    assert code == 2 and "--tasks" in error_line(out)
    code, out = run_cli("eval", dense, "--tasks", "arc_easy", "--task-data", task_data, "--limit", 0)
    assert code == 2 and "--limit 0" in error_line(out)
    code, out = run_cli("eval", dense, moe, "--tasks", "tiny_mc,no_such_task", "--task-dir", task_dir)
    line = error_line(out)
    assert code == 2 and "no_such_task" in line and "--task-dir" in line
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    code, out = run_cli("eval", dense, moe, "--tasks", "arc_easy")
    line = error_line(out)
    assert code == 2 and "--tasks" in line and "moeify[tasks]" in line
    with pytest.raises(MoeifyError, match="moeify\\[tasks\\]"):
        __import__("moeify").evaluate([dense], tasks="arc_easy")


def test_cli_tasks_table_fits_80_columns_json_and_card(models, task_dir, task_data, tmp_path):
    dense, moe = models
    code, out = run_cli("eval", dense, moe, "--tasks", "tiny_mc,arc_easy,lambada_openai", "--task-dir", task_dir,
                        "--task-data", task_data, "--limit", 5, "--max-tokens", 300, "--seq-len", 64, "--no-oracle",
                        "--json", tmp_path / "eval.json", "--task-cache", tmp_path / "answers")
    assert code == 0, out
    assert sorted(f.name.split("-")[0] for f in (tmp_path / "answers").glob("*.jsonl")) == ["dense", "moe"]
    data = json.loads((tmp_path / "eval.json").read_text())
    tasks = data["tasks"]["tasks"]
    assert data["tasks"]["limit"] == 5 and tasks["tiny_mc"]["n"] == 5 and tasks["tiny_mc"]["of"] == MC_ITEMS
    assert tasks["arc_easy"]["n"] == 2 and "bundled definition" in tasks["arc_easy"]["origin"]
    lines = out.splitlines()  # CliRunner's terminal: 80 columns
    legend = [ln for ln in lines if ln.startswith("  ") and " (" in ln]
    paths = [ln for ln in lines if ln.startswith("wrote ")]  # a path as long as the test's temporary folder
    assert all(len(ln) <= 80 for ln in lines if ln not in legend + paths), "\n".join(ln for ln in lines if len(ln) > 80)
    acc = tasks["tiny_mc"]["metrics"]["acc"]
    rows = [ln.split() for ln in lines]
    assert ["tiny_mc", "acc", "A", f"{acc[0]['value']:.4f}", f"{acc[0]['se']:.4f}", "ref"] in rows
    assert ["5", "of", "8", "items", "acc", "B", f"{acc[1]['value']:.4f}", f"{acc[1]['se']:.4f}",
            f"{acc[1]['diff']:+.4f}", f"{acc[1]['diff_se']:.4f}"] in rows
    assert "generation health" in out and any(r[:1] == ["B"] and len(r) == 5 for r in rows)
    kept = data["tasks"]["retention"]  # tiny random models: which tasks clear chance is whatever it is
    assert kept["informative_ses"] == 3 and set(kept["tasks"]) == {"tiny_mc", "arc_easy", "lambada_openai"}
    assert ("B keeps" in out) == bool(kept["informative"]) and ("clear of chance" in out) != bool(kept["informative"])
    gen = [m["generation"] for m in data["models"]]  # beside accuracy: 9 prompts of 32 fit in the 300 tokens
    assert all(0 <= g["repeated"] <= 1 and len(g["per_prompt"]) == 9 for g in gen)
    assert gen[0]["diff"] is None and (gen[1]["diff"], gen[1]["diff_se"]) == pytest.approx(
        paired_difference(gen[0]["per_prompt"], gen[1]["per_prompt"]))
    card = (moe / "README.md").read_text()
    assert "Zero-shot tasks by `moeify eval --tasks`" in card and "| tiny_mc | acc_norm | 5 of 8 |" in card
    assert "| lambada_openai | perplexity | 2 |" in card and "Generation health: repeated 4-grams" in card
    assert json.loads((moe / "evaluation.json").read_text())["tasks"]["limit"] == 5
    code, out = run_cli("eval", dense, moe, "--max-tokens", 300, "--seq-len", 64, "--no-oracle", "--no-kl")
    assert code == 0 and "zero-shot" not in out  # perplexity only; the card keeps the tasks measured before
    assert "| tiny_mc | acc_norm | 5 of 8 |" in (moe / "README.md").read_text()


def test_bench_tasks_writes_the_result_file(models, task_data, tmp_path, capsys):
    """scripts/bench_tasks.py: per task n, acc (± SE) per model and each MoE's difference with its paired SE, by
    folder name (no local path in the file)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_tasks

    dense, moe = models
    out = tmp_path / "tasks.json"
    assert bench_tasks.main([str(dense), str(moe), "--task-data", str(task_data), "--tasks", "arc_easy,boolq",
                             "--limit", "2", "--max-tokens", "300", "--device", "cpu", "--out", str(out),
                             "--cache", str(tmp_path / "kept")]) == 0
    s = json.loads(out.read_text())
    assert s["limit"] == 2 and s["reference"] == "dense" and set(s["tasks"]) == {"arc_easy", "boolq"}
    arc = s["tasks"]["arc_easy"]
    assert arc["n"] == 2 and set(arc["models"]["dense"]) == {"acc", "acc_norm"}
    assert set(arc["models"]["moe"]["acc"]) == {"value", "se", "diff", "diff_se", "relative"}
    assert arc["models"]["moe"]["acc"]["diff"] == pytest.approx(arc["models"]["moe"]["acc"]["value"]
                                                                - arc["models"]["dense"]["acc"]["value"])
    assert str(dense.parent) not in out.read_text() and "wrote" in capsys.readouterr().out
    assert s["task_answers_reused"] == [0, 0] and len(list((tmp_path / "kept").glob("*.jsonl"))) == 2


def test_retention_line_in_the_report_and_the_card(tmp_path):
    """The pooled retention as `eval --tasks` prints it (80 columns) and the card states it."""
    from rich.console import Console

    from moeify.formats.card import _task_lines
    from moeify.cli.report import print_retention

    r = {"informative_ses": 3, "informative": ["arc_easy", "piqa"],
         "tasks": {"arc_easy": {"metric": "acc", "chance": 0.25, "informative": True},
                   "piqa": {"metric": "acc_norm", "chance": 0.5, "informative": True},
                   "boolq": {"metric": "acc", "chance": 0.62, "informative": False}},
         "models": [{"path": "moe", "retention": 0.8123, "retention_se": 0.0114, "margin_kept": 0.5432,
                     "margin_kept_se": 0.0301, "tasks": {"arc_easy": {}, "piqa": {}}}]}
    console = Console(width=80, record=True)
    print_retention(console, r, ["dense", "moe"])
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    text = " ".join(text.split())  # as read, whatever the wrapping
    assert "moe keeps 81.2% ± 1.1% of dense's accuracy (its margin above chance: 54.3% ± 3.0%)" in text
    assert "arc_easy acc, piqa acc_norm" in text and "left out as no better than chance: boolq" in text
    ev = {"models": [{"name": "dense"}, {"name": "moe"}],
          "tasks": {"lm_eval": "0.4.13", "limit": 1000, "rows": [], "retention": r["models"][0]}}
    assert ("- Retention: moe keeps 81.2% ± 1.1% of dense's accuracy, 54.3% ± 3.0% of its margin above chance "
            "(mean over arc_easy, piqa; paired standard errors).") in _task_lines(ev)
