"""The GPU benchmark programs (scripts/bench_gpu.py, bench_gpu_speed.py, bench_gpu_curve.py, bench_gpu_decode.py,
profile_decode_step.py), run on the CPU with a tiny model so that they do not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, build_dense

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_runs_every_step_on_cpu(tmp_path, tokenizer_dir):
    dense = build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=2, intermediate_size=128,
                        initializer_range=0.3)  # d_ff 128: the presets' 64 slices of 2 neurons
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--device", "cpu", "--quick",
                          "--model", str(dense), "--work", str(tmp_path / "work"), "--calib", str(CORPUS),
                          "--dry-tokens", "1024", "--offload-tokens", "1024", "--json", str(tmp_path / "gpu.json")],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert out["errors"] == {} and out["skipped"] == []
    assert set(out["carve"]["smollm2-135m"]) == {"active-50", "active-25"}
    tuning = out["tuning"]["smollm2-135m"]
    assert tuning["tokens_per_second"] > 0 and tuning["predicted_peak_bytes"] > 0
    decode = out["decode"]["smollm2-135m"]
    assert {"dense", "active-50 eager", "active-25 eager"} <= set(decode) and decode["dense"] > 0
    assert decode["active-50 eager"] > 0 and decode["active-25 eager"] > 0
    off = out["offload"]
    assert off["model"] == "smollm2-135m" and off["offload"]["offload"] and not off["no-offload"]["offload"]
    assert off["offload"]["peak_bytes"] > 0 and off["no-offload"]["seconds_per_1k_tokens"] > 0
    assert off["offload"]["predicted_peak_bytes"] > 0


def test_bench_gpu_skips_steps_past_its_budget_and_builds_smollm2_offline(tmp_path, tokenizer_dir):
    """--offline without the real weights: SmolLM2's shape with synthetic weights; a spent budget skips every step
    and still writes the JSON."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--device", "cpu", "--quick",
                          "--offline", "--model", str(tmp_path / "absent"), "--tokenizer", str(tokenizer_dir),
                          "--work", str(tmp_path / "work"), "--calib", str(CORPUS), "--budget-s", "0",
                          "--json", str(tmp_path / "gpu.json")],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert out["synthetic_smollm2"] and out["carve"] == {} and out["tuning"] == {}
    assert out["skipped"] == ["make smollm2-135m"]


def test_bench_gpu_curve_needs_the_real_model_and_token_totals(tmp_path):
    """bench_gpu_curve.py without the real weights at --model, or with --curve-points that are not numbers: one
    line, exit 1, before any work (the curve itself runs in the test below)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu_curve.py"), "--device", "cpu", "--offline", "--model",
           str(tmp_path / "absent"), "--work", str(tmp_path / "work")]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 1 and "the curve needs the real SmolLM2" in res.stderr.strip().splitlines()[-1]
    res = subprocess.run(cmd + ["--curve-points", "1M,4M"], capture_output=True, text=True, env=env)
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
        "--curve-points: '1M,4M' is not comma-separated token totals")
    assert not (tmp_path / "work").exists()


def test_bench_gpu_speed_times_each_kernel_beside_a_dense_training_step_on_cpu(tmp_path, tokenizer_dir):
    """bench_gpu_speed.py: the tuning step per kernel beside a dense training step, sampling, the step's profile."""
    dense = build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=2, intermediate_size=128,
                        initializer_range=0.3)
    # the compiled variant traced by aot_eager (eager kernels): no C++ compiler needed, the same graphs captured
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "MOEIFY_COMPILE_BACKEND": "aot_eager"}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu_speed.py"), "--device", "cpu", "--quick",
                          "--model", str(dense), "--calib", str(CORPUS), "--work", str(tmp_path / "w1"),
                          "--speed-tokens", "2048", "--json", str(tmp_path / "speed.json")],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    out = json.loads((tmp_path / "speed.json").read_text())
    assert out["errors"] == {}
    speed = out["speed"]["smollm2-135m"]
    # (--quick: the 50% preset only; on the CPU the grouped kernel computes masked in float32, as the run would)
    assert set(speed["tuning"]) == {"active-50 masked", "active-50 grouped", "active-50 grouped compiled"}
    assert [(r["compiled"], r["moe_kernel"]) for r in speed["tuning"].values()] == [
        (True, "grouped"), (False, "grouped"), (False, "masked")]  # a GPU run's default first
    for row in speed["tuning"].values():
        assert row["tokens_per_second"] > 0 and row["step_tokens"] == 1024 and row["time_ratio_to_dense"] > 0
        assert row["sampling_tokens_per_second"] > 0 and row["flops_per_token"] > 0
        assert row["run_tokens"] == 2048 and row["run_estimated_seconds"] > 0
    assert speed["dense"]["tokens_per_second"] > 0 and speed["dense"]["step_tokens"] == 1024
    assert {k: v["tokens_per_second"] > 0 for k, v in speed["sampling"].items()} == {"inline": True,
                                                                                     "kept hidden": True}
    # the default row's step under the profiler (on a CPU: operators' own time by kind; no GPU idle time)
    prof = speed["profile"]
    assert prof["moe_kernel"] == "grouped" and prof["compiled"] and prof["step_tokens"] == 1024
    step = prof["step"]
    assert step["unit"] == "operators" and step["idle_share"] is None and step["wall_ms"] > 0
    assert step["kinds"]["matmul"]["ms"] > 0 and step["kinds"]["attention"]["count"] > 0
    assert abs(sum(v["share"] for v in step["kinds"].values()) - 1) < 1e-3


def test_bench_gpu_curve_runs_each_point_from_the_carve_and_fits_the_floor_on_cpu(tmp_path, tokenizer_dir):
    """bench_gpu_curve.py: the 50% carve, single runs of --curve-points totals scored on held-out text, the
    sampled-text run beside one of them, the fitted floor."""
    dense = build_dense(tmp_path / "dense", tokenizer_dir, num_hidden_layers=2, intermediate_size=128,
                        initializer_range=0.3)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu_curve.py"), "--device", "cpu", "--quick",
                          "--model", str(dense), "--calib", str(CORPUS), "--eval", str(CORPUS), "--eval-tokens",
                          "512", "--work", str(tmp_path / "w2"), "--curve-points", "2048,1024,4096", "--mix-check",
                          "2048", "--json", str(tmp_path / "curve.json")],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    out = json.loads((tmp_path / "curve.json").read_text())
    assert out["errors"] == {} and [p["tokens"] for p in out["curve"]] == [1024, 2048, 4096]
    assert set(out["carve"]["smollm2-135m"]) == {"active-50"}
    assert all(0 < p["holdout_kl_after"] <= p["holdout_kl_before"] and p["seconds_per_1k_tokens"] > 0
               for p in out["curve"])  # each run's own record, from its report
    assert all(0 < r < 100 for p in out["curve"] for r in p["ratio"].values())  # scored (a random model: any ratio)
    # each point one run from the carve, not continued
    points = json.loads((tmp_path / "w2" / "curve.json").read_text())["points"]
    assert [[r["tokens"] for r in p["runs"]] for p in points] == [[1024], [2048], [4096], [2048]]  # the last: mix
    assert out["mix"]["tokens"] == 2048 and out["mix"]["text"]["generated"]["windows"] > 0
    fit = next(iter(out["curve_fit"].values()))
    assert fit["r_inf"] >= 1.0 and 0 < fit["b"] <= 2 and set(fit["at"]) == {str(16 << 20), str(64 << 20),
                                                                              str(256 << 20)}


def test_profile_kinds_and_the_time_some_kernel_ran():
    sys.path.insert(0, str(ROOT / "scripts"))
    from profile_tune_step import busy_us, kind_of

    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # overlaps counted once, gaps not at all
    assert busy_us([]) == 0
    assert [kind_of(n) for n in ("sm90_xmma_gemm_bf16bf16_bf16f32", "nvjet_tst_128x64_64x4", "aten::addmm",
                                 "pytorch_flash::flash_fwd_kernel", "aten::_scaled_dot_product_flash_attention",
                                 "triton_poi_fused_mul_silu_0", "triton_red_fused__log_softmax_3",
                                 "void at::native::index_elementwise_kernel", "Memcpy HtoD (Pageable -> Device)",
                                 "multi_tensor_apply_kernel", "aten::topk", "ncclDevKernel_AllReduce_Sum_f32")] == [
        "matmul", "matmul", "matmul", "attention", "attention", "elementwise", "reduction", "routing", "copy",
        "optimizer", "routing", "communication"]


def test_bench_gpu_decode_times_every_backend_and_stops_at_its_budget(tmp_path, capsys):
    """scripts/bench_gpu_decode.py on the CPU at a tiny size: dense under both caches and
    each preset's carve under each experts backend, at batch 2 (batch 1 in the shorter call below), every row a
    speed, at a depth of its own (--layers); a spent budget skips the rest and still writes the JSON."""
    out = tmp_path / "decode.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu_decode.py"), "--device", "cpu", "--quick",
                          "--shapes", "llama3.2-1b", "--layers", "1", "--batches", "2", "--work",
                          str(tmp_path / "work"),
                          "--json", str(out)], capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    got = json.loads(out.read_text())
    assert got["errors"] == {} and got["skipped"] == []
    want = {f"llama3.2-1b-1l | dense | {c} | batch 2" for c in ("dynamic", "static+compile")} | {
        f"llama3.2-1b-1l | {p} | {c} | batch 2" for p in ("active-50", "active-25")
        for c in ("eager", "grouped_mm", "batched_mm", "batched_mm static+compile", "gather static+compile")}
    assert set(got["rows"]) == want and all(v > 0 for v in got["rows"].values())
    assert json.loads((tmp_path / "work" / "llama3.2-1b-1l" / "config.json").read_text())["num_hidden_layers"] == 1
    # the other calls in this process (the call above ran it as the device tool does)
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gpu_decode import main

    main(["--device", "cpu", "--quick", "--shapes", "llama3.2-1b,tiny", "--budget-s", "0", "--work",
          str(tmp_path / "work"), "--json", str(out)])
    assert json.loads(out.read_text())["skipped"] == ["llama3.2-1b", "tiny"]
    # a shorter call on the same models: some backends (the dense model under the caches they use)
    main(["--device", "cpu", "--quick", "--shapes", "llama3.2-1b", "--backends", "batched_mm static+compile",
          "--layers", "1", "--batches", "1", "--work", str(tmp_path / "work"), "--json", str(out)])
    assert set(json.loads(out.read_text())["rows"]) == {
        "llama3.2-1b-1l | dense | static+compile | batch 1", "llama3.2-1b-1l | active-50 | batched_mm static+compile "
        "| batch 1", "llama3.2-1b-1l | active-25 | batched_mm static+compile | batch 1"}
    with pytest.raises(SystemExit) as refused:
        main(["--device", "cpu", "--quick", "--backends", "grouped,eager", "--json", str(out)])
    assert refused.value.code == 2 and "--backends: unknown grouped" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_carve(tmp_path_factory, tokenizer_dir):
    """A 2-layer dense model and its weight-only 50% carve (the preset's layout at d_ff 128)."""
    root = tmp_path_factory.mktemp("small")
    dense = build_dense(root / "dense", tokenizer_dir, num_hidden_layers=2, intermediate_size=128)
    res = subprocess.run([sys.executable, "-m", "moeify", "convert", str(dense), str(root / "carve"), "--preset",
                          str(ROOT / "configs" / "active-50.toml"), "--weight-only"], capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return dense, root / "carve"


def test_the_gather_experts_backend_computes_what_the_eager_loop_computes(small_carve):
    """bench_gpu_decode.py's "gather" experts backend (registered with transformers' ExpertsInterface): the carve's
    logits as transformers' own per-expert loop gives them, for one token and for several (float32, CPU), and past
    GATHER_MAX_TOKENS (a prefill, handed to grouped_mm)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gpu_decode import register_gather

    dense, carve = small_carve
    register_gather()
    ids = torch.randint(0, 384, (3, 7), generator=torch.Generator().manual_seed(0))
    long = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))  # 80 tokens at once
    got = {}
    for impl in ("eager", "gather"):
        model = AutoModelForCausalLM.from_pretrained(carve, dtype=torch.float32, experts_implementation=impl).eval()
        assert model.config._experts_implementation == impl
        with torch.no_grad():
            got[impl] = (model(ids).logits, model(ids[:1, :1]).logits, model(long).logits)
    for a, b in zip(got["eager"], got["gather"]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert got["eager"][0].abs().max() > 0.1  # logits that say something


def test_profile_decode_step_counts_each_part_of_a_dense_model_and_its_carve(small_carve, tmp_path):
    """scripts/profile_decode_step.py on the CPU: one decode step's operators by part, the dense model's FFN in
    'dense mlp', the carve's in its router, shared expert and routed experts, the attention alike in both."""
    dense, carve = small_carve
    out = tmp_path / "profile.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_decode_step.py"), str(dense), str(carve),
                          "--device", "cpu", "--dtype", "float32", "--prompt", "8", "--warmup", "1", "--json",
                          str(out)], capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    d, m = got["rows"]["dense"]["operators"], got["rows"]["carve"]["operators"]
    assert got["unit"] == "operators" and got["layers"] == 2
    assert d["dense mlp"] == 2 * 5  # per layer: gate, up, down products, the activation, the product of the two
    assert "routed experts" not in d and "router" not in d
    assert m.get("dense mlp", 0) == 0 and m["routed experts"] > 0 and m["router"] > 0 and m["shared expert"] > 0
    assert m["attention"] == d["attention"] > 0
    assert got["rows"]["carve"]["total"] > got["rows"]["dense"]["total"]
    assert "one decode step, operators by part" in res.stdout


def test_bench_gpu_train_runs_both_modes_on_cpu(tmp_path, tokenizer_dir):
    """bench_gpu_train.py at a tiny shape: the dense model, its E8 top-2 upcycle, a plain and an offloaded training
    run, each with its peak, prediction and tokens/s a process."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu_train.py"), "--device", "cpu", "--quick",
                          "--shape", "tiny", "--layers", "2", "--vocab", "512", "--tokenizer", str(tokenizer_dir),
                          "--tokens", "1024", "--step-tokens", "512", "--work", str(tmp_path / "work"),
                          "--json", str(tmp_path / "train.json")],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                              "MOEIFY_AUTOCAST": "off"})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    out = json.loads((tmp_path / "train.json").read_text())
    assert out["errors"] == {} and out["skipped"] == []
    assert out["shape"]["num_local_experts"] == 8 and out["shape"]["num_experts_per_tok"] == 2
    assert set(out["train"]) == {"plain", "offload"}
    for mode, row in out["train"].items():
        assert row["offload"] == (mode == "offload") and row["processes"] == 1 and row["steps"] == 2
        assert row["peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0 and row["tokens_per_second_per_process"] > 0
