"""`moeify tune`'s memory: the memory model against what tuning holds, offloading, the fit check before any work,
`plan`'s tuning memory, the sampling batch a GPU's free memory allows, a saved state written a tensor at a time."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError
from moeify.tuning import TuneOptions, TuningInterrupted, estimate_run, state_dir, tune_output
from tuning_fixtures import CARVE, OPTS, assert_identical, assert_trained_alike, copy_output, interrupt_at
from tuning_fixtures import carved  # noqa: F401 (a fixture)


def test_memory_model_counts_what_tuning_holds(carved):
    """The memory model's teacher and student terms are the bytes of the tensors tuning really holds (its
    activation and KL terms are held against measured peaks in scripts/bench_memory.py, not here)."""
    from moeify.formats.checkpoint import CheckpointReader
    from moeify.training.distill import share_frozen
    from moeify.maths.moe_block import MaskedMoE
    from moeify.formats.families import load_source
    from moeify.maths.memory import source_tuning_memory
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


def test_the_memory_model_counts_what_layer_matching_holds(carved):
    """--hidden-weight: the teacher's layer outputs (float32 under bf16 autocast: the residual stream stays float32)
    and the errors against them that autograd saves for the backward pass, measured by saved_tensors_hooks on one
    window; the model's layer_match term is those bytes, and a GPU step's forward is sized with it."""
    from moeify.formats.families import load_source
    from moeify.maths.memory import source_tuning_memory
    from moeify.training.hidden import LayerOutputs, layer_match
    from moeify.tuning import read_output
    from moeify.tuning.sizing import predicted_memory
    from transformers import AutoModelForCausalLM

    dense, carve = carved
    src = load_source(dense)
    teacher = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    seq = 64
    ids = torch.randint(0, src.vocab, (1, seq))
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad(), LayerOutputs(teacher) as want:
            teacher(input_ids=ids)
        with LayerOutputs(student) as got:
            student(input_ids=ids)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = layer_match(got.outputs, want.outputs)
    held = sum(t.numel() * t.element_size() for t in want.outputs)
    per_layer = seq * src.hidden * 4
    assert all(t.dtype == torch.float32 for t in want.outputs) and held == src.n_layers * per_layer
    errors = sum(b for b in saved.values() if b == per_layer)  # the (1, seq, hidden) float32 errors
    assert errors == src.n_layers * per_layer and sum(saved.values()) - errors <= src.n_layers * seq * 8  # + norms
    loss.backward()
    kw = dict(seq=seq, bf16=True, teacher_inline=True)
    plain, matched = (source_tuning_memory(src, 4, layer_match=m, **kw) for m in (False, True))
    assert matched.activations - plain.activations == held + errors
    bo = read_output(carve)
    opts = TuneOptions(tokens=1 << 20)
    assert (predicted_memory(dense, bo, dataclasses.replace(opts, hidden_weight=1.0), seq, "cuda").activations
            - predicted_memory(dense, bo, opts, seq, "cuda", inline=True).activations) == held + errors


def test_offloaded_tuning_trains_what_plain_tuning_trains_and_resumes(carved, tmp_path):
    """--offload (FSDP2 CPU offload over a one-process group; on a CPU only the code path changes): the same
    held-out curve and weights as the plain run, and an offloaded run interrupted mid-way resumes to the weights of
    the uninterrupted offloaded run (its optimizer state goes through FSDP2's sharded tensors). Tolerance as for
    two processes: FSDP2's gradient path rounds differently at 1e-7, which Adam's normalised steps carry into the
    weights (measured: under 2% of what tuning moved each tensor; bound 5%)."""
    import torch.distributed as dist

    dense, carve = carved
    opts = TuneOptions(tokens=8 * 1024, generated=0.25, lr=0.02)
    plain, off, cut = (copy_output(carve, tmp_path / n) for n in ("plain", "off", "cut"))
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
    assert_trained_alike(plain, off, carve)
    with pytest.raises(TuningInterrupted):
        tune_output(dense, cut, opts, offload=True, save_every=0, progress=interrupt_at(4 * 1024))
    assert not dist.is_initialized()
    tune_output(dense, cut, None, resume=True, offload=True)
    assert_identical(off, cut)


def test_offload_is_chosen_when_the_gpu_is_too_small_otherwise(carved):
    """The memory model moves the student's state to the host with offload (GPU runs only), and auto picks offload
    exactly when the plain run does not fit the GPU and the offloaded one does."""
    import moeify.maths.memory as memory_mod
    from moeify.formats.families import load_source
    from moeify.maths.memory import choose_offload, source_tuning_memory

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
    from moeify.maths.memory import tuning_memory

    llama8b = dict(hidden=4096, d_ff=14336, n_layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False,
                   experts=42, bf16=True, device="cuda")
    assert tuning_memory(**llama8b).peak > 80e9 > tuning_memory(**llama8b, offload=True).peak


def test_a_run_that_does_not_fit_is_refused_before_any_work(carved, tmp_path, monkeypatch):
    import moeify.maths.memory as memory_mod
    import moeify.tuning.sizing as tune_sizing

    dense, carve = carved
    monkeypatch.setattr(memory_mod, "device_memory", lambda device: 50 * 10**6)  # a 50 MB device
    monkeypatch.setattr(tune_sizing, "device_memory", lambda device: 50 * 10**6)
    cfg = build_config(**CARVE, tune_tokens=4096)
    with pytest.raises(MoeifyError, match=r"tuning needs about 0\.\d GB on cpu .* has 0\.1 GB.*--no-memory-check"):
        run_conversion(plan_conversion(dense, cfg), tmp_path / "moe")
    assert not any(tmp_path.iterdir())  # refused before calibrating: nothing written
    out = copy_output(carve, tmp_path / "out")
    with pytest.raises(MoeifyError, match="tuning needs about"):
        tune_output(dense, out, OPTS)
    assert not state_dir(out).exists()
    with pytest.raises(MoeifyError, match="tuning needs about"):  # the dry run too, before loading anything
        estimate_run(dense, out, OPTS)
    report = tune_output(dense, out, TuneOptions(tokens=1024, generated=0.25), memory_check=False)
    assert report["tuning"]["tokens"] == 1024


def test_plan_prints_the_tuning_memory(carved):
    from typer.testing import CliRunner

    from moeify.cli.app import app
    from moeify.formats.families import load_source
    from moeify.maths.memory import source_tuning_memory

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
    from moeify.maths.memory import GPU_COUNTS, tuning_memory

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


def test_a_saved_state_is_written_one_tensor_at_a_time(tmp_path):
    """The run's state is streamed to disk: each tensor is produced (gathered, across processes) when it is written
    and dropped before the next, so the writing rank never holds the whole state; a rank that does not write takes
    part in the gathering and writes nothing."""
    import weakref

    from moeify.training.distill import Pending
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


def test_gpu_sample_batch_fills_half_the_free_memory_between_64_and_1024_windows():
    """On a GPU sampling is launch-bound, so the batch grows into half the free memory (at the memory model's
    bytes a window), never below the CPU's 64 (what the memory check counted) nor above 1,024 or the run's need."""
    from moeify.maths.memory import sampling_bytes_per_window
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

    from moeify.formats.families import attention_shape

    assert attention_shape(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)) == (9, 3, 64)
    bare = LlamaConfig(hidden_size=64, num_attention_heads=4)
    bare.num_key_value_heads, bare.head_dim = None, None
    assert attention_shape(bare) == (4, 4, 16)
    assert attention_shape(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)) == (4, 4, 32)
