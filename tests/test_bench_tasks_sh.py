"""scripts/bench_tasks.sh, the task-retention driver, run with stand-ins for moeify and Python that log their
command lines: what each step carves, tunes and scores, in which order, and that it refuses an unknown step before
any work. (The measurements themselves take hours; what they run is checked here.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MOEIFY = """#!/bin/bash
echo "moeify $*" >> "$LOG"
case $1 in
  convert) mkdir -p "$3"; echo '{}' > "$3/report.json" ;;
  tune) n=0; args=("$@")
    for i in "${!args[@]}"; do [ "${args[$i]}" = --tokens ] && n=${args[$((i+1))]}; done
    prev=$("$REAL_PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("tuning",{}).get("tokens",0))' \\
      "$3/report.json")
    echo "{\\"tuning\\": {\\"tokens\\": $((prev + n))}}" > "$3/report.json" ;;
esac
"""
PYTHON = """#!/bin/bash
[ "$1" = -c ] && exec "$REAL_PYTHON" "$@"
echo "python $*" >> "$LOG"
[ "$1" = scripts/chat_text.py ] && touch "$3"
exit 0
"""


@pytest.fixture()
def stub(tmp_path):
    """A checkout holding the script and the presets, with .venv/bin/{moeify,python} logging instead of working."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bench_tasks.sh", tmp_path / "scripts")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for name, text in (("moeify", MOEIFY), ("python", PYTHON)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    return tmp_path


def run(stub: Path, *steps: str, **env: str) -> tuple[int, list[str], str]:
    log = stub / "log"
    log.write_text("")
    env = {**os.environ, "LOG": str(log), "REAL_PYTHON": sys.executable, **env}
    done = subprocess.run(["bash", str(stub / "scripts" / "bench_tasks.sh"), *steps], env=env, capture_output=True,
                          text=True, timeout=60)
    return done.returncode, log.read_text().splitlines(), done.stderr


SCORE = "--task-data ../shared/tasks --limit 1000 --dtype bfloat16 --max-tokens 4096"


def test_a_lever_tune_on_the_05b_beside_its_carve_alone(stub):
    """PLAIN=0: the carve, the lever's tune, then dense and the tune scored (the file written), then the carve added;
    ONLY restricts the tasks; a second run finds everything done and only scores (the answers are cached there)."""
    code, log, err = run(stub, "qwen05-spread-262k-hidden", PLAIN="0", ONLY="arc_easy,piqa")
    assert code == 0, err
    src, out = "models/qwen2.5-coder-0.5b", "results/quality/tasks-qwen05-spread-262k-hidden-vs-carve-1000.json"
    assert log == [
        f"moeify convert {src} out/qwen05-a50-spread --preset configs/active-50.toml --no-tune --overwrite",
        f"moeify tune {src} out/qwen05-a50-spread-262k-hidden --tokens 262144 --hidden-weight 16",
        f"python scripts/bench_tasks.py {src} out/qwen05-a50-spread-262k-hidden {SCORE} --tasks arc_easy,piqa "
        f"--out {out}",
        f"python scripts/bench_tasks.py {src} out/qwen05-a50-spread out/qwen05-a50-spread-262k-hidden {SCORE} "
        f"--tasks arc_easy,piqa --out {out}",
    ]
    code, again, _ = run(stub, "qwen05-spread-262k-hidden", PLAIN="0", ONLY="arc_easy,piqa")
    assert code == 0 and again == log[2:]


def test_the_plain_tune_is_paired_in_and_continuations_add_their_tokens(stub):
    """Without PLAIN=0 a lever's tune is scored beside the plain tune; smollm2-spread-1m tunes 262k, 262k more, then
    524k more, each from the last (float32 result files named so)."""
    code, log, err = run(stub, "smollm2-spread-262k-routers", "smollm2-spread-1m", DTYPE="float32")
    assert code == 0, err
    tunes = [line.split()[3:] for line in log if line.startswith("moeify tune")]
    assert tunes == [["out/smollm2-a50-spread-262k", "--tokens", "262144"],
                     ["out/smollm2-a50-spread-262k-routers", "--tokens", "262144", "--router-only"],
                     ["out/smollm2-a50-spread-524k", "--tokens", "262144"],
                     ["out/smollm2-a50-spread-1m", "--tokens", "524288"]]
    scores = [line for line in log if "bench_tasks.py" in line]
    assert scores[0].split(" --task-data")[0].endswith(
        "out/smollm2-a50-spread out/smollm2-a50-spread-262k out/smollm2-a50-spread-262k-routers")
    assert scores[1].endswith("--out results/quality/tasks-smollm2-spread-1m-1000-float32.json")
    assert "--dtype float32" in scores[1] and "--tasks" not in scores[1]


@pytest.mark.parametrize("step", ["qwen05-spread-262k-bogus", "smollm2-nothing"])
def test_an_unknown_step_is_refused_before_any_work(stub, step):
    code, log, err = run(stub, step)
    assert code == 2 and log == []
    assert f"unknown step {step}" in err


def test_the_shipped_tune_is_scored_beside_its_carve_in_a_folder_of_its_own(stub):
    """-bundled: the preset's tune as it ships (its tune_text the bundled prose, named by the step, so that a carve
    made before the presets named it tunes on it too), beside the carve alone, never in the folder a plain -262k tune
    of the earlier mix may hold."""
    code, log, err = run(stub, "smollm2-spread-262k-bundled", ONLY="arc_easy,piqa")
    assert code == 0, err
    src = "models/smollm2-135m"
    assert log == [
        f"moeify convert {src} out/smollm2-a50-spread --preset configs/active-50.toml --no-tune --overwrite",
        f"moeify tune {src} out/smollm2-a50-spread-262k-bundled --tokens 262144 --tune-text bundled:tune_prose.txt",
        f"python scripts/bench_tasks.py {src} out/smollm2-a50-spread out/smollm2-a50-spread-262k-bundled {SCORE} "
        "--tasks arc_easy,piqa --out results/quality/tasks-smollm2-spread-262k-bundled-1000.json"]
    assert 'tune_text = ["bundled:tune_prose.txt"]' in (stub / "configs" / "active-50.toml").read_text()


def test_the_shipped_tune_continues_on_the_prose_to_524k(stub):
    """-524k-bundled: the -bundled tune, then 262,144 tokens more from it on the same prose, scored beside the carve
    and the shorter tune; a second run finds both tunes done and only scores."""
    code, log, err = run(stub, "qwen05-spread-524k-bundled", ONLY="arc_easy,piqa")
    assert code == 0, err
    src, o = "models/qwen2.5-coder-0.5b", "out/qwen05-a50-spread"
    assert log == [
        f"moeify convert {src} {o} --preset configs/active-50.toml --no-tune --overwrite",
        f"moeify tune {src} {o}-262k-bundled --tokens 262144 --tune-text bundled:tune_prose.txt",
        f"moeify tune {src} {o}-524k-bundled --tokens 262144 --tune-text bundled:tune_prose.txt",
        f"python scripts/bench_tasks.py {src} {o} {o}-262k-bundled {o}-524k-bundled {SCORE} --tasks arc_easy,piqa "
        "--out results/quality/tasks-qwen05-spread-524k-bundled-1000.json"]
    code, again, _ = run(stub, "qwen05-spread-524k-bundled", ONLY="arc_easy,piqa")
    assert code == 0 and again == log[3:]


def test_the_shipped_tune_goes_on_to_1m_on_smollm2(stub):
    """smollm2-spread-1m-bundled: 262k, 262k more, then 524k more, each from the last on the prose, all four scored."""
    code, log, err = run(stub, "smollm2-spread-1m-bundled")
    assert code == 0, err
    o = "out/smollm2-a50-spread"
    tunes = [line.split()[3:6] for line in log if line.startswith("moeify tune")]
    assert tunes == [[f"{o}-262k-bundled", "--tokens", "262144"], [f"{o}-524k-bundled", "--tokens", "262144"],
                     [f"{o}-1m-bundled", "--tokens", "524288"]]
    assert log[-1].startswith(f"python scripts/bench_tasks.py models/smollm2-135m {o} {o}-262k-bundled "
                              f"{o}-524k-bundled {o}-1m-bundled {SCORE} --out ")


@pytest.mark.parametrize("lever, carved, flags", [
    ("contribution", "spread-contribution", "--preset out/levers/active-50-shared_by-contribution.toml"),
    ("dense-layers", "spread-dense2",
     "--preset out/levers/active-50-dense_layers-auto2-top7.toml --no-tune --overwrite "
     "--dense-layers auto:2 --top-k 7"),
    ("chat-spread", "chat-spread", "--calib out/levers/chat-spread-qwen2.5-coder-0.5b.txt")])
def test_a_lever_tuned_as_the_preset_ships_beside_the_shipped_tune(stub, lever, carved, flags):
    """MODEL-LEVER-262k-bundled: the shipped tune, the lever's carve (its own preset file, or the preset with its own
    calibration text), that carve tuned as the preset ships, and the two tunes scored, the shipped one first (retention
    pairs the lever's tune against it)."""
    code, log, err = run(stub, f"qwen05-{lever}-262k-bundled", ONLY="arc_easy,piqa")
    assert code == 0, err
    src, o, c = "models/qwen2.5-coder-0.5b", "out/qwen05-a50-spread", f"out/qwen05-a50-{carved}"
    prose = "--tune-text bundled:tune_prose.txt"
    converts = [line for line in log if line.startswith("moeify convert")]
    assert converts[0] == f"moeify convert {src} {o} --preset configs/active-50.toml --no-tune --overwrite"
    assert converts[1].startswith(f"moeify convert {src} {c} ") and flags in converts[1]
    assert [line for line in log if line.startswith("moeify tune")] == [
        f"moeify tune {src} {o}-262k-bundled --tokens 262144 {prose}",
        f"moeify tune {src} {c}-262k-bundled --tokens 262144 {prose}"]
    assert log[-1] == (f"python scripts/bench_tasks.py {src} {o}-262k-bundled {c}-262k-bundled {SCORE} "
                       f"--tasks arc_easy,piqa --out results/quality/tasks-qwen05-{lever}-262k-bundled-1000.json")
    if lever == "dense-layers":
        assert 'targets = ["transformers", "vllm"]' in (stub / "out/levers/active-50-dense_layers-auto2-top7.toml"
                                                        ).read_text()


def test_the_training_free_dense_layers_and_chat_spread_steps_use_the_shared_helpers(stub):
    """smollm2-dense-layers: top-10 with 2 layers dense from its own preset file; smollm2-chat-spread: the calibration
    text from 12,800 tokens of the sample and the model's conversations, written before the carve that reads it."""
    code, log, err = run(stub, "smollm2-dense-layers", "smollm2-chat-spread")
    assert code == 0, err
    assert ("moeify convert models/smollm2-135m out/smollm2-a50-dense2 --preset "
            "out/levers/active-50-dense_layers-auto2-top10.toml --no-tune --overwrite --dense-layers auto:2 --top-k 10"
            ) in log
    texts = [i for i, line in enumerate(log) if line.startswith("python scripts/chat_text.py")]
    assert "--prefix-tokens 12800 --spread --control out/levers/conversations-smollm2-135m.txt" in log[texts[-1]]
    carve = log.index("moeify convert models/smollm2-135m out/smollm2-a50-chat-spread --preset configs/active-50.toml "
                      "--no-tune --overwrite --calib out/levers/chat-spread-smollm2-135m.txt")
    assert carve > texts[-1]
