"""The tuning stage (layer-local distillation of carved experts) and the corrected calibration feed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_dense, max_logit_diff
from moeify.carving.compensate import routing_mask
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError
from moeify.maths.partition import Partition
from moeify.maths.layerfit import FitSettings, masked_ffn, fit_layer
from moeify.evaluation.verify import verify_checkpoint
from test_calibrate import CALIB


def _problem(n=1200, d=16, d_ff=48, seed=0):
    """A random SwiGLU FFN, its inputs, its dense output (the target) and a top-2-of-4 routing mask."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    gate, up = torch.randn(d_ff, d, generator=gen) / d ** 0.5, torch.randn(d_ff, d, generator=gen) / d ** 0.5
    down = torch.randn(d, d_ff, generator=gen) / d_ff ** 0.5
    target = masked_ffn(x, gate, up, down, torch.ones(n, d_ff))
    part = Partition(torch.randperm(d_ff, generator=gen), 0, 4, d_ff // 4)
    mask = routing_mask(x @ torch.randn(4, d, generator=gen).T, part, k=2)
    return x, target, mask, gate, up, down


def test_tuning_lowers_the_held_out_error_and_is_deterministic():
    x, target, mask, gate, up, down = _problem()
    settings = FitSettings(epochs=6, lr=0.02, batch_tokens=128, seed=3)
    new, info = fit_layer(x, target, mask, gate, up, down, settings)
    assert set(new) == {"gate", "up", "down"}
    assert info["holdout_rel_error_before"] > 0.3  # half the neurons dropped
    assert info["holdout_rel_error_after"] < 0.9 * info["holdout_rel_error_before"]
    assert info["epoch_kept"] >= 1 and info["steps"] == 6 * ((1200 - 120) // 128)
    # the reported error is the kept weights' error on the held-back tokens
    hold = slice(1080, 1200)
    err = (masked_ffn(x[hold], new["gate"], new["up"], new["down"], mask[hold].float()) - target[hold]).square().sum()
    assert err.item() / target[hold].square().sum().item() == pytest.approx(info["holdout_rel_error_after"], rel=1e-4)
    again, _ = fit_layer(x, target, mask, gate, up, down, settings)
    assert all(torch.equal(new[k], again[k]) for k in new)  # same seed, same weights


def test_tuning_never_returns_worse_weights_and_trains_only_what_it_is_asked():
    x, target, mask, gate, up, down = _problem(seed=1)
    # a step size far too large: every epoch is worse on held-back tokens, so the carved weights come back
    new, info = fit_layer(x, target, mask, gate, up, down, FitSettings(epochs=2, lr=0.9, batch_tokens=64),
                           tensors=("down",))
    assert set(new) == {"down"}
    assert info["holdout_rel_error_after"] <= info["holdout_rel_error_before"]
    if info["epoch_kept"] == 0:
        assert torch.equal(new["down"], down)


def test_tune_flags_are_checked():
    with pytest.raises(MoeifyError, match="--fit-epochs needs calibration data"):
        build_config(fit_epochs=2)
    with pytest.raises(MoeifyError, match="--fit-lr must be in"):
        build_config(fit_epochs=1, fit_lr=2.0, **CALIB)
    with pytest.raises(MoeifyError, match="--fit-epochs must be ≥ 0"):
        build_config(fit_epochs=-1, **CALIB)
    with pytest.raises(MoeifyError, match="--calib-feed 'sideways' is not one of"):
        build_config(calib_feed="sideways", **CALIB)


@pytest.fixture()
def calib_model(tmp_path, tokenizer_dir):
    return build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=3)


def test_tuned_conversion_reports_and_verifies(tmp_path, calib_model):
    cfg = build_config(experts=4, top_k=2, calib_feed="corrected", fit_epochs=2, **CALIB)
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    for lay in report["layers"]:
        assert lay["tuned"] == ["gate", "up", "down"] and lay["compensated"]
        assert lay["tune_rel_error_after"] <= lay["tune_rel_error_before"]
    assert report["calibration"]["feed"] == "corrected"
    assert json.loads((tmp_path / "moe" / "report.json").read_text())["settings"]["fit_epochs"] == 2
    assert "fit_epochs = 2" in (tmp_path / "moe" / "moeify.toml").read_text()
    result = verify_checkpoint(tmp_path / "moe", against=calib_model)
    assert result.problems == []
    assert any("tuned (--fit-epochs / --tune-tokens), not compared" in s for s in result.skipped)
    assert any(s.startswith("logits:") and "tuned" in s for s in result.skipped)


def test_corrected_feed_keeps_exactness_with_every_expert_active(tmp_path, calib_model):
    """With k = N the carved model is the dense one, so the corrected target is the dense FFN output, nothing is refit
    or tuned, and the logits are the dense logits."""
    cfg = build_config(experts=4, top_k=4, calib_feed="corrected", fit_epochs=2, tune_tokens=1024, **CALIB)
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    assert not any(lay["tuned"] or lay["compensated"] for lay in report["layers"])
    assert "tuning" not in report and "tuning" not in report["calibration"]  # nothing to recover: no tuning
    assert max_logit_diff(calib_model, tmp_path / "moe") <= 1e-5


def test_whole_model_tuning_reports_kl_and_keeps_the_format(tmp_path, calib_model):
    cfg = build_config(experts=4, top_k=2, tune_tokens=2048, tune_generated=0.25, **CALIB)
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    tuning = report["tuning"]["runs"][-1]
    seq = report["calibration"]["seq_len"]
    assert tuning["scope"] == "model" and tuning["tokens"] >= 2048 and tuning["steps"] == -(-2048 // (1024 // seq * seq))
    assert tuning["holdout_kl_after"] <= tuning["holdout_kl_before"]
    assert tuning["text"]["generated"]["windows"] == round(0.25 * 2048 / seq) + tuning["text"]["generated"]["held_out"]
    assert "bundled" in tuning["text"] and tuning["router_trained"]
    assert all(lay["tuned"] == ["gate", "up", "down", "router"] and lay["router_scale"] == 1.0
               for lay in report["layers"])
    result = verify_checkpoint(tmp_path / "moe", against=calib_model)
    assert result.problems == []
    assert any("router tuned" in s or "router," in s for s in result.skipped)


def test_tuned_attention_is_what_the_checkpoint_computes(tmp_path, calib_model, monkeypatch):
    """--tune-attention: the written checkpoint computes what the trained student computed (attention, norms,
    experts and routers alike), its attention differs from the source's, and verify says why it skips them."""
    import moeify.training.distill as distill_mod
    from conftest import load

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    seen = {}
    real = distill_mod.distill

    def spy(teacher, student, train, held_out, settings, progress=None, **kw):
        info = real(teacher, student, train, held_out, settings, progress, **kw)
        with torch.no_grad():
            seen["logits"] = student(ids).logits.float()
        return info

    monkeypatch.setattr(distill_mod, "distill", spy)
    cfg = build_config(experts=4, top_k=2, tune_tokens=4096, tune_generated=0.25, tune_attention=True, **CALIB)
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    tuning = report["tuning"]["runs"][-1]
    assert tuning["attention_trained"] and tuning["step_kept"] > 0, tuning
    assert all(lay["attention_tuned"] for lay in report["layers"])
    moe, info = load(tmp_path / "moe")
    dense, _ = load(calib_model)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    q = "model.layers.1.self_attn.q_proj.weight"
    assert (moe.state_dict()[q] - dense.state_dict()[q]).abs().max() > 1e-4  # attention really was tuned
    with torch.no_grad():
        got = moe(ids).logits.float()
    scale = seen["logits"].abs().max().item()
    assert (got - seen["logits"]).abs().max().item() <= 1e-4 * scale
    with torch.no_grad():
        assert (got - dense(ids).logits.float()).abs().max().item() > 1e-3 * scale
    result = verify_checkpoint(tmp_path / "moe", against=calib_model)
    assert result.problems == []
    assert any("attention and norms tuned (--tune-attention)" in s for s in result.skipped)


def test_tune_flags_need_a_budget_and_a_share():
    with pytest.raises(MoeifyError, match="--tune-tokens needs calibration data"):
        build_config(tune_tokens=1024)
    with pytest.raises(MoeifyError, match="--tune-tokens must be ≥ 0"):
        build_config(tune_tokens=-1, **CALIB)
    with pytest.raises(MoeifyError, match="--tune-generated must be in"):
        build_config(tune_tokens=1024, tune_generated=1.0, **CALIB)


def _masked_moe_from_output(tmp_path, calib_model, fmt, **kw):
    from conftest import load
    from moeify.formats.checkpoint import CheckpointReader
    from moeify.formats.experts import unpermute_ffn
    from moeify.maths.moe_block import MaskedMoE

    n = 3 if kw.get("shared") else 4
    cfg = build_config(experts=n, top_k=2, gate_tolerance=0.5, format=fmt, **kw, **CALIB)
    report = run_conversion(plan_conversion(calib_model, cfg), tmp_path / "moe")
    moe, _ = load(tmp_path / "moe")
    reader = CheckpointReader(tmp_path / "moe")
    entry = report["layers"][1]
    part = Partition(torch.tensor(entry["perm"]), entry["shared_neurons"], n, entry["expert_sizes"][0])
    prefix = "model.layers.1.block_sparse_moe." if fmt == "mixtral" else "model.layers.1.mlp."
    tensors = {n: reader.get(n) for n in reader.tensors if n.startswith(prefix)}
    gate, up, down = unpermute_ffn(tensors, part, fmt, 1, cfg)
    router = tensors[prefix + "gate.weight"]
    c = report["layers"][1].get("shared_gate")
    student = MaskedMoE(gate, up, down, router, 1.0, part.labels(), 2, fmt, c)
    return student, moe


@pytest.mark.parametrize("fmt,kw", [("mixtral", {}), ("qwen2_moe", {"shared": 1, "untie_embeddings": True})])
def test_masked_moe_computes_what_the_exported_block_computes(tmp_path, calib_model, fmt, kw):
    """The distillation student's FFN (MaskedMoE: dense neuron order, the format's softmax gate weights) equals the
    converted checkpoint's MoE block as transformers runs it. A loose --gate-tolerance makes the gate weights far
    from 1/k, so the weighting itself is checked, not only the top-k mask."""
    student, moe = _masked_moe_from_output(tmp_path, calib_model, fmt, **kw)
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    x = moe.model.layers[1].post_attention_layernorm(x)  # a real router input (RMSNorm output)
    with torch.no_grad():
        got, ref = student(x), moe.model.layers[1].mlp(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
    # the exported down_proj carries the factor k / N in the output dtype; the qwen2_moe shared gate is sigmoid(~0)*2
    assert (got - ref).abs().max().item() <= 2e-3 * ref.abs().max().item(), (got - ref).abs().max()
    gates = student.gates(x.reshape(-1, 64))
    chosen = gates[:, :-1][gates[:, :-1] > 0]
    assert chosen.std().item() > 0.01
    assert (gates[:, -1] == 1).all() if fmt == "mixtral" else (gates[:, -1] - 1).abs().max() < 0.5  # the weights really are not unit


def _tiny_student():
    """A tiny random Llama teacher (large weights: its FFNs matter to the logits), a student whose every FFN is a
    MaskedMoE of 4 experts of 16 neurons, top-2, near-uniform routing, and 24 windows of 32 random tokens."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from moeify.maths.moe_block import MaskedMoE

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.3)
    teacher = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (24, 32), generator=torch.Generator().manual_seed(1))
    student = copy.deepcopy(teacher)
    gen = torch.Generator().manual_seed(2)
    for layer in student.model.layers:
        mlp = layer.mlp
        labels = torch.arange(64) % 4
        router = torch.randn(4, 32, generator=gen)
        layer.mlp = MaskedMoE(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, router, 1e-4, labels, 2)
    return teacher, student, ids


def test_distill_starts_at_the_carved_model_and_lowers_held_out_kl():
    """Step 0 of the student is the carved model (log scale at the carve's scale), the KL is 0 for a student equal
    to the teacher, and training lowers the held-out KL of a carved student."""
    from moeify.training.distill import DistillSettings, distill, final_hidden
    from moeify.training.kl import chunked_kl

    teacher, student, ids = _tiny_student()
    with torch.no_grad():
        h = final_hidden(teacher, ids[:2])
        assert chunked_kl(h, h, teacher.lm_head.weight, chunk=7).abs().item() < 1e-6
    settings = DistillSettings(tokens=20 * 64, batch_tokens=64, evals=4, autocast="off", lr=0.03)
    info = distill(teacher, student, ids[:20], ids[20:], settings)
    assert info["steps"] == 20 and info["tokens"] == 1280 and info["passes"] == 2.0
    assert info["holdout_kl_after"] < 0.9 * info["holdout_kl_before"], info
    assert [s for s, _ in info["holdout_curve"]] == [0, 5, 10, 15, 20]
    kept = min(k for _, k in info["holdout_curve"])
    assert info["holdout_kl_after"] == pytest.approx(kept, rel=1e-4)


def test_chunked_kl_gradient_computed_in_forward_equals_autograds():
    """The chunked KL equals the unchunked formula, and its gradients (computed in closed form in the forward pass,
    no logits kept) equal autograd's through log_softmax, for the hidden states and for the head; under bf16
    autocast the loss stays float32-exact and the gradient is close."""
    import torch.nn.functional as F

    from moeify.training.kl import chunked_kl

    gen = torch.Generator().manual_seed(0)
    head0 = torch.randn(50, 8, generator=gen)
    ht = torch.randn(21, 8, generator=gen)
    hs0 = torch.randn(21, 8, generator=gen)
    hs, head = hs0.clone().requires_grad_(True), head0.clone().requires_grad_(True)
    t, s = F.log_softmax(ht @ head.detach().T, -1), F.log_softmax(hs @ head.T, -1)  # the teacher is the target
    reference = (t.exp() * (t - s)).sum(-1).mean()
    reference.backward()
    hs2, head2 = hs0.clone().requires_grad_(True), head0.clone().requires_grad_(True)
    loss = chunked_kl(hs2, ht, head2, chunk=4)
    (2 * loss).backward()  # the incoming gradient is applied
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(hs2.grad, 2 * hs.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(head2.grad, 2 * head.grad, rtol=1e-5, atol=1e-7)
    assert hs.grad.abs().max() > 1e-3
    hs3 = hs0.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss3 = chunked_kl(hs3, ht, head0, chunk=4)
    loss3.backward()
    assert loss3.dtype == torch.float32 and loss3.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(hs3.grad, hs.grad, rtol=0.05, atol=0.01 * hs.grad.abs().max().item())
    with torch.no_grad():  # evaluation: no gradient work
        assert chunked_kl(hs0, ht, head0, chunk=5).item() == pytest.approx(reference.item(), rel=1e-6)


def test_kl_logits_in_the_autocast_dtype_only_for_the_training_kl_under_autocast():
    """kl_logits "autocast": under bf16 autocast the training KL's logit products run in bf16 (the loss moves by
    bf16 rounding, the gradient stays close); without autocast, and for the held-out check (no gradient), the KL is
    the float32 one exactly; an unknown value is refused by name."""
    from moeify.training.kl import chunked_kl

    gen = torch.Generator().manual_seed(2)
    head, ht, hs0 = (torch.randn(*s, generator=gen) for s in ((200, 16), (12, 16), (12, 16)))
    ht = hs0 + 0.5 * ht

    def run(logits, autocast, grad=True):
        hs = hs0.clone().requires_grad_(grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
            loss = chunked_kl(hs, ht, head, chunk=4, logits=logits)
        if grad:
            loss.backward()
        return loss.item(), hs.grad

    f32, g32 = run("float32", True)
    low, glow = run("autocast", True)
    assert low != f32 and low == pytest.approx(f32, rel=0.05)
    assert torch.allclose(glow, g32, rtol=0.1, atol=0.05 * g32.abs().max().item())
    assert run("autocast", False)[0] == run("float32", False)[0]
    assert run("autocast", True, grad=False)[0] == run("float32", True, grad=False)[0]
    with pytest.raises(ValueError, match="kl_logits 'bf16'"):
        chunked_kl(hs0, ht, head, chunk=4, logits="bf16")


def test_fused_kl_equals_eager_and_falls_back(monkeypatch):
    """The KL's softmax part compiled (torch.compile, the path of large logits) gives the eager loss and gradients to
    float32 rounding; where compiling fails (at torch.compile or at the first call) it warns once and computes the
    same result eagerly."""
    from moeify.training import kl as distill
    from moeify.training.kl import chunked_kl

    gen = torch.Generator().manual_seed(1)
    head0, ht, hs0 = (torch.randn(*s, generator=gen) for s in ((300, 16), (28, 16), (28, 16)))

    def run():
        hs = hs0.clone().requires_grad_(True)
        loss = chunked_kl(hs, ht, head0, chunk=7)
        loss.backward()
        return loss.detach(), hs.grad

    monkeypatch.setattr(distill, "_FUSED", {})
    monkeypatch.setenv("MOEIFY_COMPILE", "0")
    eager_loss, eager_grad = run()
    assert distill._FUSED == {}  # small logits: not even tried
    monkeypatch.setattr(distill, "FUSE_MIN_ELEMENTS", 0)
    eager_loss2, eager_grad2 = run()
    assert distill._FUSED == {"fn": None} and torch.equal(eager_grad2, eager_grad)
    monkeypatch.setenv("MOEIFY_COMPILE", "1")
    monkeypatch.setattr(distill, "_FUSED", {})
    fused_loss, fused_grad = run()
    assert distill._FUSED["fn"] is not None
    assert fused_loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    assert torch.allclose(fused_grad, eager_grad, rtol=1e-4, atol=1e-6)

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler found")
    for at_call in (False, True):
        monkeypatch.setattr(distill, "_FUSED", {"fn": broken} if at_call else {})
        monkeypatch.setattr(torch, "compile", broken)
        with pytest.warns(UserWarning, match="could not be compiled .*no C.. compiler.*computing it eagerly"):
            loss, grad = run()
        assert distill._FUSED["fn"] is None and torch.equal(grad, eager_grad) and loss.item() == eager_loss.item()


def _tiny_teacher_student(seed=0):
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from moeify.maths.moe_block import MaskedMoE

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.3)
    teacher = LlamaForCausalLM(config).eval()
    student = copy.deepcopy(teacher)
    gen = torch.Generator().manual_seed(2)
    for layer in student.model.layers:
        mlp = layer.mlp
        layer.mlp = MaskedMoE(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                              torch.randn(4, 32, generator=gen), 1e-4, torch.arange(64) % 4, 2)
    return teacher, student


def test_share_frozen_holds_the_model_once_and_keeps_the_outputs():
    """The student uses the teacher's embeddings, attention and norms (the same tensors), its outputs do not change;
    the teacher's FFNs stored in bf16 give bit-identical hidden states under bf16 autocast."""
    from moeify.training.distill import final_hidden, share_frozen

    teacher, student = _tiny_teacher_student()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        s_before = student(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            t_before = final_hidden(teacher, ids)
    freed = share_frozen(teacher, student, train_attention=False, lowp=torch.bfloat16)
    assert student.model.layers[1].self_attn.q_proj.weight is teacher.model.layers[1].self_attn.q_proj.weight
    assert student.lm_head.weight is teacher.model.embed_tokens.weight
    assert teacher.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert student.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32  # shared ones stay float32
    n_shared = sum(p.numel() for n, p in teacher.named_parameters() if ".mlp." not in n)
    assert freed == 4 * n_shared
    with torch.no_grad():
        assert torch.equal(student(ids).logits, s_before)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(final_hidden(teacher, ids), t_before)
    teacher2, student2 = _tiny_teacher_student()
    share_frozen(teacher2, student2, train_attention=True)
    assert student2.model.layers[0].self_attn.q_proj.weight is not teacher2.model.layers[0].self_attn.q_proj.weight
    assert student2.model.embed_tokens is teacher2.model.embed_tokens


def test_distill_micro_batches_accumulate_the_same_step():
    """A step's windows through forward + backward one at a time (the default, half the activation memory) or all
    at once train the same weights."""
    from moeify.training.distill import DistillSettings, distill

    results = []
    for micro in (1, 4):
        teacher, student = _tiny_teacher_student()
        ids = torch.randint(0, 97, (24, 16), generator=torch.Generator().manual_seed(1))
        settings = DistillSettings(tokens=8 * 64, batch_tokens=64, evals=2, autocast="off", lr=0.03,
                                   micro_windows=micro)
        info = distill(teacher, student, ids[:20], ids[20:], settings)
        results.append((info, student.model.layers[0].mlp.gate.detach().clone()))
    (a, wa), (b, wb) = results
    assert a["holdout_kl_after"] < a["holdout_kl_before"]
    assert a["holdout_kl_after"] == pytest.approx(b["holdout_kl_after"], rel=1e-4)
    assert torch.allclose(wa, wb, rtol=1e-4, atol=1e-5) and not torch.equal(wa, teacher.model.layers[0].mlp.gate_proj.weight)


def test_attention_step_size_is_its_own():
    """With --tune-attention the attention and norm tensors take attention_lr (relative to their RMS), the experts
    lr: attention_lr 0 trains the experts and leaves attention and norms bit-identical; by default, both move."""
    from moeify.training.distill import DistillSettings, attention_params, distill

    moved, default = {}, DistillSettings(tokens=0).attention_lr
    for att_lr in (0.0, default):
        teacher, student = _tiny_teacher_student()
        before = [p.detach().clone() for p in attention_params(student)]
        gate = student.model.layers[0].mlp.gate.detach().clone()
        ids = torch.randint(0, 97, (24, 16), generator=torch.Generator().manual_seed(1))
        settings = DistillSettings(tokens=8 * 64, batch_tokens=64, evals=2, autocast="off", lr=0.03,
                                   train_attention=True, attention_lr=att_lr)
        info = distill(teacher, student, ids[:20], ids[20:], settings)
        assert info["attention_trained"] and info["step_kept"] > 0, info
        assert not torch.equal(student.model.layers[0].mlp.gate, gate)
        moved[att_lr] = [not torch.equal(p, b) for p, b in zip(attention_params(student), before)]
    assert not any(moved[0.0]) and all(moved[default]), moved


def test_dense_router_gradient_changes_the_gradient_not_the_model():
    """router_grad 'dense' (DenseMixer's straight-through router): the forward pass is bit-identical to top-k, but
    the router rows of experts no token chose get a gradient (with Mixtral's top-k renormalised weights they get
    none under 'topk'); outside training (no grad) nothing changes; a bad value is refused."""
    from moeify.training.distill import DistillSettings, distill
    from moeify.maths.moe_block import MaskedMoE

    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(64, 16, generator=gen), torch.randn(64, 16, generator=gen)
    down = torch.randn(16, 64, generator=gen)
    router = 0.1 * torch.randn(8, 16, generator=gen)
    x = torch.randn(12, 16, generator=gen) + 3  # tokens with a common direction
    router[7] = -0.1 * x.mean(0) / x.mean(0).norm()  # expert 7 points away from it: never in a token's top 2
    outs, grads = {}, {}
    for dense in (False, True):
        moe = MaskedMoE(gate, up, down, router, 1.0, torch.arange(64) % 8, 2, "mixtral")
        moe.dense_grad = dense
        assert 7 not in (x @ moe.router.T).topk(2, dim=1).indices.flatten().tolist()
        out = moe(x)
        out.square().sum().backward()
        outs[dense], grads[dense] = out.detach(), moe.router.grad.clone()
        with torch.no_grad():
            assert torch.equal(moe(x), outs[False])
    assert torch.equal(outs[True], outs[False])
    assert grads[False][7].abs().max().item() < 1e-5 * grads[False].abs().max().item()  # 0 but for rounding
    assert grads[True][7].abs().max().item() > 1e-3 * grads[True].abs().max().item()
    teacher, student = _tiny_teacher_student()
    ids = torch.randint(0, 97, (6, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="router_grad 'sparse'"):
        distill(teacher, student, ids[:4], ids[4:], DistillSettings(tokens=64, router_grad="sparse", autocast="off"))
    info = distill(teacher, student, ids[:4], ids[4:], DistillSettings(tokens=64, batch_tokens=32, evals=1,
                                                                         router_grad="dense", autocast="off"))
    assert info["holdout_kl_after"] <= info["holdout_kl_before"]
    assert not any(m.dense_grad for m in student.modules() if isinstance(m, MaskedMoE))


def test_sampling_keeps_the_teachers_targets_and_tuning_skips_the_teacher_on_them():
    """The final hidden states kept while sampling equal a full forward over the sampled windows (float16 storage,
    KV-cached computation), and a step whose windows have kept targets does not run the teacher, training the same
    weights as one that runs it."""
    from moeify.training.distill import DistillSettings, distill, final_hidden
    from moeify.training.sampling import sample_text

    teacher, _ = _tiny_teacher_student()
    prompts = torch.randint(0, 97, (6, 4), generator=torch.Generator().manual_seed(3))
    windows, hidden = sample_text(teacher, prompts, 12, seed=5, batch=4, keep_hidden=True)
    assert windows.shape == (6, 16) and hidden.shape == (6, 16, 32) and hidden.dtype == torch.float16
    assert torch.equal(windows, sample_text(teacher, prompts, 12, seed=5, batch=4))  # the same text either way
    with torch.no_grad():
        full = final_hidden(teacher, windows)
    assert (hidden.float() - full).abs().max().item() <= 2e-3 * full.abs().max().item()
    # sampled under bf16 autocast (as tuning's teacher computes when it runs under it): the kept states are a bf16
    # forward's, as far from float32 as a full bf16 forward over the same windows, and not the float32 ones
    windows_b, hidden_b = sample_text(teacher, prompts, 12, seed=5, batch=4, keep_hidden=True, bf16=True)
    with torch.no_grad():
        full32 = final_hidden(teacher, windows_b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full16 = final_hidden(teacher, windows_b).float()
    scale = full32.abs().max().item()
    err_kept, err_full = ((t - full32).abs().max().item() for t in (hidden_b.float(), full16))
    assert 2e-3 * scale < err_kept <= 3 * err_full

    ids = torch.randint(0, 97, (24, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for kept in (False, True):
        teacher, student = _tiny_teacher_student()
        with torch.no_grad():
            exact = {i: final_hidden(teacher, ids[i:i + 1])[0] for i in range(10, 20)}  # windows 10..19 "sampled"
        calls = []
        hook = teacher.model.register_forward_hook(lambda m, i, o: calls.append(1))
        settings = DistillSettings(tokens=8 * 64, batch_tokens=64, evals=2, autocast="off", lr=0.03)
        info = distill(teacher, student, ids[:20], ids[20:], settings, targets=exact.get if kept else None)
        hook.remove()
        results.append((info, student.model.layers[0].mlp.gate.detach().clone(), len(calls)))
    (a, wa, calls_a), (b, wb, calls_b) = results
    assert torch.equal(wa, wb) and a["holdout_curve"] == b["holdout_curve"]
    assert calls_a == 8 * 4 + 1 and calls_b < calls_a  # 4 windows a step, plus the held-out targets once


def test_sampling_cost_is_fitted_against_the_kv_length_and_taken_at_a_whole_windows_mean():
    """The dry run's sampling estimate: step times grow with the KV cache, so a short run's steps are fitted as
    a + b * length and read at the mean length of a whole window's steps (the first step, with the prompt's
    forward, left out); a clock on generate() records a step per new token and leaves the text as it was."""
    from moeify.training.sampling import sample_text, sampling_seconds_per_token

    # steps of 1 ms + 0.01 ms per token of context, lengths 17..112, after a prefill of 50 ms
    stamps, t = [(17, 0.05)], 0.05
    for n in range(18, 113):
        t += 1e-3 + 1e-5 * n
        stamps.append((n, t))
    # a whole window of 512 continued from 16 tokens: mean length (17 + 512) / 2
    assert sampling_seconds_per_token(stamps, 16, 512) == pytest.approx(1e-3 + 1e-5 * 264.5, rel=1e-9)
    assert sampling_seconds_per_token(stamps, 16, 112) == pytest.approx(1e-3 + 1e-5 * 64.5, rel=1e-9)
    flat = [(n, 0.002 * n) for n in range(17, 30)]  # constant steps: no growth to extrapolate
    assert sampling_seconds_per_token(flat, 16, 512) == pytest.approx(0.002)
    falling = [(n, -1 / n) for n in range(17, 40)]  # steps that shrink (noise): the mean, not extrapolated down
    d = [b[1] - a[1] for a, b in zip(falling, falling[1:])]
    assert sampling_seconds_per_token(falling, 16, 512) == pytest.approx(sum(d) / len(d))
    with pytest.raises(ValueError, match="at least 3"):
        sampling_seconds_per_token(stamps[:2], 16, 512)

    teacher, _ = _tiny_teacher_student()
    prompts = torch.randint(0, 97, (6, 4), generator=torch.Generator().manual_seed(3))
    clock: list = []
    windows = sample_text(teacher, prompts, 12, seed=5, batch=4, step_times=clock)
    assert torch.equal(windows, sample_text(teacher, prompts, 12, seed=5, batch=4))
    # the static KV cache (the default) samples the very tokens the dynamic one does
    assert torch.equal(windows, sample_text(teacher, prompts, 12, seed=5, batch=4, cache="dynamic"))
    assert [n for n, _ in clock] == list(range(5, 17)) * 2  # two batches, a stamp per new token
    assert all(b[1] >= a[1] for a, b in zip(clock[:12], clock[1:12]))
