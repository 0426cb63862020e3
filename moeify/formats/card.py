"""The model card every output carries: OUT/README.md, which the Hugging Face Hub shows for an uploaded model.

YAML front matter the Hub reads (huggingface_hub's ModelCardData: base_model where the source came from the Hub,
base_model_relation, library_name, pipeline_tag, tags, the source's licence where its card states one) and a body a
reader can act on: what was done (carved training-free, or tuned on N tokens), the layout (experts, shared expert,
top-k, active share, total and active parameters), how to load it in transformers, vLLM and llama.cpp, the quality
measured (the carve's per-layer error, tuning's held-out KL, and `moeify eval`'s perplexities once it has run), and
the recipe (OUT/moeify.toml). Written from the output's own files, with no network; convert writes it, tune and eval
write it again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..maths.budget import active_neuron_share

CARD = "README.md"
EVALUATION = "evaluation.json"  # `moeify eval`'s numbers for this output, which the card shows
LICENCE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "LICENCE.txt", "NOTICE")
MODEL_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


# a merge's router rows by gate mode (moeify.merging.spec.GATE_MODES), as the card says it
ROUTER_ROWS = {"text": "from each source's text (the mean router input, centred).",
               "router_input": "from each source's prompts or text (the mean router input, centred).",
               "hidden": "from each expert's prompts (the last token's hidden state entering the layer, as "
                         "mergekit-moe's gate_mode hidden).",
               "hidden_last": "from each expert's prompts (the last token's hidden state entering the layer).",
               "hidden_avg": "from each expert's prompts (the hidden state entering the layer, averaged).",
               "cheap_embed": "from each expert's prompts' token embeddings, the same in every layer.",
               "random": "random.", "uniform_random": "random (uniform)."}


def nats(kl: float) -> str:
    """A KL as people read it: 0 when identical by construction, "< 1e-8" under float32's resolution (a sum of
    rounding errors can come out below 0; a KL never is), else 4 significant digits."""
    return "0" if kl == 0 else "< 1e-8" if kl < 1e-8 else format(kl, ".4g")

def source_licence(src: Path) -> str | None:
    """The licence the source's own card states in its front matter (`license: apache-2.0`), if any."""
    card = Path(src) / CARD
    if not card.is_file() or not card.read_text(errors="replace").startswith("---"):
        return None  # no front matter: no licence stated
    try:
        from huggingface_hub import ModelCard

        value = ModelCard.load(card).data.to_dict().get("license")
    except Exception:  # a card that is not a Hub card: no licence to carry
        return None
    return value if isinstance(value, str) and value else None


def copy_licence(src: Path, out: Path) -> None:
    """The source's licence files go with the weights made from it."""
    for name in LICENCE_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copyfile(f, Path(out) / name)


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def render(out: Path, name: str | None = None) -> str:
    """The card of the output in `out` (its report.json, config.json, moeify.toml, evaluation.json)."""
    from huggingface_hub import ModelCardData

    from .hub import hub_origin

    out = Path(out)
    report = json.loads((out / "report.json").read_text())
    if report.get("construction") in ("upcycle", "merge"):
        return _render_upcycle(out, report, name)
    config = json.loads((out / "config.json").read_text())
    toml_text = (out / "moeify.toml").read_text()
    src = Path(report.get("source", ""))
    origin = hub_origin(src) if str(src) else None
    base = origin[0] if origin else src.name or "the dense model"
    fmt = report.get("format", config.get("model_type", ""))
    settings = report.get("settings", {})
    tuning = report.get("tuning") or {}
    tuned = int(tuning.get("tokens", 0))
    licence = source_licence(src) if src.is_dir() else None
    data = ModelCardData(base_model=origin[0] if origin else None, base_model_relation="finetune" if origin else None,
                         library_name="transformers", pipeline_tag="text-generation", license=licence,
                         tags=["moeify", "mixture-of-experts", "moe", fmt])
    experts, top_k, shared = settings.get("experts"), settings.get("top_k"), settings.get("shared", 0)
    width, shared_width = report.get("expert_width"), report.get("shared_width", 0)
    carved = [e for e in report.get("layers", []) if not e.get("dense")]
    title = name or out.resolve().name
    done = (f"then recovery-tuned on {tuned:,} tokens (KL distillation of the experts and routers towards the dense "
            "model)" if tuned else "training-free (no tuning: calibration only)")
    lines = [f"# {title}", "",
             f"A Mixture-of-Experts model carved from {f'[{base}](https://huggingface.co/{base})' if origin else f'`{base}`'} "
             f"by moeify {report.get('moeify_version', '')}: every FFN's "
             f"intermediate neurons permuted and split into experts, with a router per layer; {done}. With every "
             "expert active it computes exactly what the dense model computes.", "",
             "## Layout", "", "| | |", "|---|---|",
             f"| format | `{fmt}` (transformers' `{MODEL_CLASSES.get(fmt, fmt)}`, no remote code) |",
             f"| routed experts | {experts} of {width} neurons, top-{top_k} a token |"]
    if shared:
        lines.append(f"| shared expert | {shared_width} neurons, always on |")
    layers = report.get("layers", [])
    d_ff = len(carved[0]["perm"]) if carved and "perm" in carved[0] else (experts or 0) * (width or 0) + shared_width
    share = active_neuron_share(d_ff=d_ff, n_layers=len(layers) or 1, top_k=top_k or 0, expert_width=width or 0,
                                shared_width=shared_width, dense_layers=len(layers) - len(carved)) if d_ff else 0.0
    active = active_share_text(share, width, report.get("padded_expert_width", width), report.get("ffn_flops_ratio", 0))
    lines += [f"| FFN active per token | {active} |",
              f"| parameters | {_millions(report.get('total_params', 0))} total, "
              f"{_millions(report.get('active_params', 0))} active per token |",
              f"| carved layers | {len(carved)} of {len(report.get('layers', []))} |",
              f"| dtype | {report.get('output_dtype', '')} |", "",
              "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{title}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{title}")', "```", "",
              "```bash", f"vllm serve {title}",
              f"python convert_hf_to_gguf.py {title} --outfile {title}.gguf   # llama.cpp (then llama-quantize)",
              "```", "", "## Quality measured", ""]
    errors = [e["rel_error"] for e in carved if isinstance(e.get("rel_error"), (int, float))]
    if errors:
        worst = max(carved, key=lambda e: e.get("rel_error") or 0)
        calib = report.get("calibration") or {}
        lines.append(f"- At conversion: each carved FFN's output against the dense FFN's on "
                     f"{calib.get('tokens', 0):,} calibration tokens, relative error {sum(errors) / len(errors):.3f} "
                     f"on average (worst: layer {worst.get('layer')}, {worst.get('rel_error'):.3f}).")
    if tuned:
        runs = tuning.get("runs", [])
        first = runs[0].get("holdout_kl_before") if runs else None
        kl = f"{first:.3f} → {tuning.get('holdout_kl'):.3f}" if first is not None else f"{tuning.get('holdout_kl'):.3f}"
        same = " No run's held-out check beat the weights it started from: these are the carve's." if runs and all(
            kept_as_carved(r) for r in runs) else ""
        lines.append(f"- Tuning: held-out KL divergence to the dense model's next-token distributions {kl} "
                     f"({tuned:,} tokens in {len(runs)} run(s)).{same}")
    lines += _evaluation_lines(out) or ["- Perplexity: not measured yet (`moeify eval DENSE THIS --data TEXT` "
                                        "adds it here)."]
    lines += ["", "## Recipe", "", "The settings that made it (`moeify.toml`; `moeify convert SRC OUT --preset "
              "moeify.toml` repeats the conversion where the text files it names are; `bundled:` names the text "
              "moeify ships):", "", "```toml", toml_text.rstrip(), "```", ""]
    front = data.to_yaml()
    return f"---\n{front}\n---\n\n" + "\n".join(lines)


UPCYCLE_TRAINING = ("Train it as the upcycling literature did: the learning rate reset to the source's pretraining "
                    "peak (sparse upcycling, arXiv 2212.05055; NVIDIA, arXiv 2410.07524), a load-balancing loss of "
                    "1e-2 to 1e-3 against expert collapse, top-k ≥ 2.")


def _render_upcycle(out: Path, report: dict, name: str | None) -> str:
    """The card of an upcycled output: copies of each FFN for MoE training, exact (or how far from exact) at init."""
    from huggingface_hub import ModelCardData

    from .hub import hub_origin

    src = Path(report.get("source", ""))
    origin = hub_origin(src) if str(src) else None
    base = origin[0] if origin else src.name or "the dense model"
    fmt = report.get("format", "")
    s = report.get("settings", {})
    check = report.get("check", {})
    data = ModelCardData(base_model=origin[0] if origin else None, base_model_relation="finetune" if origin else None,
                         library_name="transformers", pipeline_tag="text-generation",
                         license=source_licence(src) if src.is_dir() else None,
                         tags=["moeify", "mixture-of-experts", "moe", "upcycling", fmt])
    title = name or out.resolve().name
    g, copies = report.get("granularity", 1), report.get("copies")
    kind = "full-width copies" if g == 1 else f"fine-grained copies (each cut into {g} slices)"
    symmetry = s.get("symmetry", "none")
    broken = {"none": "The copies are identical: with its routing as written it computes exactly what the dense model "
                      "computes (a router between identical copies gets almost no gradient until they differ).",
              "permute": "Each copy's neurons are shuffled before slicing, so slices of different copies differ; a "
                         "token still gets whole copies, so it computes exactly what the dense model computes.",
              "drop": f"Drop-Upcycling: {s.get('drop_share', 0):.0%} of each expert's neurons re-initialised from "
                      "the source matrices' statistics, so the experts differ from the start.",
              "noise": f"Each copy's weights plus Gaussian noise of {s.get('noise_scale', 0):g} × each matrix's "
                       "standard deviation."}[symmetry]
    kl = check.get("kl_to_source")
    named = f"[{base}](https://huggingface.co/{base})" if origin else f"`{base}`"
    if report.get("construction") == "merge":
        names = ", ".join(f"`{Path(p).name}`" for p in report.get("sources", []))
        what = (f"A Mixture-of-Experts model merged by moeify {report.get('moeify_version', '')} from {copies} "
                f"fine-tunes of {named} ({names}): each one's FFN an expert"
                f"{'' if g == 1 else f' of {g} slices'}, attention, norms and embeddings "
                f"{'the base' if report.get('attention') == 'base' else 'their average'}'s, each layer's router "
                + ROUTER_ROWS.get(report.get("router", "random"), f"by gate mode {report.get('router')}."))
    else:
        what = (f"A Mixture-of-Experts model upcycled from {named} by moeify {report.get('moeify_version', '')}: "
                f"every FFN's neurons made into {copies} {kind}, with a router per layer, as a starting point for MoE "
                f"training. {broken}")
    lines = [f"# {title}", "", what, "",
             "## Layout", "", "| | |", "|---|---|",
             f"| format | `{fmt}` (transformers' `{MODEL_CLASSES.get(fmt, fmt)}`, no remote code; top-k weights "
             "renormalised) |",
             f"| routed experts | {report.get('experts')} of {report.get('expert_width')} neurons ({copies} copies × "
             f"{g}), top-{report.get('top_k')} a token |"]
    if report.get("shared_width"):
        lines.append(f"| shared expert | {report['shared_width']} neurons, always on |")
    lines += [f"| FFN parameters | × {report.get('ffn_params_ratio', 0):.2f} the dense FFN's |",
              f"| FFN compute per token | × {report.get('ffn_flops_ratio', 0):.2f} the dense FFN's |",
              f"| parameters | {_millions(report.get('total_params', 0))} total, "
              f"{_millions(report.get('active_params', 0))} active per token |",
              f"| dtype | {report.get('output_dtype', '')} |", "",
              "## Checked at the end of the upcycle", "",
              (f"- Exactness: {check['exact_model']}, routed by its own top-k, against the dense model on "
               + (f"{check['exact_tokens']} random tokens" if check.get("exact_tokens") else
                  f"{check.get('tokens', 0)} "
                  f"{'tokens of text' if check.get('tokens_from') == 'text' else 'random tokens'}")
               + f": max |logit difference| {check['max_logit_diff']:.3g} (max "
               f"|logit| {check.get('logit_scale', 0):.3g})." if check.get("exact_model") else
               "- Exactness: no setting of this merge computes the base (its attention is the sources' average, or "
               "its shared expert is not the base's FFN at a constant gate)."),
              f"- As written: KL divergence to the dense model's next-token distributions {nats(kl)} nats"
              + (f" on {check.get('kl_text_tokens'):,} tokens of text." if check.get("kl_text_tokens") else
                 " on the random tokens.") if kl is not None else "- KL to the dense model: not measured.",
              *_training_lines(report),
              "", "## Training it", "", UPCYCLE_TRAINING, "",
              f"In transformers, load it with `output_router_logits=True` and the loss of `model(ids, labels=ids)` "
              f"includes Mixtral's load-balancing loss (α · N · Σ fᵢ Pᵢ, α = router_aux_loss_coef = "
              f"{s.get('aux_loss_coef', 0.001):g} in config.json):", "",
              "```python", "from transformers import AutoModelForCausalLM", "",
              f'model = AutoModelForCausalLM.from_pretrained("{title}", output_router_logits=True)',
              "loss = model(input_ids, labels=input_ids).loss   # cross-entropy + α × load-balancing loss", "```", ""]
    lines += _evaluation_lines(out)
    lines += ["", "## Recipe", "", "The settings that made it (`moeify.toml`):", "", "```toml",
              (out / "moeify.toml").read_text().rstrip(), "```", ""]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


def _training_lines(report: dict) -> list[str]:
    """What `moeify tune OUT` has trained an upcycle or merge on: each run's text, tokens and held-out numbers."""
    t = report.get("training")
    if not t:
        return []
    lines = ["", "## Trained by moeify", "", "| run | text | tokens | trained | held-out perplexity | busiest expert | "
             "starved experts |", "|---:|---|---:|---|---|---|---|"]
    for i, r in enumerate(t["runs"], 1):
        b, a = r["held_out_before"], r["held_out_after"]
        files = ", ".join(f"`{Path(f).name}`" for f in r.get("text", {}).get("files", []))
        lines.append(f"| {i} | {files} | {r['tokens']:,} | {', '.join(r['trained'])} | {b['perplexity']:.4g} → "
                     f"{a['perplexity']:.4g} | {b['max_load']:.2f} → {a['max_load']:.2f} × uniform | "
                     f"{b['starved']} → {a['starved']} |")
    lines += ["", "Next-token loss plus the load-balancing loss (α in each run's record, `report.json`); held out: the "
              "last windows of each run's text."]
    return lines


def active_share_text(share: float, width: int, stored: int, flops_ratio: float) -> str:
    """The FFN's active share as plan, convert and the card say it: real neurons, and the zero padding apart."""
    text = f"{share:.1%} of the dense FFN's neurons"
    if stored != width:
        text += (f"; experts of {width} neurons are stored zero-padded to {stored} (exact), so a token computes "
                 f"{flops_ratio:.1%} of the dense FFN's FLOPs, routers included")
    return text


def _evaluation_lines(out: Path) -> list[str]:
    f = out / EVALUATION
    try:
        ev = json.loads(f.read_text()) if f.is_file() else None
    except ValueError:
        ev = None
    if not ev:
        return []
    rows = [f"- Perplexity by `moeify eval` on {ev.get('tokens', 0):,} tokens of {ev.get('data', 'text')} "
            f"(windows of {ev.get('seq_len')}, {ev.get('dtype', '')}):", "",
            "| model | perplexity | × the first |", "|---|---:|---:|"]
    for m in ev.get("models", []):
        rows.append(f"| {m['name']} | {m['ppl']:.3f} | {m['ratio']:.3f} |")
    return rows + _task_lines(ev)


def _task_lines(ev: dict) -> list[str]:
    """`moeify eval --tasks`' accuracy beside the first model's, and the generation health line."""
    names = [m["name"] for m in ev.get("models", [])] or ["the first", "this"]
    rows, tasks, gen = [], ev.get("tasks"), ev.get("generation")
    if tasks:
        rows += ["", f"- Zero-shot tasks by `moeify eval --tasks` (lm-evaluation-harness {tasks['lm_eval']}; both "
                 "models on the same items; the difference with its paired standard error):", "",
                 f"| task | metric | items | {names[0]} | {names[-1]} | difference |", "|---|---|---:|---:|---:|---:|"]
        for r in tasks["rows"]:
            ppl = r["metric"] == "perplexity"
            diff = f"×{r['diff']:.3f} ± {r['diff_se']:.3f}" if ppl else f"{r['diff']:+.4f} ± {r['diff_se']:.4f}"
            spec = ".2f" if ppl else ".4f"
            items = f"{r['n']:,}" + (f" of {r['of']:,}" if r.get("of") and r["of"] != r["n"] else "")
            rows.append(f"| {r['task']} | {r['metric']} | {items} | {r['reference']:{spec}} | {r['this']:{spec}} "
                        f"| {diff} |")
        kept = tasks.get("retention")
        if kept and "retention" in kept:
            rows += ["", f"- Retention: {names[-1]} keeps {kept['retention']:.1%} ± {kept['retention_se']:.1%} of "
                     f"{names[0]}'s accuracy, {kept['margin_kept']:.1%} ± {kept['margin_kept_se']:.1%} of its margin "
                     f"above chance (mean over {', '.join(kept['tasks'])}; paired standard errors)."]
    if gen:
        rows += ["", f"- Generation health: repeated {gen['ngram']}-grams in greedy continuations of {gen['prompts']} "
                 f"prompts from {ev.get('data', 'the text')} ({gen['new_tokens']} new tokens each): {names[0]} "
                 f"{gen['reference']:.3f}, {names[-1]} {gen['this']:.3f} ({gen['diff']:+.3f} ± {gen['diff_se']:.3f})."]
    return rows


def write(out: Path, name: str | None = None) -> Path:
    """(Re)write OUT/README.md from the output's files."""
    path = Path(out) / CARD
    path.write_text(render(out, name))
    return path


def record_evaluation(out: Path, result: dict, reference: dict, this: dict) -> None:
    """`moeify eval`'s numbers for the output `out` (evaluation.json), and its card written again with them."""
    data, settings = result["data"], result["settings"]
    ev = {"data": Path(str(data.get("source", "text"))).name, "tokens": data.get("tokens"),
          "seq_len": settings.get("seq_len"), "dtype": this.get("dtype"),
          "models": [{"name": Path(m["path"]).name, "path": m["path"], "ppl": m["perplexity"],
                      "ratio": m["perplexity"] / reference["perplexity"]} for m in (reference, this)]}
    i = [m["path"] for m in result["models"]].index(this["path"])
    if result.get("tasks"):
        t = result["tasks"]
        kept = (t.get("retention") or {}).get("models", [])
        ev["tasks"] = {"lm_eval": t["lm_eval"], "limit": t["limit"],
                       "retention": {k: v for k, v in kept[i - 1].items() if k != "path"} if 0 < i <= len(kept)
                       else None, "rows": [
            {"task": name, "metric": metric, "n": task["n"], "of": task["of"], "reference": entries[0]["value"],
             "this": entries[i]["value"], "diff": entries[i]["diff"], "diff_se": entries[i]["diff_se"]}
            for name, task in t["tasks"].items() for metric, entries in task["metrics"].items()]}
    if this.get("generation"):
        g = this["generation"]
        ev["generation"] = {**{k: result["settings"]["generation"][k] for k in ("ngram", "prompts", "new_tokens")},
                            "reference": reference["generation"]["repeated"], "this": g["repeated"],
                            "diff": g["diff"], "diff_se": g["diff_se"]}
    f = Path(out) / EVALUATION
    try:  # an eval without --tasks keeps the task accuracy an earlier one measured on this output
        earlier = json.loads(f.read_text()) if f.is_file() else {}
    except ValueError:
        earlier = {}
    for key in ("tasks", "generation"):
        if key not in ev and key in earlier:
            ev[key] = earlier[key]
    f.write_text(json.dumps(ev, indent=1) + "\n")
    write(out)


def kept_as_carved(run: dict) -> bool:
    """A tuning run (a report.json tuning.runs record) whose early stopping kept the weights it started from: no
    held-out check after step 0 beat them (moeify.training.distill: step_kept 0)."""
    return run.get("steps", 0) > 0 and run.get("step_kept") == 0 and len(run.get("holdout_curve") or []) > 1


__all__ = ["nats", "CARD", "EVALUATION", "render", "write", "record_evaluation", "copy_licence", "source_licence",
           "active_share_text", "kept_as_carved"]
