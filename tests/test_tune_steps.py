"""The tuning step at a GPU's size, checked on the CPU: how a run sizes its steps (moeify.tuning.sizing.step_size),
that one large step trains what the same tokens as accumulated micro-batches train, that the grouped and masked
MoE kernels train alike, and that runs with large steps, micro-batches of several windows and the teacher in the
loop resume bit-identically from what run.json recorded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moeify.errors import MoeifyError
from moeify.tuning import TuneOptions, TuningInterrupted, read_output, state_dir, tune_output
from moeify.tuning.sizing import MAX_STEP, REFERENCE_STEP, step_size
from tuning_fixtures import assert_identical, copy_output, interrupt_at
from tuning_fixtures import carved  # noqa: F401 (a fixture)

SEQ = 64  # the carve's windows


def _gpu_with(monkeypatch, have: float) -> None:
    import moeify.maths.memory as memory

    monkeypatch.setattr(memory, "device_memory", lambda dev: int(have) if dev.startswith("cuda") else 24 << 30)


def test_a_cpu_steps_1024_tokens_one_window_at_a_time(carved):
    dense, carve = carved
    bo = read_output(carve)
    assert step_size(dense, bo, TuneOptions(tokens=16 << 20), SEQ, "cpu") == (REFERENCE_STEP, 1)
    assert step_size(dense, bo, TuneOptions(tokens=1 << 20, step_tokens=4096), SEQ, "cpu") == (4096, 1)


def test_a_gpu_step_is_the_tokens_over_256_and_its_forward_as_large_as_memory_allows(carved, monkeypatch):
    dense, carve = carved
    bo = read_output(carve)
    _gpu_with(monkeypatch, 80e9)  # the tiny model: every micro-batch fits
    assert step_size(dense, bo, TuneOptions(tokens=1 << 20), SEQ, "cuda") == (4096, 4096 // SEQ)
    assert step_size(dense, bo, TuneOptions(tokens=16 << 20), SEQ, "cuda") == (MAX_STEP, 512)  # MAX_MICRO windows
    assert step_size(dense, bo, TuneOptions(tokens=64 << 20), SEQ, "cuda") == (MAX_STEP, 512)  # capped
    assert step_size(dense, bo, TuneOptions(tokens=65536), SEQ, "cuda") == (REFERENCE_STEP, REFERENCE_STEP // SEQ)
    assert step_size(dense, bo, TuneOptions(tokens=1 << 20), SEQ, "cuda", world=2) == (4096, 4096 // SEQ // 2)
    assert step_size(dense, bo, TuneOptions(tokens=1 << 20, step_tokens=2048), SEQ, "cuda") == (2048, 32)

    from moeify.training.distill import DistillSettings
    from moeify.tuning.sizing import GPU_STEP_SHARE, predicted_memory

    opts = TuneOptions(tokens=16 << 20)
    peak = {m: predicted_memory(dense, bo, opts, SEQ, "cuda", DistillSettings(tokens=1, micro_windows=m)).peak
            for m in (8, 16)}
    _gpu_with(monkeypatch, (peak[8] + peak[16]) / 2 / GPU_STEP_SHARE)  # 8 windows a forward fit, 16 do not
    step, micro = step_size(dense, bo, opts, SEQ, "cuda")
    assert micro == 8 and step == MAX_STEP and (step // SEQ) % micro == 0


def test_one_large_step_trains_what_accumulated_micro_batches_train():
    """A step of 8 windows as one forward + backward, or as 8 accumulated ones: the same gradients (float32, to
    1e-5 of their size) and, over a run of 6 such steps, the same weights (to 1e-4 of what tuning moved them)."""
    from test_tune import _tiny_student

    from moeify.training.distill import DistillSettings, accumulate_kl, distill

    teacher, student, ids = _tiny_student()
    head = student.lm_head.weight
    grads = []
    for micro in (8, 1):
        student.zero_grad(set_to_none=True)
        for p in student.parameters():
            p.requires_grad_(True)
        kl = accumulate_kl(teacher, student, ids[:8], head, torch.autocast("cpu", enabled=False),
                           DistillSettings(tokens=1, micro_windows=micro))
        grads.append(({n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}, kl.item()))
    (g8, kl8), (g1, kl1) = grads
    assert kl8 == pytest.approx(kl1, rel=1e-5) and g8.keys() == g1.keys() and len(g8) > 0
    for n in g8:
        assert (g8[n] - g1[n]).norm() <= 1e-5 * g1[n].norm() + 1e-12, n

    runs = []
    for micro in (8, 1):
        teacher, student, ids = _tiny_student()
        start = {n: p.detach().clone() for n, p in student.named_parameters()}
        info = distill(teacher, student, ids[:20], ids[20:], DistillSettings(
            tokens=6 * 8 * ids.shape[1], batch_tokens=8 * ids.shape[1], micro_windows=micro, autocast="off",
            lr=0.03, evals=2))
        runs.append(({n: p.detach().clone() for n, p in student.named_parameters()}, info))
    (w8, i8), (w1, i1) = runs
    assert i8["steps"] == i1["steps"] == 6 and i8["micro_windows"] == 8
    moved = max((w1[n] - start[n]).abs().max().item() for n in w1)
    assert moved > 1e-3
    for n in w8:
        assert (w8[n] - w1[n]).abs().max().item() <= 1e-4 * moved, n


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_and_masked_kernels_train_alike_under_bf16():
    """The same run under bf16 autocast with the grouped kernel and with the masked one: the held-out KL along the
    run within 1%, and the weights nearer each other than bf16 training is to float32 training (measured: 10% of
    what tuning moved them, against 27%: the kernels differ by bf16 rounding, carried by Adam's steps)."""
    from test_tune import _tiny_student

    from moeify.training.distill import DistillSettings, distill

    runs = {}
    for kernel, autocast in (("grouped", "bf16"), ("masked", "bf16"), ("masked", "off")):
        teacher, student, ids = _tiny_student()
        start = torch.cat([p.detach().flatten() for p in student.parameters()])
        info = distill(teacher, student, ids[:20], ids[20:], DistillSettings(
            tokens=8 * 4 * ids.shape[1], batch_tokens=4 * ids.shape[1], micro_windows=4, autocast=autocast,
            lr=0.03, evals=2, moe_kernel=kernel))
        runs[kernel, autocast] = (torch.cat([p.detach().flatten() for p in student.parameters()]), info)
    (wg, ig), (wm, im), (w32, _) = runs["grouped", "bf16"], runs["masked", "bf16"], runs["masked", "off"]
    assert ig["moe_kernel"] == "grouped" and im["moe_kernel"] == "masked"
    assert ig["holdout_kl_after"] < 0.9 * ig["holdout_kl_before"]
    for (_, kg), (_, km) in zip(ig["holdout_curve"], im["holdout_curve"]):
        assert kg == pytest.approx(km, rel=0.01)
    moved = (wm - start).norm()
    assert (wg - wm).norm() / moved < 0.6 * (wm - w32).norm() / moved


def test_a_run_with_large_steps_and_the_teacher_in_the_loop_resumes_bit_identically(carved, tmp_path, monkeypatch):
    """A run sized as a GPU sizes it (here: 2,048-token steps of 4-window forwards, the teacher in the loop, no
    sampled hidden states kept) records its step in run.json; interrupted and resumed it ends with the weights of
    the uninterrupted run, though the resumed process would size its steps otherwise."""
    import moeify.tuning.run as run_mod

    monkeypatch.setattr(run_mod, "step_size", lambda *a, **k: (2048, 4))
    dense, carve = carved
    a, b = copy_output(carve, tmp_path / "a"), copy_output(carve, tmp_path / "b")
    opts = TuneOptions(tokens=6 * 2048, generated=0.25, lr=0.02)
    whole = tune_output(dense, a, opts, precompute_targets=False)["tuning"]["runs"][0]
    assert (whole["batch_tokens"], whole["micro_windows"], whole["teacher"], whole["steps"]) == (2048, 4, "inline", 6)
    assert whole["lr_scale"] == pytest.approx(2 ** 0.5, abs=1e-4)
    with pytest.raises(TuningInterrupted) as stop:
        tune_output(dense, b, opts, progress=interrupt_at(3 * 2048), precompute_targets=False)
    assert stop.value.step == 3
    root = state_dir(b)
    run = json.loads((root / "run.json").read_text())
    assert (run["options"]["step_tokens"], run["micro_windows"], run["teacher"]) == (2048, 4, "inline")
    for f in root.glob("sampled/batch-*.safetensors"):
        with safe_open(str(f), "pt") as h:
            assert set(h.keys()) == {"windows"}  # the teacher computes their targets in the loop
    assert not any(root.glob("targets/batch-*"))
    monkeypatch.setattr(run_mod, "step_size", lambda *a, **k: pytest.fail("a resumed run steps as recorded"))
    with pytest.raises(MoeifyError, match="step_tokens = 2048"):
        tune_output(dense, b, None, resume=True, given={"step_tokens": 1024})
    resumed = tune_output(dense, b, None, resume=True)["tuning"]["runs"][0]
    assert_identical(a, b)
    assert resumed["holdout_curve"] == whole["holdout_curve"] and resumed["train_kl_end"] == whole["train_kl_end"]


def test_step_tokens_refused_when_not_a_positive_integer_and_old_records_step_1024():
    with pytest.raises(MoeifyError, match="--step-tokens must be a positive integer"):
        TuneOptions(tokens=1024, step_tokens=0).validate()
    assert TuneOptions.from_record({"tokens": 4096}).step_tokens == 1024  # a state saved before steps were sized


def test_the_teacher_runs_in_the_loop_only_on_one_gpu_with_room_for_its_ffns(carved, monkeypatch):
    """The teacher in the loop keeps its FFNs (bf16 under autocast) beside the student: the memory model counts
    them, and a run takes the teacher pass instead where they would not fit, across processes, offloaded, or on a
    CPU."""
    from moeify.tuning.sizing import predicted_memory, teacher_inline

    dense, carve = carved
    bo, opts = read_output(carve), TuneOptions(tokens=1 << 20)
    inline = predicted_memory(dense, bo, opts, SEQ, "cuda", inline=True)
    passed = predicted_memory(dense, bo, opts, SEQ, "cuda")
    assert inline.tuning_peak > passed.tuning_peak and inline.teacher_freed < passed.teacher_freed
    _gpu_with(monkeypatch, 80e9)
    assert teacher_inline(dense, bo, opts, SEQ, "cuda")
    assert not teacher_inline(dense, bo, opts, SEQ, "cuda", world=2)
    assert not teacher_inline(dense, bo, opts, SEQ, "cuda", offload=True)
    assert not teacher_inline(dense, bo, opts, SEQ, "cpu")
    import moeify.tuning.sizing as sizing  # a GPU with room for the pass's run and not the loop's (the tiny model's
    # peak is its sampling, the same either way: the decision is checked against a stand-in model)
    monkeypatch.setattr(sizing, "predicted_memory", lambda *a, inline=False, **k: type("M", (), {
        "peak": 2 * passed.tuning_peak if inline else passed.tuning_peak})())
    _gpu_with(monkeypatch, 1.5 * passed.tuning_peak)
    assert not teacher_inline(dense, bo, opts, SEQ, "cuda")
    _gpu_with(monkeypatch, 2 * passed.tuning_peak)
    assert teacher_inline(dense, bo, opts, SEQ, "cuda")


def test_a_padded_last_sampling_batch_keeps_its_rows_and_shape(carved):
    """sample_text(pad=True): a last batch smaller than the batch size is sampled at the full size (a compiled GPU
    decoding then sees one shape) and only its own rows come back, the windows and hidden states alike."""
    from transformers import AutoModelForCausalLM

    from moeify.training.sampling import sample_text

    dense, _ = carved
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    prompts = torch.randint(0, 200, (5, 4), generator=torch.Generator().manual_seed(3))
    shapes = []
    hook = model.register_forward_hook(lambda m, a, kw, o: shapes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        windows, hidden = sample_text(model, prompts, 6, 0, batch=4, keep_hidden=True, pad=True)
    finally:
        hook.remove()
    assert windows.shape == (5, 10) and hidden.shape[:2] == (5, 10)
    assert set(shapes) == {4}  # every forward at the batch size, the last batch's too
    assert torch.equal(windows[:, :4], prompts)


@pytest.mark.parametrize("kernel,autocast", [("masked", "off"), ("grouped", "bf16")])
def test_the_compiled_step_trains_what_the_eager_one_trains(monkeypatch, kernel, autocast):
    """The training step's forwards through torch.compile (MOEIFY_COMPILE_MODEL=1; here the aot_eager backend, which
    traces the models and the MoE block into graphs as inductor does but runs them with eager kernels, so CI needs
    no compiler): a run of 4 steps lands on the eager run's weights (to 1e-5 of what tuning moved them in float32,
    2e-2 under bf16 autocast) and says it was compiled; the masked kernel in float32, the grouped one (a GPU's) in
    bf16, both traced."""
    from test_tune import _tiny_student

    from moeify.training.distill import DistillSettings, distill

    monkeypatch.setenv("MOEIFY_COMPILE_BACKEND", "aot_eager")
    runs = {}
    for compiled in ("0", "1"):
        monkeypatch.setenv("MOEIFY_COMPILE_MODEL", compiled)
        torch._dynamo.reset()
        teacher, student, ids = _tiny_student()
        start = {n: p.detach().clone() for n, p in student.named_parameters()}
        info = distill(teacher, student, ids[:20], ids[20:], DistillSettings(
            tokens=4 * 4 * ids.shape[1], batch_tokens=4 * ids.shape[1], micro_windows=2, autocast=autocast, lr=0.03,
            evals=2, moe_kernel=kernel))
        runs[compiled] = ({n: p.detach().clone() for n, p in student.named_parameters()}, info)
    (w0, i0), (w1, i1) = runs["0"], runs["1"]
    assert i0["compiled"] is False and i1["compiled"] is True and i1["moe_kernel"] == kernel
    flat = [torch.cat([w[n].flatten() for n in sorted(w)]) for w in (start, w0, w1)]
    moved = (flat[1] - flat[0]).norm()
    assert moved > 1e-2
    # float32: the same kernels in the same order; bf16: rounding in another order, and the rare routing choice it
    # flips (measured 0.2% of the movement; bf16 against float32 training: 27%, test_grouped_and_masked_kernels_...)
    tol = 1e-5 if autocast == "off" else 2e-2
    assert (flat[2] - flat[1]).norm() <= tol * moved
    assert i1["holdout_kl_after"] == pytest.approx(i0["holdout_kl_after"], rel=max(tol, 1e-5))


def test_the_step_compiles_on_a_gpu_by_default_and_the_environment_overrides(monkeypatch):
    """compile_model None: compiled where the student is on one GPU, unsharded (measured faster there: BENCHMARKS.md
    "GPU"), eager on a CPU or under FSDP2; MOEIFY_COMPILE_MODEL=0 / 1 overrides either way, MOEIFY_COMPILE=0 turns it
    off, and a setting given explicitly is kept."""
    from moeify.training.distill import DistillSettings, wants_compile

    for name in ("MOEIFY_COMPILE_MODEL", "MOEIFY_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    auto = DistillSettings(tokens=1024)
    assert auto.compile_model is None
    assert wants_compile(auto, torch.device("cuda", 0)) is True
    assert wants_compile(auto, torch.device("cuda", 0), sharded=True) is False  # FSDP2 or offload: not measured
    assert wants_compile(auto, torch.device("cpu")) is False
    assert wants_compile(DistillSettings(tokens=1024, compile_model=True), torch.device("cpu")) is True
    assert wants_compile(DistillSettings(tokens=1024, compile_model=False), torch.device("cuda")) is False
    monkeypatch.setenv("MOEIFY_COMPILE_MODEL", "0")
    assert wants_compile(auto, torch.device("cuda")) is False
    monkeypatch.setenv("MOEIFY_COMPILE_MODEL", "1")
    assert wants_compile(auto, torch.device("cpu")) is True
    monkeypatch.setenv("MOEIFY_COMPILE", "0")
    assert wants_compile(auto, torch.device("cuda")) is False


def test_layer_match_is_zero_on_the_teachers_states_one_on_zeros_and_has_the_students_gradient():
    """moeify.training.hidden.layer_match: per layer the tokens' squared error relative to the teacher's squared norm,
    averaged over tokens and layers; the teacher's side is never differentiated."""
    from moeify.training.hidden import layer_match

    g = torch.Generator().manual_seed(0)
    teacher = [torch.randn(2, 5, 8, generator=g) * (i + 1) for i in range(3)]
    assert layer_match([t.clone() for t in teacher], teacher).item() == 0.0
    assert abs(layer_match([torch.zeros_like(t) for t in teacher], teacher).item() - 1.0) < 1e-6
    half = layer_match([t * 0.5 for t in teacher], teacher).item()
    assert abs(half - 0.25) < 1e-6  # scale-free: every layer's error a quarter of its norm, whatever the norm
    student = [(t + 0.1 * torch.randn(t.shape, generator=g)).requires_grad_() for t in teacher]
    leaf = [t.clone().requires_grad_() for t in teacher]
    layer_match(student, leaf).backward()
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in student)
    assert all(t.grad is None for t in leaf)
    with pytest.raises(ValueError, match="2 student and 3 teacher layers"):
        layer_match(student[:2], teacher)
