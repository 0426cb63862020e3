"""`moeify merge`: several fine-tunes of one base as one MoE (each source's FFN an expert): exact where the sources
are one model, routers from each source's text that route each text to its own source, refusals of sources that do
not fit, nothing half-written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, build_dense, load, max_logit_diff
from safetensors.torch import load_file
from typer.testing import CliRunner

import moeify
from moeify.cli.app import app
from moeify.errors import MoeifyError

SHAKESPEARE = Path(__file__).resolve().parents[1] / "examples" / "calib"


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Two genres: WikiText-2 prose, and the same prose upper-cased with digits (a text the tokenizer splits into
    other tokens)."""
    root = tmp_path_factory.mktemp("texts")
    prose = CORPUS.read_text()[:12000]
    (root / "prose.txt").write_text(prose)
    (root / "shout.txt").write_text(" ".join(f"{w.upper()} {i % 97}" for i, w in enumerate(prose.split())))
    return root / "prose.txt", root / "shout.txt"


@pytest.mark.parametrize("granularity", [1, 2])
def test_merging_one_model_with_itself_reproduces_it(tmp_path, tokenizer_dir, granularity):
    a = build_dense(tmp_path / "a", tokenizer_dir)
    b = shutil.copytree(a, tmp_path / "b")
    report = moeify.merge([a, b], tmp_path / "moe", granularity=granularity)
    assert report["construction"] == "merge" and report["experts"] == 2 * granularity
    assert report["top_k"] == 2 * granularity and report["check"]["kl_to_source"] < 1e-6
    assert max_logit_diff(a, tmp_path / "moe", seq=24) <= 1e-4


def test_one_checkpoint_named_several_times_is_copied_once_a_layer(tmp_path, tokenizer_dir, monkeypatch):
    """A merge naming the base 3 times makes each layer's expert once and writes it 3 times (the same bytes)."""
    import moeify.upcycling.layer as up

    made = []
    real = up.copy_expert
    monkeypatch.setattr(up, "copy_expert", lambda *a: made.append(1) or real(*a))
    a = build_dense(tmp_path / "a", tokenizer_dir)
    report = moeify.merge([a, a, a], tmp_path / "moe", base=a)
    layers = len(report["layers"])
    written = len(made)
    assert report["experts"] == 3 and report["check"]["max_logit_diff"] <= 1e-4
    moe = load_file(str(next((tmp_path / "moe").glob("*.safetensors"))))
    for i in range(layers):
        w = [moe[f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"] for e in range(3)]
        assert torch.equal(w[0], w[1]) and torch.equal(w[0], w[2])
    assert report["check"]["experts_read_back"] and written == layers  # the check reads the files, makes none


def test_router_rows_from_each_sources_text_send_each_text_to_its_source(tmp_path, tokenizer_dir, texts):
    a = build_dense(tmp_path / "a", tokenizer_dir, seed=0)
    b = build_dense(tmp_path / "b", tokenizer_dir, seed=1)
    report = moeify.merge([a, b], tmp_path / "moe", top_k=1, router_text=list(texts), router_tokens=1024)
    assert report["router"] == "router_input" and report["check"]["exact_model"] == "every expert the base's FFN"
    model, info = load(tmp_path / "moe")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tmp_path / "moe")
    share = []
    for text, expert in zip(texts, (0, 1)):
        ids = torch.tensor([tok(text.read_text())["input_ids"][:128]])
        with torch.no_grad():
            logits = model(ids, output_router_logits=True).router_logits  # per layer (tokens, E)
        share.append(float(torch.stack([(lg.argmax(-1) == expert).float().mean() for lg in logits]).mean()))
    assert share[0] > 0.7 and share[1] > 0.7, share  # each text mostly to the expert of its own source


def test_a_base_that_is_none_of_the_sources_is_the_exact_construction(tmp_path, tokenizer_dir):
    """--base names a model none of whose FFNs is an expert: the end-of-run check puts the base's own FFN in every
    expert (not the first source's), so the run passes it."""
    base = build_dense(tmp_path / "base", tokenizer_dir, seed=0)
    a = build_dense(tmp_path / "a", tokenizer_dir, seed=1)
    b = build_dense(tmp_path / "b", tokenizer_dir, seed=2)
    report = moeify.merge([a, b], tmp_path / "moe", base=base)
    check = report["check"]
    assert check["exact_model"] == "every expert the base's FFN" and check["max_logit_diff"] <= 1e-4
    assert check["kl_to_source"] > 1e-4  # the experts as written are the sources', not the base's


def test_averaged_attention_is_the_sources_mean(tmp_path, tokenizer_dir):
    a = build_dense(tmp_path / "a", tokenizer_dir, seed=0)
    b = build_dense(tmp_path / "b", tokenizer_dir, seed=1)
    report = moeify.merge([a, b], tmp_path / "moe", attention="average", top_k=1)
    assert report["check"]["exact_model"] is None and report["check"]["kl_to_source"] > 0
    got = load_file(str(tmp_path / "moe" / "model.safetensors"))
    ta, tb = (load_file(str(p / "model.safetensors")) for p in (a, b))
    name = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(got[name], (ta[name] + tb[name]) / 2)
    assert torch.equal(got["model.layers.1.block_sparse_moe.experts.1.w3.weight"], tb["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("what,message", [
    ("shape", "does not fit the base"),
    ("tokenizer", "has another tokenizer than the base"),
    ("one", "merge needs at least 2 sources, got 1"),
    ("texts", "--router-text names 1 file(s) for 2 sources"),
])
def test_sources_that_do_not_fit_are_refused_in_one_line(tmp_path, tokenizer_dir, texts, what, message):
    a = build_dense(tmp_path / "a", tokenizer_dir)
    b = build_dense(tmp_path / "b", tokenizer_dir, intermediate_size=128 if what == "shape" else 96, seed=1)
    if what == "tokenizer":
        (b / "tokenizer.json").write_text((b / "tokenizer.json").read_text().replace('"<s>"', '"<S>"'))
    args = {"one": [a], "texts": [a, b]}.get(what, [a, b])
    extra = ["--router-text", texts[0]] if what == "texts" else []
    result = CliRunner().invoke(app, ["merge", str(tmp_path / "moe"), *map(str, args), *map(str, extra)])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.output
    assert not (tmp_path / "moe").exists() and not list(tmp_path.glob("moe.*"))
    with pytest.raises(MoeifyError, match=message.split(" (")[0].replace("(", r"\(").replace(")", r"\)")):
        moeify.merge(args, tmp_path / "moe2", router_text=extra[1:] or None)
