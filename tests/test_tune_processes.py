"""`moeify tune` across processes (torchrun, 2 CPU processes, gloo): FSDP2 trains what one process trains, in float32
and under bf16 autocast; every rank runs the teacher pass and the sampling in step; the student sharded as it is built."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moeify.evaluation.verify import verify_checkpoint
from tuning_fixtures import assert_trained_alike, one_and_two_processes, tensors_of
from tuning_fixtures import carved  # noqa: F401 (a fixture)


def test_two_processes_with_fsdp2_train_what_one_process_trains(carved, tmp_path):
    """torchrun with 2 CPU processes (gloo): the student's MaskedMoEs sharded by FSDP2, each step's windows split
    across the ranks, with --tune-attention (each decoder layer's own attention and norms one more FSDP2 group; the
    bf16 test below runs without it). Same held-out KL trajectory and final weights as one process on the same
    tokens, within float rounding of the different reduction order, which Adam's normalised steps carry into the
    weights (stated tolerance: 1e-4 relative on the held-out KL; on every tensor, the two runs differ by under 5% of
    what tuning changed in it); the attention and norm weights of the output moved (they were trained) in both."""
    dense, carve = carved
    ra, rb = one_and_two_processes(dense, carve, tmp_path, ["--tokens", str(8 * 1024), "--tune-generated", "0.25",
                                                             "--lr", "0.02", "--tune-attention"])
    assert rb["attention_trained"] and ra["attention_trained"]
    assert [s for s, _ in ra["holdout_curve"]] == [s for s, _ in rb["holdout_curve"]]
    for (_, ka), (_, kb) in zip(ra["holdout_curve"], rb["holdout_curve"]):
        assert kb == pytest.approx(ka, rel=1e-4)
    ta, tb, tc = tensors_of(tmp_path / "one"), tensors_of(tmp_path / "two"), tensors_of(carve)
    attn = [n for n in ta if "self_attn" in n or "layernorm" in n]
    assert attn and all(not torch.equal(ta[n], tc[n]) and not torch.equal(tb[n], tc[n]) for n in attn)
    assert_trained_alike(tmp_path / "one", tmp_path / "two", carve)  # untrained tensors: bit-identical
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
    ra, rb = one_and_two_processes(dense, carve, tmp_path, ["--tokens", str(4 * 1024), "--tune-generated", "0.25",
                                                             "--lr", "0.02"], autocast="bf16")
    assert ra["bf16_autocast"] and rb["bf16_autocast"] and ra["kl_logits"] == rb["kl_logits"] == "bf16"
    assert ra["text"]["generated"]["bf16_autocast"] and rb["text"]["generated"]["bf16_autocast"]  # sampled so too
    for (_, ka), (_, kb) in zip(ra["holdout_curve"], rb["holdout_curve"]):
        assert kb == pytest.approx(ka, rel=1e-4)
    assert_trained_alike(tmp_path / "one", tmp_path / "two", carve)


def test_router_only_across_two_processes_trains_the_routers_as_one_process_does(carved, tmp_path):
    """--router-only under FSDP2 (2 CPU processes, gloo): the frozen experts sharded beside the trained routers in
    each MaskedMoE's group; the same held-out curve as one process, every expert tensor of both outputs still the
    carve's, the routers moved alike."""
    dense, carve = carved
    ra, rb = one_and_two_processes(dense, carve, tmp_path, ["--tokens", str(4 * 1024), "--tune-generated", "0.25",
                                                             "--lr", "0.02", "--router-only"])
    assert ra["experts_trained"] is False and rb["experts_trained"] is False
    for (_, ka), (_, kb) in zip(ra["holdout_curve"], rb["holdout_curve"]):
        assert kb == pytest.approx(ka, rel=1e-4)
    ta, tb, tc = tensors_of(tmp_path / "one"), tensors_of(tmp_path / "two"), tensors_of(carve)
    assert all(torch.equal(ta[n], tc[n]) and torch.equal(tb[n], tc[n]) for n in tc if ".experts." in n)
    assert any(not torch.equal(ta[n], tc[n]) for n in tc if ".experts." not in n)
    assert_trained_alike(tmp_path / "one", tmp_path / "two", carve)


def test_teacher_pass_and_sampling_run_in_step_with_the_busiest_rank(carved, tmp_path):
    """Across processes every teacher forward gathers the sharded layers from every rank, so each rank runs as many
    forwards as the busiest one: rank 1 computes only its own batches and pads every round with one-token (teacher
    pass) or one-window (sampling) forwards up to the other rank's count."""
    from moeify.training.distill import DistillSettings
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


def test_a_sharded_student_is_sharded_layer_by_layer_as_it_is_built(carved, monkeypatch):
    """Across processes each MaskedMoE is handed to FSDP2 as soon as it is built, so no rank holds the whole
    student's experts at once (a 70B student is 224 GB in float32)."""
    import moeify.maths.moe_block as moe_block_mod
    from moeify.formats.checkpoint import CheckpointReader
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
