"""The installed package as users get it: the wheel built from this checkout, installed into a fresh virtual environment
outside the checkout, run from another folder (no configs/, no examples/ beside it). Its dependencies are the test
environment's own, seen through a .pth line rather than installed again (`make install` installs the same list from
the index), and `pip check` holds the wheel's declared requirements to them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list, cwd: Path, timeout: int = 600) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_the_wheel_installs_converts_by_preset_name_and_its_output_loads_with_a_card(tmp_path):
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", ROOT, "-w", dist], tmp_path)
    wheel = next(dist.glob("moeify-*.whl"))
    run([sys.executable, "-m", "venv", venv], tmp_path)
    py = venv / "bin" / "python"
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]  # torch, transformers, ... of this environment
    (Path(site) / "moeify-test-deps.pth").write_text("\n".join(deps) + "\n")  # after the venv's own site-packages
    run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp_path)
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True).stdout  # (the venv's own
    assert not [ln for ln in check.splitlines() if ln.startswith("moeify ")], check  # old setuptools may be listed)
    work.mkdir()
    shutil.copytree(ROOT / "examples" / "tiny-llama", work / "tiny")
    version = run([venv / "bin" / "moeify", "--version"], work)
    assert version.startswith("moeify ") and run([py, "-c", "import moeify; print(moeify.__file__)"], work).startswith(
        str(venv))  # the installed package, not this checkout
    run([venv / "bin" / "moeify", "convert", "tiny", "out", "--preset", "active-50", "--no-tune",
         "--calib-tokens", "1024"], work)
    plan = " ".join(run([venv / "bin" / "moeify", "plan", "tiny", "--preset", "active-25"], work).split())
    assert "measured on real models" in plan and "SmolLM2-135M" in plan  # moeify/data/granularity.json, packaged
    check = run([py, "-c", """
import json, moeify
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("out")
card = ModelCard.load("out/README.md")
result = moeify.convert("tiny", "api-out", preset="active-25", tune=False, calib_tokens=1024)
print(json.dumps({"class": type(model).__name__, "library": card.data.library_name, "tags": card.data.tags,
                  "routed": "| routed experts |" in card.text, "api": result.report["settings"]["shared"]}))
"""], work)
    got = __import__("json").loads(check.strip().splitlines()[-1])
    assert got["class"] == "Qwen2MoeForCausalLM" and got["library"] == "transformers" and got["routed"]
    assert "mixture-of-experts" in got["tags"] and got["api"] > 0  # the 25% preset's shared expert, by name
