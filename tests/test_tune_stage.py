"""`moeify tune`: the recovery tuning stage on its own (resume, extension, refusal of stale state) and through convert."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import build_dense, kill_at_step, load
from moeify.config import build_config
from moeify.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError
from moeify.tuning import TuneOptions, TuningInterrupted, estimate_run, state_dir, tune_output
from moeify.verify import verify_checkpoint
from test_calibrate import CALIB

# a short schedule: windows of 64 tokens, 16 windows a step
CARVE = dict(experts=4, top_k=2, **CALIB)


@pytest.fixture(scope="module")
def carved(tmp_path_factory, tokenizer_dir):
    """A tiny dense model and its untuned carve (module-wide: each test copies the carve)."""
    root = tmp_path_factory.mktemp("stage")
    dense = build_dense(root / "dense", tokenizer_dir, num_hidden_layers=3, initializer_range=0.3)  # FFNs matter
    run_conversion(plan_conversion(dense, build_config(**CARVE)), root / "carve")
    return dense, root / "carve"


def _copy(carve: Path, to: Path) -> Path:
    shutil.copytree(carve, to)
    return to


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_identical(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    different = [n for n in ta if not torch.equal(ta[n], tb[n])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _assert_trained_alike(a: Path, b: Path, carve: Path, bound: float = 0.05) -> None:
    """Every tensor of outputs a and b within `bound` of what tuning moved it from the carve (float rounding that
    Adam's normalised steps carry into the weights); tensors tuning did not move, bit-identical."""
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(carve)
    assert ta.keys() == tb.keys()
    for name in ta:
        moved = (ta[name].float() - tc[name].float()).abs().max().item()
        if moved:
            assert (ta[name].float() - tb[name].float()).abs().max().item() < bound * moved, name
        else:
            assert torch.equal(ta[name], tb[name]), name


def _one_and_two_processes(dense: Path, carve: Path, tmp_path: Path, flags: list[str],
                           autocast: str = "auto") -> tuple[dict, dict]:
    """`moeify tune` of two copies of the carve, in one process and under torchrun with 2 CPU processes (gloo):
    (the run of each, as its report.json records it); the outputs are tmp_path/one and tmp_path/two."""
    one, two = _copy(carve, tmp_path / "one"), _copy(carve, tmp_path / "two")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOEIFY_AUTOCAST": autocast}
    subprocess.run([sys.executable, "-m", "moeify", "tune", str(dense), str(one)] + flags, env=env, check=True,
                   capture_output=True)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moeify",
                          "tune", str(dense), str(two)] + flags, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return tuple(json.loads((p / "report.json").read_text())["tuning"]["runs"][0] for p in (one, two))


def _interrupt_at(step_tokens: int):
    """A progress callback that sends this process SIGINT once tuning has passed `step_tokens` tokens (the stage's
    handler asks the run to save and stop at the end of the step)."""
    sent = []

    def progress(stage, done, total, note=""):
        if stage == "tuning" and done >= step_tokens and not sent:
            sent.append(done)
            os.kill(os.getpid(), signal.SIGINT)

    return progress


OPTS = TuneOptions(tokens=12 * 1024, generated=0.25, lr=0.02)  # a large step: a short run that visibly learns


def test_tuning_lowers_held_out_kl_and_the_output_computes_what_the_student_computed(carved, tmp_path, monkeypatch):
    import moeify.distill as distill_mod

    dense, carve = carved
    out = _copy(carve, tmp_path / "moe")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    seen, real = {}, distill_mod.distill

    def spy(*args, **kw):
        info = real(*args, **kw)
        with torch.no_grad():
            seen["logits"] = args[1](ids).logits.float()
        return info

    monkeypatch.setattr(distill_mod, "distill", spy)
    report = tune_output(dense, out, OPTS)
    run = report["tuning"]["runs"][0]
    assert run["holdout_kl_after"] < 0.95 * run["holdout_kl_before"], run  # not only kept-best's "<="
    assert run["tokens"] == 12 * 1024 and run["steps"] == 12 and not run["resumed"]
    assert run["kl_logits"] == ("bf16" if run["bf16_autocast"] else "float32")  # the default follows autocast
    assert not state_dir(out).exists()  # removed once the output is committed
    moe, info = load(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        got = moe(ids).logits.float()
    scale = seen["logits"].abs().max().item()
    assert (got - seen["logits"]).abs().max().item() <= 1e-4 * scale  # float32 output: only the export's rounding
    assert verify_checkpoint(out, against=dense).problems == []
    assert all(e["tuned"] == ["gate", "up", "down", "router"] for e in report["layers"])


def test_interrupted_run_resumes_to_the_uninterrupted_weights(carved, tmp_path):
    """SIGINT mid-run saves the state and stops; --resume ends with bit-identical weights and the same curve."""
    dense, carve = carved
    a, b = _copy(carve, tmp_path / "a"), _copy(carve, tmp_path / "b")
    whole = tune_output(dense, a, OPTS)
    with pytest.raises(TuningInterrupted) as stop:
        tune_output(dense, b, OPTS, progress=_interrupt_at(5 * 1024))
    assert stop.value.step == 5 and stop.value.total == 12
    assert json.loads((state_dir(b) / "state.json").read_text())["meta"]["step"] == 5
    _assert_identical(b, carve)  # OUT untouched while the run is interrupted
    resumed = tune_output(dense, b, None, resume=True)
    _assert_identical(a, b)
    ra, rb = whole["tuning"]["runs"][0], resumed["tuning"]["runs"][0]
    assert rb["resumed"] and ra["holdout_curve"] == rb["holdout_curve"] and ra["train_kl_end"] == rb["train_kl_end"]


def test_interrupted_sampling_resumes_at_its_next_batch(carved, tmp_path, monkeypatch):
    """Ctrl-C while the dense model samples the tuning text: the batches done are kept, --resume samples the rest
    under the same seeds, and the run ends as an uninterrupted one."""
    import moeify.tuning.data as tune_data

    monkeypatch.setattr(tune_data, "SAMPLE_BATCH", 8)
    dense, carve = carved
    a, b = _copy(carve, tmp_path / "a"), _copy(carve, tmp_path / "b")
    opts = TuneOptions(tokens=4 * 1024, generated=0.5, lr=0.02)  # 32 + 3 sampled windows of 64: 5 batches
    tune_output(dense, a, opts)

    def stop_sampling(stage, done, total, note=""):
        if stage == "sampling tuning text" and done >= 2 * 8 * 64:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune_output(dense, b, opts, progress=stop_sampling)
    assert sorted(f.name for f in (state_dir(b) / "sampled").iterdir()) == ["batch-00000.safetensors",
                                                                           "batch-00001.safetensors", "batch.json"]
    seen = []
    report = tune_output(dense, b, None, resume=True,
                         progress=lambda stage, done, total, note="": seen.append((stage, done)))
    assert seen[0] == ("sampling tuning text", 8 * 64)  # batch 0 read back, not sampled again
    assert report["tuning"]["runs"][0]["resumed"]  # resumed while sampling: no training step was saved, still resumed
    _assert_identical(a, b)


def test_kill_9_at_a_random_step_then_resume_gives_the_same_weights(carved, tmp_path):
    """The real thing: `moeify tune` in another process, killed with SIGKILL while it saves after every step, then
    `--resume` in a third process; the result equals an uninterrupted run in a process of its own."""
    dense, carve = carved
    a, b = _copy(carve, tmp_path / "a"), _copy(carve, tmp_path / "b")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "from moeify.cli import main; main()", "tune", str(dense)]
    flags = ["--tokens", str(8 * 1024), "--tune-generated", "0.25", "--lr", "0.02", "--save-every", "0"]
    subprocess.run(cmd + [str(a)] + flags, env=env, check=True, capture_output=True)
    proc = subprocess.Popen(cmd + [str(b)] + flags, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, kill_after = state_dir(b) / "state.json", 2 + int(time.time() * 1000) % 5  # some step in 2..6 of 8
    kill_at_step(proc, state, kill_after)
    assert json.loads(state.read_text())["meta"]["step"] < 8
    done = subprocess.run(cmd + [str(b), "--resume"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _assert_identical(a, b)
    assert not state_dir(b).exists()


def test_ctrl_c_saves_and_prints_the_command_that_resumes(carved, tmp_path):
    dense, carve = carved
    out = _copy(carve, tmp_path / "moe")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-c", "from moeify.cli import main; main()", "tune", str(dense), str(out),
                             "--tokens", str(64 * 1024), "--tune-generated", "0.25"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(state_dir(out).glob("best-*.safetensors")):  # tuning has started
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"moeify tune {dense} {out} --resume" in " ".join(err.split()), err
    assert (state_dir(out) / "state.json").is_file(), err[-3000:]
    meta = json.loads((state_dir(out) / "state.json").read_text())["meta"]
    assert 0 < meta["step"] < meta["total"] == 64  # saved at the end of the step in progress
    _assert_identical(out, carve)


def test_a_tuned_output_tunes_further_and_keeps_its_history(carved, tmp_path):
    dense, carve = carved
    out = _copy(carve, tmp_path / "moe")
    first = tune_output(dense, out, OPTS)
    first_weights = _tensors(out)
    second = tune_output(dense, out, TuneOptions(tokens=6 * 1024, generated=0.25, lr=0.02))
    runs = second["tuning"]["runs"]
    assert [r["tokens"] for r in runs] == [12 * 1024, 6 * 1024] and second["tuning"]["tokens"] == 18 * 1024
    assert runs[0] == first["tuning"]["runs"][0]
    assert runs[1]["seed"] != runs[0]["seed"]  # new sampled text and a new window order
    # the second run starts from the first one's weights: its starting held-out KL is the tuned model's, below the
    # carve's (the held-out windows of the real texts are the same; the two sampled ones are new)
    assert runs[1]["holdout_kl_before"] < runs[0]["holdout_kl_before"] - 0.5 * (
        runs[0]["holdout_kl_before"] - runs[0]["holdout_kl_after"])
    assert runs[1]["holdout_kl_after"] <= runs[1]["holdout_kl_before"]
    toml = (out / "moeify.toml").read_text()
    assert "[tuning]\ntokens = 18432\nruns = 2" in toml
    assert any(not torch.equal(first_weights[n], t) for n, t in _tensors(out).items())
    assert verify_checkpoint(out, against=dense).problems == []


def test_further_tuning_continues_one_cosine_over_all_its_tokens_unless_restarted(carved, tmp_path):
    """A tuned output tuned N more tokens follows the rest of one cosine over its earlier tokens and these (a doubling
    starts at half the peak step and decays to 0), so it moves the tuned weights less than a re-warmed whole cosine;
    --schedule restart is the whole cosine; a state saved before --schedule existed resumes as the whole cosine."""
    assert TuneOptions(tokens=100).schedule_from(0) == 0.0
    assert TuneOptions(tokens=100).schedule_from(300) == 0.75
    assert TuneOptions(tokens=100, schedule="restart").schedule_from(300) == 0.0
    with pytest.raises(MoeifyError, match="--schedule must be one of continue, restart"):
        TuneOptions(tokens=100, schedule="warm").validate()
    dense, carve = carved
    first = _copy(carve, tmp_path / "first")
    tune_output(dense, first, OPTS)
    tuned = _tensors(first)
    moved = {}
    for kind in ("continue", "restart"):
        out = _copy(first, tmp_path / kind)
        run = tune_output(dense, out, dataclasses.replace(OPTS, schedule=kind))["tuning"]["runs"][-1]
        assert (run["schedule"], run["schedule_from"]) == (kind, 0.5 if kind == "continue" else 0.0)
        moved[kind] = sum(float((t - tuned[n]).norm()) for n, t in _tensors(out).items())
    assert 0 < moved["continue"] < 0.7 * moved["restart"]  # mean step 0.18 of the peak against 0.5

    old = _copy(first, tmp_path / "old")

    def stop_sampling(stage, done, total, note=""):
        if stage == "sampling tuning text":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune_output(dense, old, OPTS, progress=stop_sampling)
    run_json = state_dir(old) / "run.json"
    info = json.loads(run_json.read_text())
    del info["options"]["schedule"]
    run_json.write_text(json.dumps(info))
    run = tune_output(dense, old, None, resume=True)["tuning"]["runs"][-1]
    assert (run["schedule"], run["schedule_from"]) == ("restart", 0.0)
    _assert_identical(old, tmp_path / "restart")


def test_stale_or_foreign_state_is_refused(carved, tmp_path, tokenizer_dir):
    dense, carve = carved
    out = _copy(carve, tmp_path / "moe")
    with pytest.raises(TuningInterrupted):
        tune_output(dense, out, OPTS, progress=_interrupt_at(2 * 1024))
    with pytest.raises(MoeifyError, match=r"has an interrupted tuning .*--resume"):
        tune_output(dense, out, OPTS)
    with pytest.raises(MoeifyError, match=r"started with tokens = 12288, not 4096"):
        tune_output(dense, out, None, resume=True, given={"tokens": 4096})
    other = build_dense(tmp_path / "other", tokenizer_dir, num_hidden_layers=3, initializer_range=0.3, seed=7)
    with pytest.raises(MoeifyError, match="tuning state of another source"):
        tune_output(other, out, None, resume=True)
    report = tune_output(dense, out, TuneOptions(tokens=2048, generated=0.25), restart=True)
    assert report["tuning"]["runs"][0]["tokens"] == 2048 and not state_dir(out).exists()
    with pytest.raises(MoeifyError, match="no interrupted tuning"):
        tune_output(dense, out, None, resume=True)


def test_convert_interrupted_while_tuning_resumes_at_tuning(carved, tmp_path):
    dense, _ = carved
    cfg = build_config(**CARVE, tune_tokens=8 * 1024, tune_generated=0.25)
    run_conversion(plan_conversion(dense, cfg), tmp_path / "whole")
    with pytest.raises(TuningInterrupted):
        run_conversion(plan_conversion(dense, cfg), tmp_path / "moe", progress=_interrupt_at(3 * 1024))
    assert not (tmp_path / "moe").exists()  # no output that looks complete
    assert (state_dir(tmp_path / "moe") / "carved" / "report.json").is_file()
    with pytest.raises(MoeifyError, match=r"interrupted tuning of this output .*moeify tune .* --resume"):
        run_conversion(plan_conversion(dense, cfg), tmp_path / "moe")
    report = tune_output(dense, tmp_path / "moe", None, resume=True)
    assert report["tuning"]["runs"][0]["resumed"]
    _assert_identical(tmp_path / "whole", tmp_path / "moe")
    assert not state_dir(tmp_path / "moe").exists()
    assert verify_checkpoint(tmp_path / "moe", against=dense).problems == []


def test_tune_command_line(carved, tmp_path):
    from typer.testing import CliRunner

    from moeify.cli import app

    dense, carve = carved
    out = _copy(carve, tmp_path / "moe")
    runner = CliRunner()
    res = runner.invoke(app, ["tune", str(dense), str(out)])
    assert res.exit_code == 2 and "--tokens is required" in res.output
    res = runner.invoke(app, ["tune", str(dense), str(dense), "--tokens", "1024"])
    assert res.exit_code == 2 and "is not a moeify output (no moeify.toml)" in res.output
    res = runner.invoke(app, ["tune", str(dense), str(out), "--tokens", "4096", "--dry-run", "--json", "-"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout[res.stdout.index("{"):])
    assert est["steps"] == 4 and est["step_seconds"] > 0 and est["host_peak_bytes"] >= est["peak_bytes"] > 50e6
    assert est["predicted"]["peak"] >= est["predicted"]["tuning_peak"] > est["predicted"]["baseline"] > 0
    assert est["teacher_pass_seconds"] > 0 and est["sample_batch"] == 64  # a CPU samples 64 windows at once
    assert est["estimated_seconds"] == pytest.approx(est["tuning_seconds"] + est["sampling_seconds"]
                                                     + est["teacher_pass_seconds"])
    one, ten = est["seconds_for_tokens"]["1048576"], est["seconds_for_tokens"]["10485760"]  # larger budgets priced
    # steps and sampling scale with the tokens; the teacher pass saturates once every real window is drawn, so
    # ten / one = 10 - 9 T / one (T: the teacher pass's timed share, 5-6% of `one` on 2 cores, more under load)
    assert est["estimated_seconds"] < one < ten and 9.0 < ten / one <= 10.0
    assert not state_dir(out).exists() and est["offload"] is False
    _assert_identical(out, carve)  # --dry-run writes nothing
    # the dry run measures the run as it would be: offloaded with --offload (FSDP2 CPU offload; a CPU changes only the
    # code path), its prediction the offloaded one
    res = runner.invoke(app, ["tune", str(dense), str(out), "--tokens", "4096", "--dry-run", "--offload", "--json",
                              "-"])
    assert res.exit_code == 0, res.output
    off = json.loads(res.stdout[res.stdout.index("{"):])
    assert off["offload"] is True and off["predicted"]["peak"] > 0 and off["step_seconds"] > 0
    _assert_identical(out, carve)
    res = runner.invoke(app, ["tune", str(dense), str(out), "--tokens", "2048", "--tune-generated", "0.25"])
    assert res.exit_code == 0, res.output
    assert "tuned on 2,048 tokens" in res.output


def test_memory_model_counts_what_tuning_holds(carved):
    """The memory model's teacher and student terms are the bytes of the tensors tuning really holds (its
    activation and KL terms are held against measured peaks in scripts/bench_memory.py, not here)."""
    from moeify.checkpoint import CheckpointReader
    from moeify.distill import share_frozen
    from moeify.moe_block import MaskedMoE
    from moeify.families import load_source
    from moeify.memory import source_tuning_memory
    from moeify.tuning import build_student, read_output
    from transformers import AutoModelForCausalLM

    dense, carve = carved
    bo = read_output(carve)
    teacher = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    loaded = sum(p.numel() * p.element_size() for p in teacher.parameters())
    ffn_bytes = sum(p.numel() * p.element_size() for layer in teacher.model.layers for p in layer.mlp.parameters())
    reader = CheckpointReader(carve)
    student, own = build_student(teacher, bo, reader, "cpu")
    reader.close()
    share_frozen(teacher, student, False, torch.bfloat16, own)
    model = source_tuning_memory(load_source(dense), bo.cfg.experts, bf16=True)
    assert model.teacher == loaded  # float32 as loaded: the sampling and the teacher pass run it so
    shared = {id(p) for p in teacher.parameters()}
    own_params = [p for p in student.parameters() if id(p) not in shared]
    trainable = sum(p.numel() for m in student.modules() if isinstance(m, MaskedMoE) for p in m.parameters())
    assert sum(p.numel() for p in own_params) == trainable  # every layer carved: the student owns only its MoEs
    assert model.student == 4 * 4 * trainable  # weights, gradients, two Adam moments, float32
    on_gpu = source_tuning_memory(load_source(dense), bo.cfg.experts, bf16=True, device="cuda")
    assert on_gpu.teacher_freed == ffn_bytes  # the teacher pass frees them before tuning, on a GPU
    assert on_gpu.tuning_peak == (on_gpu.teacher - ffn_bytes + on_gpu.student + on_gpu.activations + on_gpu.kl)
    assert model.teacher_freed == 0  # on a CPU they stay mapped from the safetensors file


def test_two_processes_with_fsdp2_train_what_one_process_trains(carved, tmp_path):
    """torchrun with 2 CPU processes (gloo): the student's MaskedMoEs sharded by FSDP2, each step's windows split
    across the ranks, with --tune-attention (each decoder layer's own attention and norms one more FSDP2 group; the
    bf16 test below runs without it). Same held-out KL trajectory and final weights as one process on the same
    tokens, within float rounding of the different reduction order, which Adam's normalised steps carry into the
    weights (stated tolerance: 1e-4 relative on the held-out KL; on every tensor, the two runs differ by under 5% of
    what tuning changed in it); the attention and norm weights of the output moved (they were trained) in both."""
    dense, carve = carved
    ra, rb = _one_and_two_processes(dense, carve, tmp_path, ["--tokens", str(8 * 1024), "--tune-generated", "0.25",
                                                             "--lr", "0.02", "--tune-attention"])
    assert rb["attention_trained"] and ra["attention_trained"]
    assert [s for s, _ in ra["holdout_curve"]] == [s for s, _ in rb["holdout_curve"]]
    for (_, ka), (_, kb) in zip(ra["holdout_curve"], rb["holdout_curve"]):
        assert kb == pytest.approx(ka, rel=1e-4)
    ta, tb, tc = _tensors(tmp_path / "one"), _tensors(tmp_path / "two"), _tensors(carve)
    attn = [n for n in ta if "self_attn" in n or "layernorm" in n]
    assert attn and all(not torch.equal(ta[n], tc[n]) and not torch.equal(tb[n], tc[n]) for n in attn)
    _assert_trained_alike(tmp_path / "one", tmp_path / "two", carve)  # untrained tensors: bit-identical
    assert verify_checkpoint(tmp_path / "two", against=dense).problems == []
    # the teacher was sharded, not replicated: rank 0 held half the rows of every layer's attention and FFN weights
    teacher = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    assert ra["teacher_bytes"] == sum(p.nbytes for p in teacher.parameters())
    assert rb["teacher_bytes"] == sum(
        -(-p.shape[0] // 2) * p[0].nbytes if ".self_attn." in n or ".mlp." in n else p.nbytes
        for n, p in teacher.named_parameters())
    assert rb["teacher_bytes"] < 0.8 * ra["teacher_bytes"]


class _OtherRankBusier:
    """A Parallel of rank 1 of 2 whose other rank always has `extra` more forwards to run (no process group: the
    collectives answer as that rank would)."""

    world, rank, on, main, sharded = 2, 1, True, False, False

    def __init__(self, extra: int):
        self.extra = extra

    def most(self, n: int) -> int:
        return n + self.extra

    def any(self, flag: bool) -> bool:
        return True

    def arrive(self, phase: str, then: str | None = None) -> None:
        pass

    def share(self, value):
        return value() if callable(value) else value


def test_two_processes_under_bf16_autocast_compute_the_experts_by_fsdp2s_mixed_precision(carved, tmp_path):
    """Under bf16 autocast (forced here, on any CPU) the sharded experts compute in bf16 through FSDP2's
    MixedPrecisionPolicy (no autocast copy of the whole student held for the backward pass), the routers in float32:
    the same forward as one process's autocast, gradients reduced in float32, so the same held-out curve and
    weights as one process (the same tolerance as in float32)."""
    dense, carve = carved
    ra, rb = _one_and_two_processes(dense, carve, tmp_path, ["--tokens", str(4 * 1024), "--tune-generated", "0.25",
                                                             "--lr", "0.02"], autocast="bf16")
    assert ra["bf16_autocast"] and rb["bf16_autocast"] and ra["kl_logits"] == rb["kl_logits"] == "bf16"
    assert ra["text"]["generated"]["bf16_autocast"] and rb["text"]["generated"]["bf16_autocast"]  # sampled so too
    for (_, ka), (_, kb) in zip(ra["holdout_curve"], rb["holdout_curve"]):
        assert kb == pytest.approx(ka, rel=1e-4)
    _assert_trained_alike(tmp_path / "one", tmp_path / "two", carve)


def test_teacher_pass_and_sampling_run_in_step_with_the_busiest_rank(carved, tmp_path):
    """Across processes every teacher forward gathers the sharded layers from every rank, so each rank runs as many
    forwards as the busiest one: rank 1 computes only its own batches and pads every round with one-token (teacher
    pass) or one-window (sampling) forwards up to the other rank's count."""
    from moeify.distill import DistillSettings
    from moeify.tuning.data import SAMPLE_BATCH, drawn_windows, sampled_windows
    from moeify.tuning.state import _atomic_save
    from moeify.tuning.teacher import TARGET_BATCH, teacher_pass

    dense, _ = carved
    teacher = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    calls = []
    teacher.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    gen = torch.Generator().manual_seed(0)
    train, held = torch.randint(0, 64, (40, 16), generator=gen), torch.randint(0, 64, (3, 16), generator=gen)
    settings = DistillSettings(tokens=40 * 16, seed=0, micro_windows=1, batch_tokens=4 * 16)
    real = drawn_windows(40, 0, 4, 10)
    n_jobs = 1 + -(-len(real) // TARGET_BATCH)  # the held-out windows, then the drawn real ones 16 at a time
    root = tmp_path / "state"
    root.mkdir()
    targets, held_t = teacher_pass(root, teacher, train, held, None, settings, None, _OtherRankBusier(2))
    files = sorted(int(f.name[6:11]) for f in (root / "targets").glob("batch-*.safetensors"))
    assert files == list(range(1, n_jobs, 2))  # rank 1's jobs only
    own = sum(len(load_file(str(root / "targets" / f"batch-{b:05d}.safetensors"))["index"]) for b in files)
    assert calls.count((1, 16)) == own  # one window a forward, as the loop batches them
    assert calls.count((1, 1)) == 2 * -(-n_jobs // 2)  # every round padded to the busier rank's count
    assert len(calls) == own + 2 * -(-n_jobs // 2) and held_t.numel() == 0  # the held-out job is rank 0's

    folder, window = root / "sampled", {"windows": torch.zeros(1, 16, dtype=torch.long),
                                        "hidden": torch.zeros(1, 16, 8, dtype=torch.float16)}
    folder.mkdir()
    _atomic_save(window, folder / "batch-00000.safetensors")  # rank 0's batch
    steps = [(1, 4)] + [(1, 1)] * 12  # a prompt of 4 tokens, then one forward per new token (and one more)
    runs = []
    for done in (False, True):
        calls.clear()
        if done:
            _atomic_save(window, folder / "batch-00001.safetensors")  # rank 1's batch is done already
        sampled_windows(teacher, train, SAMPLE_BATCH + 1, 0, folder, None, _OtherRankBusier(0))
        runs.append(list(calls))
    assert runs == [steps, steps]  # its own last window, then a one-window stand-in: the same forwards


def test_gpu_sample_batch_fills_half_the_free_memory_between_64_and_1024_windows():
    """On a GPU sampling is launch-bound, so the batch grows into half the free memory (at the memory model's
    bytes a window), never below the CPU's 64 (what the memory check counted) nor above 1,024 or the run's need."""
    from moeify.memory import sampling_bytes_per_window
    from moeify.tuning.data import gpu_sample_batch

    w = sampling_bytes_per_window(seq=512, n_layers=30, kv_heads=3, head_dim=64, hidden=576, vocab=49152)
    assert w == 512 * (30 * 2 * 3 * 64 * 4 + 576 * 4) + 49152 * 8  # SmolLM2-135M: 25.2 MB a window
    assert gpu_sample_batch(10 * 10**9, w, 10_000) == int(0.5 * 10 * 10**9 // w) == 198
    assert gpu_sample_batch(10 * 10**9, w, 150) == 150  # no more than the run samples
    assert gpu_sample_batch(10**9, w, 10_000) == 64  # too little free: the CPU's batch, as the check counted
    assert gpu_sample_batch(140 * 2**30, w, 10_000) == 1024


def test_attention_shape_defaults_and_explicit_values():
    """One reading of a config's attention shape for the source check and the sampling batch: kv heads default to
    the query heads, head_dim to hidden / heads; explicit values win (SmolLM2: 9 heads, 3 kv heads, 64)."""
    from transformers import LlamaConfig

    from moeify.families import attention_shape

    assert attention_shape(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)) == (9, 3, 64)
    bare = LlamaConfig(hidden_size=64, num_attention_heads=4)
    bare.num_key_value_heads, bare.head_dim = None, None
    assert attention_shape(bare) == (4, 4, 16)
    assert attention_shape(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)) == (4, 4, 32)


def test_sampling_resumes_at_the_batch_size_it_started_with(carved, tmp_path, monkeypatch):
    """The batch size is kept in the sampling folder: a run resumed on another machine (or with less GPU memory
    free) samples its remaining batches at the size, and so under the seeds, of its first ones."""
    import moeify.tuning.data as tune_data
    from moeify.parallel import Parallel
    from moeify.tuning.data import sampled_windows

    dense, _ = carved
    teacher = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    real = torch.randint(0, 64, (10, 16), generator=torch.Generator().manual_seed(0))
    folder = tmp_path / "sampled"
    folder.mkdir()
    (folder / "batch.json").write_text(json.dumps({"sample_batch": 3}))
    windows, size = sampled_windows(teacher, real, 7, 0, folder, None, Parallel())
    assert size == 3 and windows.shape == (7, 16)
    assert sorted(f.name for f in folder.glob("batch-*")) == [f"batch-{b:05d}.safetensors" for b in range(3)]
    fresh = tmp_path / "fresh"
    windows2, size2 = sampled_windows(teacher, real, 7, 0, fresh, None, Parallel())
    assert size2 == 64 and json.loads((fresh / "batch.json").read_text()) == {"sample_batch": 64}  # a CPU's
    assert torch.equal(windows2[:, :4], windows[:, :4]) and not torch.equal(windows2, windows)  # same prompts;
    # the batches' own seeds give other text
    monkeypatch.setattr(tune_data, "sample_batch_for", lambda *a: 5)  # as a GPU would choose
    (fresh / "batch.json").unlink()  # a state from before batch.json: its batches were 64 windows, wherever it ran
    assert sampled_windows(teacher, real, 7, 0, fresh, None, Parallel())[1] == 64
    assert sampled_windows(teacher, real, 7, 0, tmp_path / "gpu", None, Parallel())[1] == 5  # a new run: chosen


def test_teacher_pass_frees_the_teachers_ffns_and_trains_what_the_teacher_in_the_loop_trains(carved, tmp_path,
                                                                                          monkeypatch):
    """The teacher pass computes the teacher's targets of every real window the run draws (and of the held-out
    windows) before tuning and frees the teacher's carved FFNs: the loop never runs the teacher (a freed FFN raises
    if called). The targets are the values the teacher in the loop computes (float32, the same batching), so the
    output is bit-identical to the run with the teacher inside the loop."""
    import moeify.distill as distill_mod
    from moeify.tuning.teacher import _FreedFFN

    dense, carve = carved
    # real text only: a run with the teacher in the loop keeps no sampled hidden states (it computes them there)
    opts = TuneOptions(tokens=8 * 1024, generated=0.0, lr=0.02)
    cached, loop = _copy(carve, tmp_path / "cached"), _copy(carve, tmp_path / "loop")
    seen, real = {}, distill_mod.distill

    def spy(teacher, *args, **kw):
        seen.setdefault("freed", []).append([isinstance(layer.mlp, _FreedFFN) for layer in teacher.model.layers])
        return real(teacher, *args, **kw)

    monkeypatch.setattr(distill_mod, "distill", spy)
    ra = tune_output(dense, cached, opts)["tuning"]["runs"][0]
    rb = tune_output(dense, loop, opts, precompute_targets=False)["tuning"]["runs"][0]
    assert seen["freed"] == [[True, True, True], [False, False, False]]
    assert ra["holdout_curve"] == rb["holdout_curve"]
    _assert_identical(cached, loop)


def test_offloaded_tuning_trains_what_plain_tuning_trains_and_resumes(carved, tmp_path):
    """--offload (FSDP2 CPU offload over a one-process group; on a CPU only the code path changes): the same
    held-out curve and weights as the plain run, and an offloaded run interrupted mid-way resumes to the weights of
    the uninterrupted offloaded run (its optimizer state goes through FSDP2's sharded tensors). Tolerance as for
    two processes: FSDP2's gradient path rounds differently at 1e-7, which Adam's normalised steps carry into the
    weights (measured: under 2% of what tuning moved each tensor; bound 5%)."""
    import torch.distributed as dist

    dense, carve = carved
    opts = TuneOptions(tokens=8 * 1024, generated=0.25, lr=0.02)
    plain, off, cut = (_copy(carve, tmp_path / n) for n in ("plain", "off", "cut"))
    ra = tune_output(dense, plain, opts)["tuning"]["runs"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rb = tune_output(dense, off, opts, offload=True)["tuning"]["runs"][0]
    # the student's MoE blocks return tensors of their own: FSDP2 warns of views (an in-place op would skip its hook)
    assert not [str(w.message) for w in caught if "returned a view" in str(w.message)]
    assert not dist.is_initialized()  # the one-process group is gone with the run
    assert rb["offload"] and not ra["offload"]
    for (sa, ka), (sb, kb) in zip(ra["holdout_curve"], rb["holdout_curve"]):
        assert sa == sb and kb == pytest.approx(ka, rel=1e-5)
    _assert_trained_alike(plain, off, carve)
    with pytest.raises(TuningInterrupted):
        tune_output(dense, cut, opts, offload=True, save_every=0, progress=_interrupt_at(4 * 1024))
    assert not dist.is_initialized()
    tune_output(dense, cut, None, resume=True, offload=True)
    _assert_identical(off, cut)


def test_offload_is_chosen_when_the_gpu_is_too_small_otherwise(carved):
    """The memory model moves the student's state to the host with offload (GPU runs only), and auto picks offload
    exactly when the plain run does not fit the GPU and the offloaded one does."""
    import moeify.memory as memory_mod
    from moeify.families import load_source
    from moeify.memory import choose_offload, source_tuning_memory

    dense, _ = carved
    src = load_source(dense)
    kw = dict(bf16=True, sample_batch=1)  # the tiny model's peak is its tuning, not its sampling
    plain = source_tuning_memory(src, 4, device="cuda", **kw)
    off = source_tuning_memory(src, 4, device="cuda", offload=True, **kw)
    assert plain.peak == plain.tuning_peak
    assert off.host == plain.student and off.peak < plain.peak and plain.host == 0
    assert source_tuning_memory(src, 4, device="cpu", offload=True) == source_tuning_memory(src, 4, device="cpu")
    assert not choose_offload(plain, off, "cuda", plain.peak)  # fits as it is
    assert choose_offload(plain, off, "cuda", plain.peak - 1)  # only offloaded
    assert not choose_offload(plain, off, "cpu", 1)  # never on a CPU
    orig = memory_mod.device_memory
    try:
        memory_mod.device_memory = lambda device: off.host - 1  # the host cannot hold the state either
        assert not choose_offload(plain, off, "cuda", plain.peak - 1)
    finally:
        memory_mod.device_memory = orig
    # a 70B-shaped prediction: 8B on one 80 GB GPU fits only offloaded (README "Tuning an 8B / 70B model")
    from moeify.memory import tuning_memory

    llama8b = dict(hidden=4096, d_ff=14336, n_layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False,
                   experts=42, bf16=True, device="cuda")
    assert tuning_memory(**llama8b).peak > 80e9 > tuning_memory(**llama8b, offload=True).peak


def test_a_run_that_does_not_fit_is_refused_before_any_work(carved, tmp_path, monkeypatch):
    import moeify.memory as memory_mod
    import moeify.tuning.sizing as tune_sizing

    dense, carve = carved
    monkeypatch.setattr(memory_mod, "device_memory", lambda device: 50 * 10**6)  # a 50 MB device
    monkeypatch.setattr(tune_sizing, "device_memory", lambda device: 50 * 10**6)
    cfg = build_config(**CARVE, tune_tokens=4096)
    with pytest.raises(MoeifyError, match=r"tuning needs about 0\.\d GB on cpu .* has 0\.1 GB.*--no-memory-check"):
        run_conversion(plan_conversion(dense, cfg), tmp_path / "moe")
    assert not any(tmp_path.iterdir())  # refused before calibrating: nothing written
    out = _copy(carve, tmp_path / "out")
    with pytest.raises(MoeifyError, match="tuning needs about"):
        tune_output(dense, out, OPTS)
    assert not state_dir(out).exists()
    with pytest.raises(MoeifyError, match="tuning needs about"):  # the dry run too, before loading anything
        estimate_run(dense, out, OPTS)
    report = tune_output(dense, out, TuneOptions(tokens=1024, generated=0.25), memory_check=False)
    assert report["tuning"]["tokens"] == 1024


def test_plan_prints_the_tuning_memory(carved):
    from typer.testing import CliRunner

    from moeify.cli import app
    from moeify.families import load_source
    from moeify.memory import source_tuning_memory

    dense, _ = carved
    res = CliRunner().invoke(app, ["plan", str(dense), "--experts", "4", "--top-k", "2", "--json", "-"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("{"):])["tuning_memory"]
    assert [(r["device"], r["processes"], r.get("offload", False)) for r in rows] == [
        ("cpu", 1, False), ("cuda", 1, False), ("cuda", 1, True), ("cuda", 2, False), ("cuda", 4, False),
        ("cuda", 8, False), ("cuda", 8, True)]
    assert rows[0]["peak"] == source_tuning_memory(load_source(dense), 4).peak
    assert rows[1]["peak"] > rows[3]["peak"] > rows[5]["peak"]  # sharding the teacher and the student's state helps
    assert rows[2]["host"] > rows[1]["host"] > 0 and rows[2]["peak"] <= rows[1]["peak"]  # + the offloaded state
    assert rows[6]["peak"] <= rows[5]["peak"] and rows[6]["host"] == rows[2]["host"]  # the state, split 8 ways


def test_the_memory_model_shards_the_teacher_across_processes():
    """Across processes every decoder layer's attention and FFN of the teacher is split (FSDP2), so the per-process
    peak of a 70B model falls with the GPU count, and 8 x 80 GB GPUs fit it offloaded (README "Tuning an 8B / 70B
    model"); a refused run names the layout that fits."""
    from moeify.memory import GPU_COUNTS, tuning_memory

    llama70b = dict(hidden=8192, d_ff=28672, n_layers=80, heads=64, kv_heads=8, head_dim=128, vocab=128256,
                    tied=False, experts=42, bf16=True, device="cuda")
    one = tuning_memory(**llama70b)
    proj, ffn, embed = 8192 * 8192 * 2 + 8192 * 1024 * 2, 3 * 8192 * 28672, 2 * 128256 * 8192 + 8192
    assert one.teacher == 4 * (embed + 80 * (proj + 2 * 8192 + ffn))
    for g in GPU_COUNTS[1:]:
        m = tuning_memory(**llama70b, world=g)
        assert m.teacher == 4 * (embed + 80 * 2 * 8192) + -(-4 * 80 * (proj + ffn) // g) + 2 * 4 * ffn
        assert m.teacher_freed == -(-4 * 80 * ffn // g)
    eight = tuning_memory(**llama70b, world=8, offload=True)
    assert eight.peak < 80e9 < tuning_memory(**llama70b, world=8).peak
    assert eight.host_total == eight.host * 8 + eight.save_host


def test_outputs_that_cannot_be_tuned_are_refused_clearly(carved, tmp_path):
    from conftest import edit_json

    dense, carve = carved
    exact = tmp_path / "exact"
    run_conversion(plan_conversion(dense, build_config(experts=4, top_k=4, **CALIB)), exact)
    with pytest.raises(MoeifyError, match=r"every expert is active \(top-k 4 of 4\).*nothing to tune"):
        tune_output(dense, exact, OPTS)
    old = _copy(carve, tmp_path / "old")
    edit_json(old / "report.json", lambda r: [e.pop("perm") for e in r["layers"]])
    with pytest.raises(MoeifyError, match="layer 0 has no neuron permutation"):
        tune_output(dense, old, OPTS)
    with pytest.raises(MoeifyError, match="--resume and --restart contradict"):
        tune_output(dense, old, None, resume=True, restart=True)
    with pytest.raises(MoeifyError, match=r"--tokens must be a positive integer"):
        tune_output(dense, _copy(carve, tmp_path / "zero"), TuneOptions(tokens=0))
    assert not any(state_dir(p).exists() for p in (exact, old))


def test_a_saved_state_is_written_one_tensor_at_a_time(tmp_path):
    """The run's state is streamed to disk: each tensor is produced (gathered, across processes) when it is written
    and dropped before the next, so the writing rank never holds the whole state; a rank that does not write takes
    part in the gathering and writes nothing."""
    import weakref

    from moeify.distill import Pending
    from moeify.tuning.state import SavedTensors, _stream_save

    alive, produced = [], []

    def pending(i: int) -> Pending:
        def produce():
            assert all(ref() is None for ref in alive), "an earlier tensor is still held"
            t = torch.full((1000,), float(i))
            alive.append(weakref.ref(t))
            produced.append(i)
            return t
        return Pending((1000,), torch.float32, produce)

    tensors = {**{f"param.{i}": pending(i) for i in range(5)}, "stream.order": torch.arange(3)}
    _stream_save(tensors, tmp_path / "state.safetensors", True)
    saved = SavedTensors(tmp_path / "state.safetensors")
    assert saved.keys() == set(tensors) and torch.equal(saved["stream.order"], torch.arange(3))
    assert all(torch.equal(saved.pop(f"param.{i}"), torch.full((1000,), float(i))) for i in range(5))
    assert "param.0" not in saved and [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]
    alive.clear()
    _stream_save(tensors, tmp_path / "other.safetensors", False)
    assert produced == [0, 1, 2, 3, 4] * 2 and not (tmp_path / "other.safetensors").exists()


def test_a_sharded_student_is_sharded_layer_by_layer_as_it_is_built(carved, monkeypatch):
    """Across processes each MaskedMoE is handed to FSDP2 as soon as it is built, so no rank holds the whole
    student's experts at once (a 70B student is 224 GB in float32)."""
    import moeify.moe_block as moe_block_mod
    from moeify.checkpoint import CheckpointReader
    from moeify.tuning import build_student, read_output

    built, seen = [], []

    class Recorded(moe_block_mod.MaskedMoE):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            built.append(self)

    def shard_moe(moe):
        seen.append((len(built), sum(getattr(m, "sharded", False) for m in built)))
        moe.sharded = True

    monkeypatch.setattr(moe_block_mod, "MaskedMoE", Recorded)
    dense, carve = carved
    teacher = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    reader = CheckpointReader(carve)
    try:
        student, _ = build_student(teacher, read_output(carve), reader, "cpu", shard_moe=shard_moe)
    finally:
        reader.close()
    assert seen == [(i + 1, i) for i in range(len(teacher.model.layers))]  # each sharded before the next exists
    assert [layer.mlp for layer in student.model.layers] == built


def test_tuning_on_real_text_only_reads_every_target_from_the_teacher_pass(carved, tmp_path):
    """--tune-generated 0: no sampled text, so every training window's target comes from the teacher pass (a loop
    variable once shadowed the index of the first sampled window there, and real windows past it were looked up
    among sampled files that do not exist)."""
    dense, carve = carved
    out = _copy(carve, tmp_path / "real-only")
    run = tune_output(dense, out, TuneOptions(tokens=8 * 1024, generated=0.0, lr=0.02))["tuning"]["runs"][0]
    assert "generated" not in run["text"]
    assert run["holdout_kl_after"] < run["holdout_kl_before"]
