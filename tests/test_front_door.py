"""The front door: presets by name, checkpoints by Hub id (from a Hub cache this test lays out, with every socket
refused), the Python API, and the model card every output carries."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moeify
from conftest import build_dense, lay_out_hub
from moeify.cli.app import app
from moeify.errors import MoeifyError

COMMIT, V1 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dense(tmp_path_factory.mktemp("front") / "dense", tokenizer_dir, intermediate_size=128)


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails, as on a machine without network."""
    def refuse(*args, **kwargs):
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub(tmp_path, dense, monkeypatch, no_network):
    """HF_HUB_CACHE with org/tiny (main and v1) and org/config-only (config.json alone); offline unless a test
    says otherwise (the sockets are refused either way)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    (dense / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    (dense / "LICENSE").write_text("Apache License 2.0 (the test's stand-in)\n")
    lay_out_hub(cache, "org/tiny", dense, {"main": COMMIT, "v1": V1})
    lay_out_hub(cache, "org/config-only", dense, {"main": COMMIT}, only=("config.json",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return " ".join(lines[0].split())


# ------------------------------------------------------------------------------------------------------ presets


def test_presets_by_name_by_path_and_an_unknown_name_lists_them(dense, tmp_path):
    from moeify.formats.config import preset_names, preset_path

    assert preset_names() == ["active-25", "active-50", "active-75"]
    assert preset_path("active-50").name == preset_path("configs/active-50.toml").name == "active-50.toml"
    mine = tmp_path / "mine.toml"
    mine.write_text("experts = 4\ntop_k = 2\n")
    assert preset_path(mine) == mine
    line = one_error_line(cli("plan", dense, "--preset", "active-60"))
    assert line == ("error: preset active-60 not found (the presets: active-25, active-50, active-75) — name one, e.g. "
                    "--preset active-50, or pass a TOML file (an earlier output's moeify.toml works)")


def test_no_layout_given_carves_the_recommended_preset_and_says_which(dense, tmp_path):
    res = cli("convert", dense, tmp_path / "out", "--no-tune", "--calib-tokens", "512", "--dry-run")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "note: no layout given: the active-50 preset" in said
    by_name = cli("convert", dense, tmp_path / "out", "--preset", "active-50", "--no-tune", "--calib-tokens", "512",
                  "--dry-run", "--json", "-")
    default = cli("convert", dense, tmp_path / "out", "--no-tune", "--calib-tokens", "512", "--dry-run", "--json",
                  "-")
    assert json.loads(by_name.stdout) == json.loads(default.stdout)
    plan = json.loads(cli("plan", dense, "--json", "-").stdout)
    assert plan == json.loads(cli("plan", dense, "--preset", "active-50", "--json", "-").stdout)
    # a count given: no preset, the old defaults for the rest
    assert "no layout given" not in cli("convert", dense, tmp_path / "o2", "-n", "4", "--weight-only",
                                        "--dry-run").output


# ---------------------------------------------------------------------------------------------------- Hub ids


def test_a_hub_id_converts_from_the_cache_with_the_network_refused(hub, dense, tmp_path):
    res = cli("convert", "org/tiny", tmp_path / "out", "-n", "4", "-k", "2", "--weight-only")
    assert res.exit_code == 0, res.output
    from moeify.carving.conversion import plan_conversion, run_conversion
    from moeify.formats.config import build_config

    run_conversion(plan_conversion(dense, build_config(experts=4, top_k=2, method="gate-cluster",
                                                       router="representative")), tmp_path / "local")
    out, local = tmp_path / "out", tmp_path / "local"
    assert (out / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert (out / "LICENSE").read_text() == (dense / "LICENSE").read_text()  # the licence travels
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: org/tiny\n" in card and "license: apache-2.0\n" in card
    assert "base_model: " not in (local / "README.md").read_text()  # a local source names no Hub model


def test_plan_reads_config_json_alone_and_a_revision_resolves(hub, dense, tmp_path):
    res = cli("plan", "org/config-only", "--preset", "active-25", "--json", "-")
    assert res.exit_code == 0, res.output
    by_id, local = (json.loads(r) for r in (res.stdout, cli("plan", dense / "config.json", "--preset", "active-25",
                                                              "--json", "-").stdout))
    assert by_id.pop("source").endswith(f"models--org--config-only/snapshots/{COMMIT}") and local.pop("source")
    assert by_id == local
    snap = hub / "models--org--tiny" / "snapshots" / V1
    edited = json.loads((snap / "config.json").read_text())
    edited["intermediate_size"] = 256
    (snap / "config.json").write_text(json.dumps(edited))
    v1 = json.loads(cli("plan", "org/tiny@v1", "-n", "4", "-k", "2", "--json", "-").stdout)
    main = json.loads(cli("plan", "org/tiny", "-n", "4", "-k", "2", "--json", "-").stdout)
    assert (v1["d_ff"], main["d_ff"]) == (256, 128) and v1["source"].endswith(V1)


def test_a_model_not_in_the_cache_offline_or_unreachable_gets_one_line(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants
    import huggingface_hub.utils._http as http

    line = one_error_line(cli("convert", "org/absent", tmp_path / "o", "-n", "4", "--weight-only"))
    assert line.startswith(f"error: SRC org/absent is not in the Hub cache ({hub}) and HF_HUB_OFFLINE is set — "
                           "fetch it once with network access")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online, but every socket is refused
    waits = []  # huggingface_hub's own backoff between its retries (1 + 2 + 4 + 8 + 8 s), counted instead of slept
    monkeypatch.setattr(http.time, "sleep", waits.append)
    line = one_error_line(cli("plan", "org/absent"))
    assert sum(waits) > 0  # the Hub was retried before the line
    assert "org/absent is not in the Hub cache" in line and "the Hub cannot be reached" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("error, said", [
    ("GatedRepoError", "error: SRC org/gated is gated on the Hugging Face Hub: its licence must be accepted first — "
                       "accept it on https://huggingface.co/org/gated, then log in"),
    ("RepositoryNotFoundError", "error: SRC org/gated is neither a folder here nor a model on the Hugging Face Hub"),
    ("RevisionNotFoundError", "error: SRC org/gated has no revision 'v9' on the Hugging Face Hub — name a branch"),
])
def test_gated_missing_and_wrong_revision_sources_get_one_line(hub, tmp_path, monkeypatch, error, said):
    """What the Hub answers (huggingface_hub's errors, raised here in its place: no network) becomes one line."""
    import huggingface_hub
    import huggingface_hub.errors as errors
    from huggingface_hub.utils import HfHubHTTPError

    def answer(*args, **kwargs):
        raise getattr(errors, error)("the Hub says no", response=_response()) if issubclass(
            getattr(errors, error), HfHubHTTPError) else getattr(errors, error)("the Hub says no")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", answer)
    line = one_error_line(cli("convert", "org/gated@v9" if "Revision" in error else "org/gated", tmp_path / "o",
                              "-n", "4", "--weight-only"))
    assert line.startswith(said)


def _response():
    import httpx2  # huggingface_hub's HTTP client

    return httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/gated"))


def test_a_hub_model_without_safetensors_is_refused(hub, dense):
    lay_out_hub(hub, "org/pickled", dense, {"main": COMMIT}, only=("config.json", "tokenizer.json"))
    line = one_error_line(cli("convert", "org/pickled", "unused-out", "-n", "4", "--weight-only"))
    assert line.startswith("error: SRC org/pickled has no safetensors weights on the Hugging Face Hub (moeify never "
                           "loads pickled .bin weights")
    assert not Path("unused-out").exists()


def test_a_folder_named_like_an_id_is_a_folder(dense, tmp_path, monkeypatch, no_network):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(dense, tmp_path / "org" / "tiny")
    assert cli("plan", "org/tiny", "-n", "4", "-k", "2").exit_code == 0


# ------------------------------------------------------------------------------------------------- Python API


def test_the_api_converts_what_the_cli_converts_and_raises_instead_of_exiting(dense, tmp_path):
    result = moeify.convert(dense, tmp_path / "api", experts=4, top_k=2, weight_only=True)
    assert isinstance(result, moeify.Conversion) and result.out == tmp_path / "api"
    assert result.report["settings"]["experts"] == 4
    assert cli("convert", dense, tmp_path / "cli", "-n", "4", "-k", "2", "--weight-only").exit_code == 0
    for name in ("model.safetensors", "config.json", "moeify.toml"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    reports = [json.loads((tmp_path / d / "report.json").read_text()) for d in ("api", "cli")]
    for r in reports:
        r.pop("seconds")
    assert reports[0] == reports[1]
    with pytest.raises(MoeifyError, match="already exists"):
        moeify.convert(dense, tmp_path / "api", experts=4, top_k=2, weight_only=True)
    with pytest.raises(MoeifyError, match="unknown setting"):
        moeify.convert(dense, tmp_path / "x", experts=4, topk=2)
    stages = []
    moeify.convert(dense, tmp_path / "p", experts=4, top_k=2, weight_only=True,
                   progress=lambda stage, done, total, *note: stages.append(stage))
    assert "writing" in stages
    plan = moeify.plan(dense, preset="active-25")
    assert plan.to_dict()["layout"]["resolved"].startswith("d_ff 128")


def test_the_card_follows_the_output_through_tuning_and_evaluation(dense, tmp_path):
    from huggingface_hub import ModelCard

    out = tmp_path / "moe"
    moeify.convert(dense, out, experts=4, top_k=2, calib_tokens=1024, calib_seq_len=64, tune=False)
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"moeify", "mixture-of-experts", "qwen2_moe"} & set(data["tags"]) and "base_model" not in data
    assert "training-free" in card.text and "| routed experts | 4 of 32 neurons, top-2 a token |" in card.text
    assert "Perplexity: not measured yet" in card.text and "```toml\nexperts = 4" in card.text
    moeify.tune(dense, out, tokens=2048, lr=0.02, generated=0.25)
    card = ModelCard.load(out / "README.md").text
    assert "recovery-tuned on 2,048 tokens" in card and "Tuning: held-out KL divergence" in card
    moeify.evaluate([dense, out], max_tokens=512, seq_len=64, oracle=False, kl=False)
    card = ModelCard.load(out / "README.md").text
    assert "| dense | " in card and "| moe | " in card and "Perplexity by `moeify eval` on 512 tokens" in card
    assert json.loads((out / "evaluation.json").read_text())["models"][0]["ratio"] == 1.0


def test_the_resume_hint_names_a_hub_source_by_its_id_at_the_commit_tuned(hub, dense, tmp_path):
    """An interrupted tuning of a Hub source says how to continue it with the id (pinned to the commit the run began
    from, so the same weights), not with the cache's snapshot folder; the id resolves to that folder."""
    from moeify.formats.hub import resolve
    from moeify.tuning.state import resume_command

    snapshot = resolve("org/tiny")
    assert "snapshots" in str(snapshot)
    assert resume_command(snapshot, tmp_path / "out") == f"moeify tune org/tiny@{COMMIT} {tmp_path / 'out'} --resume"
    assert resolve(f"org/tiny@{COMMIT}") == snapshot
    assert resume_command(dense, tmp_path / "out") == f"moeify tune {dense} {tmp_path / 'out'} --resume"
