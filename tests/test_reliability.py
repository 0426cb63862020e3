"""Bad inputs through the CLI: exit code 2 (1 only for internal bugs), one error line naming the file / tensor / flag
and the fix, no OUT (or OUT.moeify-partial) left behind, SRC byte-for-byte unchanged. Then all-or-nothing output
(Ctrl-C, SIGTERM, kill -9, leftovers), free space, pickles, NaN/Inf and determinism."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import build_dense, edit_json, rewrite, tree_hash
from moeify.cli.app import app

REPO = Path(__file__).resolve().parents[1]
LAYER_TENSOR = "model.layers.1.mlp.up_proj.weight"


def cli(*args) -> "Result":  # noqa: F821
    """The CLI; a conversion without --calib runs weight-only (fast) unless the test names its calibration."""
    args = [str(a) for a in args]
    if args[:1] == ["convert"] and not {"--calib", "--weight-only", "--help"} & set(args):
        args.append("--weight-only")
    return CliRunner().invoke(app, args)


def error_lines(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.strip()]


def assert_refused(result, *needles: str, code: int = 2) -> str:
    """Exit code, exactly one 'error:' line (no traceback) containing every needle; returns that line."""
    assert result.exit_code == code, (result.exit_code, result.stdout[-2000:], result.stderr[-2000:], result.exception)
    lines = [ln for ln in error_lines(result) if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="session")
def source(tmp_path_factory, tokenizer_dir) -> Path:
    """A small bf16 Llama with a tokenizer (d_ff 96, 3 layers)."""
    return build_dense(tmp_path_factory.mktemp("src") / "dense", tokenizer_dir, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def sharded_source(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dense(tmp_path_factory.mktemp("src") / "sharded", tokenizer_dir, dtype=torch.bfloat16,
                       max_shard_size="60KB")


@pytest.fixture
def src(tmp_path, source) -> Path:
    """A private copy of the source that a test may damage."""
    return Path(shutil.copytree(source, tmp_path / "src"))


def first_shard(src: Path) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][LAYER_TENSOR]


# ------------------------------------------------------------------------------------------ the matrix
# Each case: (set-up(src, tmp) -> the source dir to pass, extra CLI args, needles the error line must contain).


def _missing_src(src, tmp):
    return tmp / "nope"


def _no_config(src, tmp):
    (src / "config.json").unlink()
    return src


def _bad_json(src, tmp):
    (src / "config.json").write_text('{"model_type": "llama",')
    return src


def _model_type(kind):
    def setup(src, tmp):
        edit_json(src / "config.json", lambda c: c.update(model_type=kind))
        return src
    return setup


def _moe_keys(src, tmp):
    edit_json(src / "config.json", lambda c: c.update(num_local_experts=8))
    return src


def _missing_tensor(src, tmp):
    rewrite(src / "model.safetensors", lambda t: t.pop(LAYER_TENSOR))
    return src


def _wrong_shape(src, tmp):
    rewrite(src / "model.safetensors", lambda t: t.update({LAYER_TENSOR: t[LAYER_TENSOR][:80].clone()}))
    return src


def _index_missing_shard(src, tmp):
    (src / first_shard(src)).unlink()
    return src


def _index_entry(value):
    def setup(src, tmp):
        edit_json(src / "model.safetensors.index.json", lambda i: i["weight_map"].update({LAYER_TENSOR: value}))
        return src
    return setup


def _symlink_shard_escapes(src, tmp):
    shard = src / first_shard(src)
    outside = tmp / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    return src


def _symlink_single_escapes(src, tmp):
    outside = tmp / "elsewhere.safetensors"
    shutil.move(src / "model.safetensors", outside)
    (src / "model.safetensors").symlink_to(outside)
    return src


def _symlink_tokenizer_escapes(src, tmp):
    secret = tmp / "secret.txt"
    secret.write_text("not for the output")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    return src


def _truncate(fraction):
    def setup(src, tmp):
        path = src / "model.safetensors"
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])
        return src
    return setup


def _header_length_huge(src, tmp):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return src


def _header_not_json(src, tmp):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\xff" * 12
    path.write_bytes(bytes(data))
    return src


def _header_offsets_lie(src, tmp):
    """Valid JSON, but one tensor's data_offsets do not match its shape."""
    path = src / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header[LAYER_TENSOR]["shape"] = [header[LAYER_TENSOR]["shape"][0] * 2, header[LAYER_TENSOR]["shape"][1]]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])  # offsets are relative to the data
    return src


def _pickle_only(src, tmp):
    torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    return src


def _nan(value):
    def setup(src, tmp):
        def put(t):
            t[LAYER_TENSOR][5, 7] = value
        rewrite(src / "model.safetensors", put)
        return src
    return setup


def _preset(text):
    def setup(src, tmp):
        (tmp / "preset.toml").write_text(text)
        return src
    return setup


def _calib_file(content: bytes | None):
    def setup(src, tmp):
        if content is not None:
            (tmp / "calib.txt").write_bytes(content)
        return src
    return setup


SHARDED = {"index-missing-shard", "index-dotdot", "index-absolute", "index-symlink-escapes"}
CASES = {
    # id: (set-up, extra args, needles)
    "missing-src": (_missing_src, [], ["nope", "does not exist"]),
    "no-config": (_no_config, [], ["config.json not found"]),
    "invalid-json": (_bad_json, [], ["config.json is not valid JSON"]),
    "gpt2": (_model_type("gpt2"), [], ["'gpt2' is not supported", "llama, mistral"]),
    "already-moe-type": (_model_type("mixtral"), [], ["already a Mixture-of-Experts"]),
    "already-moe-keys": (_moe_keys, [], ["num_local_experts = 8", "already a Mixture-of-Experts"]),
    "missing-tensor": (_missing_tensor, [], [LAYER_TENSOR, "missing"]),
    "wrong-shape": (_wrong_shape, [], [LAYER_TENSOR, "[80, 64]", "[96, 64]"]),
    "index-missing-shard": (_index_missing_shard, [], ["missing", "re-download"]),
    "index-dotdot": (_index_entry("../x.safetensors"), [], ["../x.safetensors", "outside the checkpoint"]),
    "index-absolute": (_index_entry("/etc/passwd"), [], ["/etc/passwd", "outside the checkpoint"]),
    "index-symlink-escapes": (_symlink_shard_escapes, [], ["link that escapes"]),
    "single-symlink-escapes": (_symlink_single_escapes, [], ["model.safetensors", "link that escapes"]),
    "tokenizer-symlink-escapes": (_symlink_tokenizer_escapes, [], ["tokenizer.json", "link that escapes"]),
    "truncated-data": (_truncate(0.7), [], ["model.safetensors is truncated", "re-download"]),
    "truncated-header": (_truncate(0.0005), [], ["model.safetensors", "re-download"]),
    "header-length-corrupt": (_header_length_huge, [], ["corrupt safetensors header"]),
    "header-not-json": (_header_not_json, [], ["corrupt safetensors header"]),
    "header-offsets-lie": (_header_offsets_lie, [], [LAYER_TENSOR, "data_offsets"]),
    "pickle-only": (_pickle_only, [], ["pytorch_model.bin", "pickle", "--allow-pickle"]),
    "experts-not-dividing": (None, ["-n", "5", "-k", "2"], ["--experts 5", "does not divide", "valid --experts"]),
    "shared-not-dividing": (None, ["-n", "4", "-k", "2", "--shared", "1"], ["--shared 1", "does not divide"]),
    "top-k-above-experts": (None, ["-n", "4", "-k", "5"], ["--top-k", "between 1 and --experts (4)"]),
    "top-k-zero": (None, ["-n", "4", "-k", "0"], ["--top-k", "got 0"]),
    "top-k-negative": (None, ["-n", "4", "-k", "-1"], ["--top-k", "got -1"]),
    "experts-negative": (None, ["-n", "-4", "-k", "1"], ["--experts must be ≥ 1"]),
    "shared-negative": (None, ["-n", "4", "-k", "1", "--shared", "-1"], ["--shared must be ≥ 0"]),
    "dense-layers-out-of-range": (None, ["--dense-layers", "0,7"], ["--dense-layers 7", "3 layers (0..2)"]),
    "dense-layers-negative": (None, ["--dense-layers=-1"], ["--dense-layers", "non-negative"]),
    "dense-layers-garbage": (None, ["--dense-layers", "one"], ["--dense-layers 'one'"]),
    "dense-layers-all": (None, ["--dense-layers", "0,1,2"], ["every layer"]),
    "shard-size-garbage": (None, ["--max-shard-size", "big"], ["--max-shard-size 'big'"]),
    "method-unknown": (None, ["--method", "magic"], ["--method 'magic'", "gate-cluster"]),
    "preset-missing": (None, ["--preset", "{tmp}/nope.toml"], ["nope.toml not found (the presets: active-25, active-50, active-75)", "--preset active-50"]),
    "pad-experts-not-multiple-of-8": (None, ["--pad-experts-to", "100"],
                                      ["--pad-experts-to must be a positive multiple of 8, got 100", "128 or 256"]),
    "json-unwritable": (None, ["--dry-run", "--json", "{tmp}/src/config.json/plan.json"],
                        ["--json", "plan.json cannot be written", "'-' for stdout"]),
    "preset-unknown-key": (_preset("experts = 4\nbogus = 1\n"), ["--preset", "{tmp}/preset.toml"],
                           ["preset.toml has unknown key(s): bogus"]),
    "preset-invalid-toml": (_preset("experts = \n"), ["--preset", "{tmp}/preset.toml"], ["not valid TOML"]),
    "preset-wrong-type": (_preset('gate_tolerance = "small"\n'), ["--preset", "{tmp}/preset.toml"],
                          ["--gate-tolerance must be a number"]),
    "preset-non-integer": (_preset("experts = 2.5\n"), ["--preset", "{tmp}/preset.toml"],
                           ["--experts must be an integer, got 2.5"]),
    "nan-weight": (_nan(float("nan")), [], [LAYER_TENSOR, "NaN/Inf", "[5, 7]", "--allow-nonfinite"]),
    "inf-weight": (_nan(float("inf")), [], [LAYER_TENSOR, "NaN/Inf", "inf", "--allow-nonfinite"]),
    "calib-missing-file": (_calib_file(None), ["--calib", "{tmp}/calib.txt"], ["calib.txt", "not found"]),
    "calib-unreadable": (_calib_file(b"\xff\xfe\x00bad utf8 \xc3\x28"), ["--calib", "{tmp}/calib.txt"],
                         ["calib.txt", "cannot be read"]),
    "calib-empty": (_calib_file(b"   \n\n"), ["--calib", "{tmp}/calib.txt"], ["calib.txt", "empty"]),
    "calib-too-few-tokens": (_calib_file(b"A short text."), ["--calib", "{tmp}/calib.txt", "--calib-tokens", "4096",
                                                              "--calib-seq-len", "64"],
                             ["fewer than --calib-tokens 4096", "shorter than one window",
                              "lower --calib-seq-len (to at most 10)"]),
    "calib-default-shorter-than-a-window": (_calib_file(b"A short text."), ["--calib", "{tmp}/calib.txt",
                                                                            "--calib-seq-len", "64"],
                                            ["fewer than one window of --calib-seq-len 64",
                                             "lower --calib-seq-len (to at most 10)"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_cleanly(case, tmp_path, source, sharded_source):
    setup, extra, needles = CASES[case]
    src = Path(shutil.copytree(sharded_source if case in SHARDED else source, tmp_path / "src"))
    if setup is not None:
        src = setup(src, tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    if "-n" not in args and "--preset" not in args:
        args = ["-n", "4", "-k", "2", *args]
    before = tree_hash(src) if src.exists() else None
    out = tmp_path / "out"
    result = cli("convert", src, out, *args)
    assert_refused(result, *needles)
    assert not out.exists() and not (tmp_path / "out.moeify-partial").exists()
    if before is not None:
        assert tree_hash(src) == before, "the source directory changed"


def test_non_integer_flag_is_a_usage_error(tmp_path, source):
    result = cli("convert", source, tmp_path / "out", "--experts", "2.5")
    assert result.exit_code == 2
    text = " ".join(result.stderr.split())  # typer draws its usage errors in a box
    assert "'--experts'" in text and "valid integer" in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()


def _help_text(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "240"})  # no word cut at 80 columns
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # in case typer draws help in boxes


def test_help_cites_an_existing_preset_name_and_one_json_convention():
    """--help names the recommended preset by the name that works from an installed package (active-50; e8k2 never
    existed), and every command's --json takes PATH (a file) or '-' (stdout)."""
    from moeify.formats.config import preset_names

    text = _help_text("convert")
    assert "--preset active-50" in text and "[default: active-50 when no" in text and "e8k2" not in text
    assert "active-50" in preset_names()
    # the defaults the help texts state are shown (as rich markup, "[default: 8]" would vanish from the output)
    assert "[default: the preset's; with --top-k/--shared but no preset, 8]." in text and "[default: fitted;" in text
    for command in ("convert", "eval", "plan", "verify", "inspect"):
        text = _help_text(command)
        assert "--json PATH|-" in text and "to stdout with '-'" in text, command


# -------------------------------------------------------------------------------------------- OUT problems


def test_out_exists(tmp_path, source):
    out = tmp_path / "out"
    out.mkdir()
    assert_refused(cli("convert", source, out, "-n", "4"), str(out), "already exists", "--overwrite")
    assert out.is_dir() and not any(out.iterdir())


def test_overwrite_refuses_a_directory_moeify_did_not_write(tmp_path, source):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert_refused(cli("convert", source, out, "-n", "4", "--overwrite"), "moeify did not write", "moeify.toml")
    assert (out / "precious.txt").read_text() == "keep me"


def test_overwrite_refuses_a_file(tmp_path, source):
    out = tmp_path / "out"
    out.write_text("a file")
    assert_refused(cli("convert", source, out, "-n", "4", "--overwrite"), "not a directory")
    assert out.read_text() == "a file"


def test_out_inside_src(src, tmp_path):
    before = tree_hash(src)
    assert_refused(cli("convert", src, src / "moe", "-n", "4"), "inside the source checkpoint")
    assert tree_hash(src) == before and not (src / "moe").exists()


def test_src_inside_out_even_with_overwrite(tmp_path, source):
    """--overwrite of a directory that contains SRC would delete the source."""
    out = tmp_path / "work"
    src = Path(shutil.copytree(source, out / "dense"))
    (out / "moeify.toml").write_text("experts = 4\n")  # looks like an earlier output
    before = tree_hash(src)
    assert_refused(cli("convert", src, out, "-n", "4", "--overwrite"), "is inside the output")
    assert tree_hash(src) == before


def test_not_enough_free_space(tmp_path, source, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 50_000, 50_000))
    out = tmp_path / "out"
    line = assert_refused(cli("convert", source, out, "-n", "4"), "not enough free space", str(out), "50.0 KB free")
    assert "another disk" in line
    assert not out.exists() and not (tmp_path / "out.moeify-partial").exists()


def test_enough_free_space_counts_the_output(tmp_path, source, monkeypatch):
    """The check compares with the planned output size plus margin, not a fixed number."""
    from moeify.formats.output import FREE_SPACE_MARGIN

    Usage = namedtuple("Usage", "total used free")
    out_bytes = sum(t.numel() * 2 for t in load_file(str(source / "model.safetensors")).values())  # ~ output
    free = FREE_SPACE_MARGIN + 3 * out_bytes
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))
    assert cli("convert", source, tmp_path / "out", "-n", "4").exit_code == 0


# ------------------------------------------------------------------------------------------ all or nothing


def test_internal_error_exits_1_and_leaves_nothing(tmp_path, source, monkeypatch):
    import moeify.carving.conversion as convert

    def boom(*args, **kwargs):
        (tmp_path / "out.moeify-partial" / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("boom")

    monkeypatch.setattr(convert, "_write_tensors", boom)
    result = cli("convert", source, tmp_path / "out", "-n", "4")
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.moeify-partial").exists()


def test_ctrl_c_leaves_nothing(tmp_path, source, monkeypatch):
    import moeify.carving.conversion as convert

    def interrupted(plan, writer, *args, **kwargs):
        writer.write("model.embed_tokens.weight", plan.reader.get("model.embed_tokens.weight"))
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_tensors", interrupted)
    result = cli("convert", source, tmp_path / "out", "-n", "4")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.moeify-partial").exists()


def test_an_internally_inconsistent_output_is_not_committed(tmp_path, source, monkeypatch):
    """convert runs the cheap part of verify on its output: a config.json that disagrees with the shards is a bug."""
    import moeify.carving.conversion as convert

    real = convert.target_config
    monkeypatch.setattr(convert, "target_config", lambda *a, **k: {**real(*a, **k), "num_local_experts": 5})
    result = cli("convert", source, tmp_path / "out", "-n", "4")
    assert result.exit_code == 1 and "output check failed" in str(result.exception)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.moeify-partial").exists()


def test_leftover_partial_is_named_and_removed_with_overwrite(tmp_path, source):
    out = tmp_path / "out"
    partial = tmp_path / "out.moeify-partial"
    partial.mkdir()
    (partial / "model-00001-of-00009.safetensors").write_bytes(b"x" * 1234)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (partial / ".moeify-writing").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                         "started": time.time() - 60}))
    line = assert_refused(cli("convert", source, out, "-n", "4"), str(partial), "interrupted conversion", "--overwrite")
    assert f"pid {dead.pid}" in line and "KB written" in line
    assert cli("convert", source, out, "-n", "4", "--overwrite").exit_code == 0
    assert not partial.exists() and (out / "model.safetensors").is_file()
    assert not (out / ".moeify-writing").exists()


def test_a_running_writer_is_not_disturbed_even_with_overwrite(tmp_path, source):
    partial = tmp_path / "out.moeify-partial"
    partial.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (partial / ".moeify-writing").write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname(),
                                                             "started": time.time()}))
        assert_refused(cli("convert", source, tmp_path / "out", "-n", "4", "--overwrite"),
                       f"another moeify (pid {alive.pid})")
        assert (partial / ".moeify-writing").is_file()
    finally:
        alive.kill()
        alive.wait()


@pytest.fixture(scope="module")
def slow_source(tmp_path_factory) -> Path:
    """Big enough (24 layers, d_ff 1024, many small output shards, k-means per layer) that a conversion
    takes several seconds, so a signal sent mid-write cannot miss it."""
    return build_dense(tmp_path_factory.mktemp("slow") / "dense", num_hidden_layers=24, intermediate_size=1024)


def _start_convert(src: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moeify.cli.app", "convert", str(src), str(out), "-n", "8", "-k", "2", "--weight-only",
           "--method", "gate-cluster", "--kmeans-iters", "20", "--max-shard-size", "50KB", *extra]
    # A shell running the tests in the background (nohup, CI runners) may start us with SIGINT ignored, and a
    # child inherits that; restore the default so the child sees Ctrl-C as a user's terminal would send it.
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))


def _wait_for_shards(proc: subprocess.Popen, partial: Path, timeout: float = 300) -> None:
    """Until the partial directory holds a written shard (the conversion is mid-write)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"conversion ended (rc {proc.returncode}) before it could be interrupted: {proc.stderr.read()}")
        if partial.is_dir() and len(list(partial.glob("*.safetensors"))) >= 2:
            return
        time.sleep(0.002)
    pytest.fail("no partial output appeared")


def test_kill_9_mid_write_leaves_no_out_and_the_next_run_explains(tmp_path, slow_source):
    out, partial = tmp_path / "out", tmp_path / "out.moeify-partial"
    proc = _start_convert(slow_source, out)
    try:
        _wait_for_shards(proc, partial)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and partial.is_dir()  # half-written, and never mistaken for OUT
    line = assert_refused(cli("convert", slow_source, out, "-n", "8", "-k", "2", "--method", "contiguous"),
                          str(partial), "left over from an interrupted conversion", f"pid {proc.pid}", "--overwrite")
    assert "written" in line
    result = cli("convert", slow_source, out, "-n", "8", "-k", "2", "--method", "contiguous", "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert not partial.exists() and (out / "config.json").is_file()
    assert cli("verify", out, "--headers-only").exit_code == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_signal_removes_the_partial_output(tmp_path, slow_source, sig):
    out, partial = tmp_path / "out", tmp_path / "out.moeify-partial"
    proc = _start_convert(slow_source, out)
    try:
        _wait_for_shards(proc, partial)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not out.exists() and not partial.exists()


# ------------------------------------------------------------------------------------- pickles and NaN/Inf


def _shards(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.glob("*.safetensors"))}


def test_allow_pickle_reads_bin_weights_like_safetensors(tmp_path, source):
    ref = tmp_path / "ref"
    assert cli("convert", source, ref, "-n", "4", "-k", "2").exit_code == 0
    src = Path(shutil.copytree(source, tmp_path / "src"))
    _pickle_only(src, tmp_path)
    before = tree_hash(src)
    out = tmp_path / "out"
    result = cli("convert", src, out, "-n", "4", "-k", "2", "--allow-pickle")
    assert result.exit_code == 0, result.stderr
    assert _shards(out) == _shards(ref)
    assert tree_hash(src) == before


def test_allow_pickle_sharded_bin_with_index(tmp_path, source):
    ref = tmp_path / "ref"
    assert cli("convert", source, ref, "-n", "4", "-k", "2").exit_code == 0
    src = Path(shutil.copytree(source, tmp_path / "src"))
    tensors = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in halves.items():
        torch.save({n: tensors[n] for n in part}, src / file)
    weight_map = {n: f for f, part in halves.items() for n in part}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_refused(cli("convert", src, tmp_path / "out", "-n", "4"), "pickle", "--allow-pickle")
    result = cli("convert", src, tmp_path / "out", "-n", "4", "-k", "2", "--allow-pickle")
    assert result.exit_code == 0, result.stderr
    assert _shards(tmp_path / "out") == _shards(ref)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_allow_pickle_never_runs_code(tmp_path, source):
    src = Path(shutil.copytree(source, tmp_path / "src"))
    tensors = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({**tensors, "extra": _Payload(marker)}, src / "pytorch_model.bin")
    line = assert_refused(cli("convert", src, tmp_path / "out", "-n", "4", "--allow-pickle"),
                          "pytorch_model.bin", "more than tensors")
    assert "system" in line
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_corrupt_pickle_is_a_clear_error(tmp_path, source):
    src = Path(shutil.copytree(source, tmp_path / "src"))
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    assert_refused(cli("convert", src, tmp_path / "out", "-n", "4", "--allow-pickle"),
                   "pytorch_model.bin could not be read", "re-download")


def test_allow_nonfinite_converts_and_warns(tmp_path, src):
    _nan(float("nan"))(src, tmp_path)
    result = cli("convert", src, tmp_path / "out", "-n", "4", "--allow-nonfinite")
    assert result.exit_code == 0, result.stderr
    assert "warning:" in result.stderr and LAYER_TENSOR in result.stderr
    verify = cli("verify", tmp_path / "out")
    assert verify.exit_code == 2 and "NaN/Inf" in verify.stderr  # and verify still reports it


def test_hf_cache_snapshot_links_are_accepted(tmp_path, source):
    """The hub cache keeps files in blobs/ and links them from snapshots/<rev>/: not an escape."""
    root = tmp_path / "models--org--tiny"
    snap, blobs = root / "snapshots" / "abc123", root / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in source.iterdir():
        blob = blobs / hashlib.sha256(f.name.encode()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    result = cli("convert", snap, tmp_path / "out", "-n", "4")
    assert result.exit_code == 0, result.stderr


# ------------------------------------------------------------------------------------------- determinism


def test_same_inputs_same_bytes(tmp_path, sharded_source):
    args = ["-n", "4", "-k", "2", "--method", "gate-cluster", "--seed", "7", "--max-shard-size", "50KB"]
    for name in ("a", "b"):
        assert cli("convert", sharded_source, tmp_path / name, *args).exit_code == 0
    a, b = _shards(tmp_path / "a"), _shards(tmp_path / "b")
    assert len(a) > 2 and a == b
    for meta in ("config.json", "model.safetensors.index.json", "moeify.toml"):
        assert (tmp_path / "a" / meta).read_bytes() == (tmp_path / "b" / meta).read_bytes()
    assert cli("convert", sharded_source, tmp_path / "c", *args[:-4], "--seed", "8", "--max-shard-size",
               "50KB").exit_code == 0
    assert _shards(tmp_path / "c") != a


def test_same_bytes_with_any_thread_count(tmp_path):
    """Clustering sums in float: the result must not depend on how many threads torch uses."""
    src = build_dense(tmp_path / "dense", intermediate_size=512)
    threads = torch.get_num_threads()
    try:
        hashes = []
        for n in (1, 2):
            torch.set_num_threads(n)
            assert cli("convert", src, tmp_path / f"t{n}", "-n", "8", "-k", "2").exit_code == 0
            hashes.append(_shards(tmp_path / f"t{n}"))
    finally:
        torch.set_num_threads(threads)
    assert hashes[0] == hashes[1]

