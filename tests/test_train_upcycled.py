"""`moeify tune OUT` on an upcycled or merged output: next-token training with Mixtral's load-balancing loss, the
expert load reported, what trains as asked, resumable bit for bit, written back in the output's own names and dtype,
and bad requests refused in one line before any work."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import build_dense, corpus_text, kill_at_step, read_json, tree_hash
from safetensors.torch import load_file
from typer.testing import CliRunner

import moeify
from moeify.cli.app import app
from moeify.errors import MoeifyError
from moeify.tuning.lm import balance, load_summary
from moeify.upcycling.upcycle import UpcycleSettings, plan_upcycle, run_upcycle

FAST = dict(seq_len=32, step_tokens=64)  # windows of 32 tokens, two a step


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "train.txt"
    f.write_text(corpus_text(12000))
    return f


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("upcycled")
    src = build_dense(root / "dense", tokenizer_dir)
    run_upcycle(plan_upcycle(src, UpcycleSettings(copies=4, top_k=2, symmetry="drop", dtype="bfloat16")),
                root / "moe")
    return src, root / "moe"


def fresh(upcycled, tmp_path):
    import shutil

    out = tmp_path / "moe"
    shutil.copytree(upcycled[1], out)
    return out


def tensors(out):
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_balance_is_mixtrals_loss_per_layer_averaged_and_counts_the_top_k_choices():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 4, generator=g), torch.randn(10, 4, generator=g) * 3)
    loss, counts = balance(logits, 4, 2)
    by_hand = []
    for lg in logits:
        p = torch.softmax(lg, -1)
        top = p.topk(2, -1).indices
        f = torch.stack([(top == i).sum() for i in range(4)]).float() / 10  # shares of the 10 tokens' choices
        by_hand.append(4 * (f * p.mean(0)).sum())
    assert loss.item() == pytest.approx(torch.stack(by_hand).mean().item(), rel=1e-6)
    assert counts.shape == (2, 4) and counts.sum(1).tolist() == [20.0, 20.0]
    uniform = load_summary(torch.tensor([[5.0, 5.0, 5.0, 5.0], [10.0, 9.0, 1.0, 0.0]]))
    assert uniform["max_load"] == 2.0 and uniform["max_load_layer"] == 1
    assert uniform["starved"] == 1 and uniform["min_load"] == 0.0  # 0 < 0.1 x uniform; 1 of 20 is 0.2 x uniform


def test_training_lowers_the_held_out_loss_keeps_names_and_dtype_and_records_the_load(upcycled, tmp_path, text):
    out = fresh(upcycled, tmp_path)
    before = tensors(out)
    config = (out / "config.json").read_text()
    report = moeify.train(out, 1536, text=[text], lr=0.03, **FAST)
    run = report["training"]["runs"][-1]
    assert run["held_out_after"]["loss"] < run["held_out_before"]["loss"] - 0.1
    assert run["steps"] == 24 and run["tokens"] == 1536 and run["trained"] == ["router", "experts"]
    assert run["aux_loss_coef"] == pytest.approx(0.01)  # the output's router_aux_loss_coef
    assert run["curve"] and all(0 < p["balance"] for p in run["curve"])
    assert 1.0 <= run["held_out_after"]["max_load"] <= 4.0  # 4 experts: at most 4x the uniform share
    after = tensors(out)
    assert {k: (v.shape, v.dtype) for k, v in after.items()} == {k: (v.shape, v.dtype) for k, v in before.items()}
    assert all(v.dtype == torch.bfloat16 for v in after.values())
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert any("experts" in k for k in changed) and any(k.endswith("block_sparse_moe.gate.weight") for k in changed)
    assert not any("self_attn" in k or "embed" in k or "norm" in k for k in changed)
    assert (out / "config.json").read_text() == config
    assert "[training]" in (out / "moeify.toml").read_text() and read_json(out / "report.json")["training"]
    card = (out / "README.md").read_text()
    assert "## Trained by moeify" in card and "| 1 | `train.txt` | 1,536 | router, experts |" in card
    assert not (tmp_path / "moe.moeify-tune").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the stock class loads it


@pytest.mark.parametrize("flags, trains", [(dict(train_experts=False), "block_sparse_moe.gate"),
                                           (dict(train_router=False), "experts")])
def test_router_only_and_freeze_router_train_only_what_they_say(upcycled, tmp_path, text, flags, trains):
    out = fresh(upcycled, tmp_path)
    before = tensors(out)
    moeify.train(out, 256, text=[text], lr=0.03, **FAST, **flags)
    after = tensors(out)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(trains in k for k in changed), sorted(changed)[:4]


def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(upcycled, tmp_path, text):
    whole = fresh(upcycled, tmp_path / "a")
    moeify.train(whole, 640, text=[text], lr=0.03, **FAST)
    out = fresh(upcycled, tmp_path / "b")

    def stop_at_step_4(stage, done, total, note=""):
        if done == 4 * 64:
            os.kill(os.getpid(), signal.SIGINT)  # the run saves its state at the end of this step and stops

    with pytest.raises(KeyboardInterrupt):
        moeify.train(out, 640, text=[text], lr=0.03, save_every=1e9, progress=stop_at_step_4, **FAST)
    state = read_json(tmp_path / "b" / "moe.moeify-tune" / "state.json")
    assert state["meta"]["step"] == 4
    with pytest.raises(MoeifyError, match="started with lr = 0.03, not 0.01"):
        moeify.train(out, resume=True, lr=0.01)
    report = moeify.train(out, resume=True)
    assert report["training"]["runs"][-1]["resumed"] is True
    a, b = tensors(whole), tensors(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_refusals_are_one_line_and_leave_the_output_as_it_was(upcycled, tmp_path, text, tokenizer_dir):
    out = fresh(upcycled, tmp_path)
    h = tree_hash(out)
    r = cli("tune", out, "--tokens", "64")
    assert r.exit_code == 2 and "trains on text: none given" in r.output and "--tune-text" in r.output
    r = cli("tune", out, "--tokens", "64", "--tune-text", text, "--schedule", "restart")
    assert r.exit_code == 2 and "--schedule is for tuning a carve" in r.output
    r = cli("tune", out, "--tune-text", text)
    assert r.exit_code == 2 and "--tokens is required" in r.output
    r = cli("tune", out, "--resume")
    assert r.exit_code == 2 and "no interrupted training" in r.output
    r = cli("tune", out, "--tokens", "64", "--tune-text", text, "--router-only", "--freeze-router")
    assert r.exit_code == 2 and "leaves nothing to train" in r.output
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    r = cli("tune", out, "--tokens", "64", "--tune-text", tiny)
    assert r.exit_code == 2 and "too little to train" in r.output
    assert tree_hash(out) == h and not (tmp_path / "moe.moeify-tune").exists()
    dense = build_dense(tmp_path / "dense", tokenizer_dir)
    r = cli("tune", dense, "--tokens", "64", "--tune-text", text)
    assert r.exit_code == 2 and "not an output of moeify upcycle or moeify merge" in r.output


def test_the_command_prints_the_load_in_80_columns(upcycled, tmp_path, text):
    out = fresh(upcycled, tmp_path)
    r = CliRunner().invoke(app, ["tune", str(out), "--tune-text", str(text), "--tokens", "128", "--lr", "0.03",
                                 "--step-tokens", "64"], terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "busiest expert / uniform" in r.output and "starved experts" in r.output
    assert max(len(line) for line in r.output.splitlines()) <= 80, [l for l in r.output.splitlines() if len(l) > 80]


def test_a_mix_of_texts_is_held_out_from_every_text(upcycled, tmp_path, text):
    from moeify.tuning.lm import TrainOptions, _windows

    other = tmp_path / "other.txt"
    other.write_text(corpus_text(40000)[20000:])
    train, held, seq = _windows(upcycled[1], TrainOptions(tokens=64, text=(str(text), str(other)), seq_len=32), 128)
    from moeify.formats.text import text_windows

    first, second = text_windows(upcycled[1], [text], 32), text_windows(upcycled[1], [other], 32)
    assert seq == 32 and held.shape[0] >= 2 and train.shape[0] + held.shape[0] == first.shape[0] + second.shape[0]
    assert any(torch.equal(h, first[-1]) for h in held) and any(torch.equal(h, second[-1]) for h in held)


def test_kill_9_mid_run_then_resume_gives_the_weights_of_an_uninterrupted_run(upcycled, tmp_path, text):
    """Training in a process of its own, saving after every step, killed with SIGKILL at some step; `--resume` in
    another process ends where a run that was never interrupted ends, and clears its state."""
    import subprocess
    import sys
    import time

    whole, out = fresh(upcycled, tmp_path / "a"), fresh(upcycled, tmp_path / "b")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = ("import sys, moeify; moeify.train(sys.argv[1], 640, text=[sys.argv[2]], lr=0.03, save_every=0, "
           "seq_len=32, step_tokens=64)")
    subprocess.run([sys.executable, "-c", run, str(whole), str(text)], env=env, check=True, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-c", run, str(out), str(text)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, kill_after = tmp_path / "b" / "moe.moeify-tune" / "state.json", 2 + int(time.time() * 1000) % 6
    kill_at_step(proc, state, kill_after)  # some step in 2..7 of 10
    assert 0 < read_json(state)["meta"]["step"] < 10
    done = subprocess.run([sys.executable, "-c", "from moeify.cli import main; main()", "tune", str(out), "--resume"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = tensors(whole), tensors(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not state.parent.exists()
