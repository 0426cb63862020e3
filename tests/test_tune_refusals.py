"""`moeify tune` refuses what it cannot do, before it does work: each bad input through the CLI gives exit 2 and one
error line naming the file or flag and what to do, no traceback, SRC and OUT byte-identical afterwards, and no
OUT.moeify-tune/ left by a refusal of a new run (an interrupted run's state, refused on --resume, is left as it was,
for --restart or a fixed --resume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import build_dense, edit_json, tree_hash
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.tuning import TuningInterrupted, state_dir, tune_output
from test_calibrate import CALIB
from test_reliability import assert_refused, cli
from tuning_fixtures import CARVE, OPTS, interrupt_at


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """A dense model, its calibrated carve, and an interrupted tuning run of a copy of it (OUT and its state)."""
    root = tmp_path_factory.mktemp("refusals")
    dense = build_dense(root / "dense", tokenizer_dir, num_hidden_layers=3, initializer_range=0.3)
    run_conversion(plan_conversion(dense, build_config(**CARVE)), root / "carve")
    interrupted = Path(shutil.copytree(root / "carve", root / "interrupted"))
    with pytest.raises(TuningInterrupted):
        tune_output(dense, interrupted, OPTS, progress=interrupt_at(2 * 1024), save_every=0)
    return {"dense": dense, "carve": root / "carve", "interrupted": interrupted, "tokenizer": tokenizer_dir}


def _other(tmp: Path, tokenizer: Path, **overrides) -> Path:
    return build_dense(tmp / "other", tokenizer, initializer_range=0.3, **{"num_hidden_layers": 3, **overrides})


# Each case: set-up(src, out, tmp, tokenizer) -> (src, out, extra flags); needles of the one error line.
def _shape(layers=None, hidden=None):
    def setup(src, out, tmp, tok):
        kw = {"num_hidden_layers": layers} if layers else {"hidden_size": hidden}
        return _other(tmp, tok, **kw), out, []
    return setup


def _fine_tune(src, out, tmp, tok):  # the same shape, other weights: the student would not be the output's model
    return _other(tmp, tok, seed=5), out, []


def _untuned_src(src, out, tmp, tok):
    edit_json(src / "config.json", lambda c: c.update(model_type="gpt2"))
    return src, out, []


def _truncated_out(src, out, tmp, tok):
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return src, out, []


def _binary_calib(src, out, tmp, tok):
    bad = tmp / "weights.txt"
    bad.write_bytes(bytes(range(256)) * 64)
    return src, out, ["--calib", bad]


def _bad_jsonl(src, out, tmp, tok):
    bad = tmp / "docs.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": 3}\n')
    return src, out, ["--tune-text", bad]


def _missing_calib(src, out, tmp, tok):
    return src, out, ["--calib", tmp / "nope.txt"]


def _moved_calib(src, out, tmp, tok):  # the output's own calibration text, gone since
    calib = CALIB["calib"][0]  # moeify.toml names it by name, report.json records where it was
    for name, old, new in (("moeify.toml", Path(calib).name, "gone.txt"), ("report.json", calib, str(tmp / "gone.txt"))):
        text = (out / name).read_text()
        assert old in text
        (out / name).write_text(text.replace(old, new))
    return src, out, []


def _damaged_report(src, out, tmp, tok):
    (out / "report.json").write_text('{"layers": [')
    return src, out, []


def _dense_out(src, out, tmp, tok):
    return src, src, []


def _all_active(src, out, tmp, tok):
    run_conversion(plan_conversion(src, build_config(experts=4, top_k=4, method="gate-cluster",
                                                     router="representative")), tmp / "exact")
    return src, tmp / "exact", []


def _flags(*flags):
    def setup(src, out, tmp, tok):
        return src, out, list(flags)
    return setup


NEW_RUN = [
    ("other shape: layers", _shape(layers=2), ["is not the model", "layers is 2, the output's 3", "converted from"]),
    ("other shape: width", _shape(hidden=32), ["is not the model", "hidden_size is 32, the output's 64"]),
    ("same shape, other weights", _fine_tune, ["is not the model", "differs from the output's", "carve that model"]),
    ("source not dense llama", _untuned_src, ["model_type 'gpt2' is not supported"]),
    ("source missing", lambda s, o, t, k: (t / "nope", o, []), ["nope"]),
    ("OUT missing", lambda s, o, t, k: (s, t / "none", []), ["output", "none", "not found"]),
    ("OUT dense", _dense_out, ["is not a moeify output"]),
    ("OUT truncated shard", _truncated_out, ["model.safetensors"]),
    ("OUT report damaged", _damaged_report, ["report.json", "cannot be read", "convert again"]),
    ("OUT all experts active", _all_active, ["every expert is active", "nothing to tune"]),
    ("calib not text", _binary_calib, ["weights.txt", "cannot be read"]),
    ("jsonl without text", _bad_jsonl, ["docs.jsonl:2", "'text' field"]),
    ("calib missing", _missing_calib, ["nope.txt", "not found"]),
    ("recorded calib gone", _moved_calib, ["gone.txt", "not found", "--calib"]),
    ("no --tokens", _flags(), ["--tokens is required"]),
    ("--tokens 0", _flags("--tokens", "0"), ["--tokens must be a positive integer"]),
    ("--lr 2", _flags("--tokens", "1024", "--lr", "2"), ["--lr must be in (0, 1)"]),
    ("--tune-generated 1.5", _flags("--tokens", "1024", "--tune-generated", "1.5"), ["--tune-generated"]),
    ("--schedule bogus", _flags("--tokens", "1024", "--schedule", "bogus"), ["--schedule must be one of"]),
    ("--hidden-weight -1", _flags("--tokens", "1024", "--hidden-weight", "-1"), ["--hidden-weight must be a number >= 0"]),
    ("--resume --restart", _flags("--resume", "--restart"), ["contradict"]),
    ("--resume without a state", _flags("--resume"), ["no interrupted tuning", "--tokens N"]),
]


@pytest.mark.parametrize("case, setup, needles", NEW_RUN, ids=[c[0] for c in NEW_RUN])
def test_a_new_run_is_refused_before_any_work_and_leaves_nothing(models, tmp_path, case, setup, needles):
    src = Path(shutil.copytree(models["dense"], tmp_path / "src"))
    out = Path(shutil.copytree(models["carve"], tmp_path / "out"))
    src, out, flags = setup(src, out, tmp_path, models["tokenizer"])
    if not any(f in flags for f in ("--tokens", "--resume")) and case != "no --tokens":
        flags += ["--tokens", "2048"]
    before = {p: tree_hash(p) for p in (src, out) if p.exists()}
    assert_refused(cli("tune", src, out, *flags), *needles)
    assert {p: tree_hash(p) for p in before} == before  # SRC and OUT byte-identical
    assert not state_dir(out).exists()  # no OUT.moeify-tune/ left behind
    assert not list(tmp_path.glob("*.moeify-partial"))


# Each case: damage(state dir, out, src dir, tmp) -> src to pass; needles of the one error line.
def _damage_json(name, text):
    def damage(state, out, src, tmp):
        (state / name).write_text(text)
        return src
    return damage


def _truncate(pattern):
    def damage(state, out, src, tmp):
        f = sorted(state.glob(pattern))[0]
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
        return src
    return damage


def _remove(pattern):
    def damage(state, out, src, tmp):
        sorted(state.glob(pattern))[0].unlink()
        return src
    return damage


def _options(state, out, src, tmp):
    edit_json(state / "run.json", lambda r: r["options"].update(tokens="many"))
    return src


RESUME = [
    ("run.json half-written", _damage_json("run.json", '{"version": 1, "created": 17'), ["run.json is damaged"]),
    ("run.json not an object", _damage_json("run.json", "[]"), ["run.json is damaged", "not a JSON object"]),
    ("run.json options", _options, ["run.json is damaged", "options"]),
    ("state.json half-written", _damage_json("state.json", '{"file": "state-2.saf'), ["state.json is damaged"]),
    ("state.json names a file elsewhere", _damage_json("state.json", '{"file": "../../x.safetensors", "meta": '
                                                      '{"step": 2, "total": 12, "best_file": null}}'),
     ["state.json is damaged", "not a snapshot file"]),
    ("snapshot truncated", _truncate("state-*.safetensors"), ["state-", "is damaged"]),
    ("snapshot missing", _remove("state-*.safetensors"), ["state-", "missing", "named by state.json"]),
    ("tuning text truncated", _truncate("data.safetensors"), ["data.safetensors is damaged"]),
    ("sampled batch truncated", _truncate("sampled/batch-*.safetensors"), ["batch-00000.safetensors is damaged"]),
    ("teacher targets truncated", _truncate("targets/batch-*.safetensors"), ["batch-00000.safetensors is damaged"]),
    ("another source", lambda st, o, s, t: _other(t, None, seed=9), ["another source"]),
]


@pytest.mark.parametrize("case, damage, needles", RESUME, ids=[c[0] for c in RESUME])
def test_a_damaged_or_foreign_state_is_refused_on_resume_by_name(models, tmp_path, case, damage, needles):
    src = Path(shutil.copytree(models["dense"], tmp_path / "src"))
    out = Path(shutil.copytree(models["interrupted"], tmp_path / "out"))
    state = Path(shutil.copytree(state_dir(models["interrupted"]), state_dir(out)))
    src = damage(state, out, src, tmp_path)
    before = {p: tree_hash(p) for p in (src, out, state)}
    line = assert_refused(cli("tune", src, out, "--resume"), *needles)
    if case != "another source":
        assert "--restart" in line  # the way out
    assert {p: tree_hash(p) for p in before} == before  # the state is left for --restart; SRC and OUT unchanged


def test_restart_after_a_damaged_state_tunes(models, tmp_path):
    out = Path(shutil.copytree(models["interrupted"], tmp_path / "out"))
    state = Path(shutil.copytree(state_dir(models["interrupted"]), state_dir(out)))
    (state / "run.json").write_text("{")
    res = cli("tune", models["dense"], out, "--tokens", "2048", "--tune-generated", "0.25")
    assert_refused(res, "interrupted tuning", "--restart")
    res = cli("tune", models["dense"], out, "--tokens", "2048", "--tune-generated", "0.25", "--restart")
    assert res.exit_code == 0, res.output
    assert not state.exists()


def test_a_weight_only_output_tunes_on_the_bundled_text(models, tmp_path):
    """An output carved without calibration text tunes on the bundled broad sample (and sampled text) rather than
    failing on the empty calibration text it recorded."""
    out = tmp_path / "weights"
    run_conversion(plan_conversion(models["dense"], build_config(experts=4, top_k=2, method="gate-cluster",
                                                                 router="representative")), out)
    res = cli("tune", models["dense"], out, "--tokens", "2048", "--tune-generated", "0.25")
    assert res.exit_code == 0, res.output
    run = json.loads((out / "report.json").read_text())["tuning"]["runs"][0]
    assert set(run["text"]) == {"bundled", "generated"}


def test_the_dry_run_refuses_as_the_run_does(models, tmp_path):
    other = _other(tmp_path, models["tokenizer"], num_hidden_layers=2)
    out = Path(shutil.copytree(models["carve"], tmp_path / "out"))
    assert_refused(cli("tune", other, out, "--tokens", "2048", "--dry-run"), "is not the model")
    assert not state_dir(out).exists()


def test_a_late_refusal_of_a_new_run_removes_the_state_it_began(models, tmp_path, monkeypatch):
    """A refusal no check found before the state directory was begun (here: the teacher fails to load) leaves no
    state behind, since nothing in it is work a --resume would use."""
    import moeify.tuning.run as run_mod
    from moeify.errors import MoeifyError

    def refuse(*a, **k):
        raise MoeifyError("tuning cannot load the teacher (test)")

    monkeypatch.setattr(run_mod, "load_teacher", refuse)
    out = Path(shutil.copytree(models["carve"], tmp_path / "out"))
    with pytest.raises(MoeifyError, match="cannot load"):
        tune_output(models["dense"], out, OPTS)
    assert not state_dir(out).exists()
