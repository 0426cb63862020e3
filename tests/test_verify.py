"""`moeify verify OUT [--against SRC]`: passes on good outputs of every shape we write, and names each kind of damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_dense, edit_json, rewrite
from moeify.cli.app import app
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.evaluation.verify import verify_checkpoint

EXPERT = "model.layers.1.block_sparse_moe.experts.2."


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def convert(src: Path, out: Path, **flags) -> Path:
    run_conversion(plan_conversion(src, build_config(**flags)), out)
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return build_dense(tmp_path_factory.mktemp("verify") / "dense", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def good(tmp_path_factory, dense) -> Path:
    """A mixtral output, top-2 of 4 experts, several shards."""
    return convert(dense, tmp_path_factory.mktemp("verify") / "moe", experts=4, top_k=2, max_shard_size="60KB")


@pytest.fixture
def moe(tmp_path, good) -> Path:
    """A private copy of the good output that a test may damage."""
    return Path(shutil.copytree(good, tmp_path / "moe"))


def problems_of(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.startswith("problem:")]


def shard_of(out: Path, name: str) -> Path:
    return out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]


# ----------------------------------------------------------------------------------------------- passes


def test_good_output_passes_with_and_without_source(good, dense):
    result = cli("verify", good)
    assert result.exit_code == 0, result.stderr
    assert "OK" in result.stdout and "no NaN/Inf" in result.stdout
    result = cli("verify", good, "--against", dense)
    assert result.exit_code == 0, result.stderr
    assert "bit for bit" in result.stdout and "logits" in result.stdout


def test_json_file_and_stdout(good, moe, tmp_path):
    """--json PATH writes the result, --json - prints it alone on stdout (checks go to stderr); exit codes unchanged."""
    result = cli("verify", good, "--headers-only", "--json", tmp_path / "v.json")
    assert result.exit_code == 0 and "OK" in result.stdout
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["ok"] is True and data["problems"] == [] and data["checked"] and data["path"] == str(good)
    (moe / "report.json").unlink()
    (moe / "config.json").write_text((moe / "config.json").read_text().replace('"num_local_experts": 4', '"num_local_experts": 5'))
    result = cli("verify", moe, "--headers-only", "--json", "-")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["problems"] and all(p in result.stderr for p in data["problems"])


@pytest.mark.parametrize("flags", [
    dict(experts=3, top_k=3),  # top-k not a power of two: down_proj × 3 is rounded once in bf16
    dict(experts=6, top_k=3, shared=2, dense_layers="1"),  # qwen2_moe: shared expert, a dense layer, padded experts
    dict(experts=4, top_k=1, format="qwen2_moe"),  # qwen2_moe without shared expert
    dict(experts=4, top_k=2, dtype="float32"),  # upcast
], ids=["k3-bf16", "qwen-shared-dense", "qwen-k1", "fp32-out"])
def test_every_output_shape_verifies_against_its_source(tmp_path, dense, flags):
    out = convert(dense, tmp_path / "moe", **flags)
    result = verify_checkpoint(out, dense)
    assert result.ok, result.problems
    assert result.max_logit_diff is not None and result.max_logit_diff <= 1e-3 * result.logit_scale
    assert not result.skipped


def test_float32_source_to_bf16_output(tmp_path):
    src = build_dense(tmp_path / "dense")
    result = verify_checkpoint(convert(src, tmp_path / "moe", experts=3, top_k=3, dtype="bfloat16"), src)
    assert result.ok, result.problems


def test_tied_and_untied_embeddings(tmp_path):
    src = build_dense(tmp_path / "dense", tie_word_embeddings=True)
    for name, untie in (("tied", False), ("untied", True)):
        result = verify_checkpoint(convert(src, tmp_path / name, experts=4, top_k=2, untie_embeddings=untie), src)
        assert result.ok, (name, result.problems)


# ---------------------------------------------------------------------------------------- structure


def test_missing_directory_and_config(tmp_path):
    result = cli("verify", tmp_path / "nope")
    assert result.exit_code == 2 and "is not a directory" in result.stderr
    (tmp_path / "empty").mkdir()
    result = cli("verify", tmp_path / "empty")
    assert result.exit_code == 2 and "config.json not found" in result.stderr


def test_a_dense_checkpoint_is_not_an_moe_output(dense):
    result = cli("verify", dense)
    assert result.exit_code == 2 and "'llama' is not a format moeify writes" in result.stderr


def test_missing_tensor(moe):
    name = EXPERT + "w3.weight"
    rewrite(shard_of(moe, name), lambda t: t.pop(name))
    result = cli("verify", moe, "--headers-only")
    assert result.exit_code == 2
    text = "\n".join(problems_of(result))
    assert f"lists {name}" in text and f"tensor {name} is missing" in text


def test_wrong_shape_and_dtype(moe):
    name, other = EXPERT + "w1.weight", EXPERT + "w3.weight"

    def edit(t):
        t[name] = t[name][:-1].clone()
        t[other] = t[other].float()

    rewrite(shard_of(moe, name), edit)
    text = "\n".join(problems_of(cli("verify", moe, "--headers-only")))
    assert f"tensor {name} has shape [23, 64], config.json implies [24, 64]" in text
    assert f"tensor {other} has dtype torch.float32, config.json says torch.bfloat16" in text


def test_config_disagrees_with_shards(moe):
    edit_json(moe / "config.json", lambda c: c.update(num_local_experts=5))
    result = cli("verify", moe, "--headers-only")
    assert result.exit_code == 2
    assert "tensor model.layers.0.block_sparse_moe.gate.weight has shape [4, 64], config.json implies [5, 64]" \
        in result.stderr


def test_index_disagrees_with_shards(moe):
    index = moe / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    name = EXPERT + "w2.weight"
    wrong = next(f for f in files if f != weight_map[name])

    def edit(i):
        i["weight_map"][name] = wrong
        i["metadata"]["total_size"] += 2

    edit_json(index, edit)
    shutil.copyfile(moe / files[0], moe / "model-00099-of-00099.safetensors")
    text = "\n".join(problems_of(cli("verify", moe, "--headers-only")))
    assert f"says {name} is in {wrong}" in text
    assert "total_size" in text
    assert "model-00099-of-00099.safetensors is not referenced" in text


def test_truncated_shard(moe):
    shard = shard_of(moe, EXPERT + "w1.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    result = cli("verify", moe)
    assert result.exit_code == 2 and "is truncated" in result.stderr


def test_nan_in_output(moe):
    name = EXPERT + "w2.weight"

    def edit(t):
        t[name][0, 0] = float("nan")

    rewrite(shard_of(moe, name), edit)
    assert cli("verify", moe, "--headers-only").exit_code == 0  # headers cannot see values
    result = cli("verify", moe)
    assert result.exit_code == 2 and f"tensor {name} has 1 NaN/Inf value(s)" in result.stderr


def test_report_permutation_damaged(moe):
    def edit(r):
        r["layers"][1]["perm"][0] = r["layers"][1]["perm"][1]

    edit_json(moe / "report.json", edit)
    result = cli("verify", moe, "--headers-only")
    assert result.exit_code == 2 and "report.json layer 1: 'perm' is not a permutation" in result.stderr


# ----------------------------------------------------------------------------------------- against SRC


def test_one_ulp_in_one_expert_is_found(moe, dense):
    name = EXPERT + "w1.weight"

    def edit(t):
        t[name].view(torch.int16)[3, 4] += 1  # the next bf16 value

    rewrite(shard_of(moe, name), edit)
    result = cli("verify", moe, "--against", dense, "--no-logits")
    assert result.exit_code == 2
    assert "layer 1: the experts' gate rows un-permuted differ from the source gate_proj" in result.stderr


def test_down_proj_scale_is_checked(moe, dense):
    name = EXPERT + "w2.weight"
    rewrite(shard_of(moe, name), lambda t: t.update({name: (t[name].float() / 2).to(torch.bfloat16)}))
    result = cli("verify", moe, "--against", dense, "--no-logits")
    assert result.exit_code == 2 and f"tensor {name} is not the source down_proj columns × 2" in result.stderr


def test_swapped_neurons_in_the_report_are_found(moe, dense):
    def edit(r):
        perm = r["layers"][0]["perm"]
        perm[0], perm[-1] = perm[-1], perm[0]  # still a permutation, but not the one that was written

    edit_json(moe / "report.json", edit)
    result = cli("verify", moe, "--against", dense, "--no-logits")
    assert result.exit_code == 2 and "layer 0: the experts' gate rows un-permuted differ" in result.stderr


def test_attention_weight_differs(moe, dense):
    name = "model.layers.2.self_attn.o_proj.weight"
    rewrite(shard_of(moe, name), lambda t: t.update({name: -t[name]}))
    result = cli("verify", moe, "--against", dense, "--no-logits")
    assert result.exit_code == 2 and f"tensor {name} differs from the source" in result.stderr


def test_logits_catch_a_config_change_the_weights_cannot_show(moe, dense):
    edit_json(moe / "config.json", lambda c: c.update(rms_norm_eps=0.5))
    result = cli("verify", moe, "--against", dense)
    assert result.exit_code == 2
    assert "logits with every expert active differ" in result.stderr


def test_against_the_wrong_source(moe, tmp_path):
    other = build_dense(tmp_path / "other", dtype=torch.bfloat16, seed=5)
    result = cli("verify", moe, "--against", other, "--no-logits")
    assert result.exit_code == 2 and "differs from the source" in result.stderr
    bigger = build_dense(tmp_path / "bigger", dtype=torch.bfloat16, intermediate_size=128)
    result = cli("verify", moe, "--against", bigger)
    assert result.exit_code == 2 and "does not fit" in result.stderr


def test_against_needs_report(moe, dense):
    (moe / "report.json").unlink()
    assert cli("verify", moe).exit_code == 0  # structure alone does not need it
    result = cli("verify", moe, "--against", dense)
    assert result.exit_code == 2 and "report.json is missing" in result.stderr


def test_compensated_layers_are_skipped_not_failed(moe, dense):
    """A refit down_proj differs from the source by design: verify says what it did not compare."""
    def edit(r):
        r["layers"][1]["compensated"] = True

    edit_json(moe / "report.json", edit)
    name = EXPERT + "w2.weight"
    rewrite(shard_of(moe, name), lambda t: t.update({name: t[name] * 2}))
    result = cli("verify", moe, "--against", dense)
    assert result.exit_code == 0, result.stderr
    assert "layer 1: down_proj was refit" in result.stdout and "logits: FFN weights were refit (--compensate)" in result.stdout
