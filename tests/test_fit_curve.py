"""scripts/fit_tuning_curve.py: the power-law fit of quality against tuning tokens and what it says the bars need."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from fit_tuning_curve import fit, fit_asymptote  # noqa: E402


def test_fit_recovers_a_power_law_and_the_tokens_a_bar_needs(tmp_path):
    c, b = 40.0, 0.25
    line = [(t, 1 + c * t ** -b) for t in (2 ** 17, 2 ** 18, 2 ** 20)]
    fc, fb = fit(line)
    assert fc == pytest.approx(c, rel=1e-9) and fb == pytest.approx(b, rel=1e-9)

    points = [{"preset": "active-50", "tokens": t, "schedule": "single", "machine": "m", "layout": "resolved",
               "ratio": {"wikitext2": r}} for t, r in line]
    points.append({"preset": "active-25", "tokens": 2 ** 18, "schedule": "single", "machine": "m",
                   "layout": "resolved", "ratio": {"wikitext2": 2.0}})  # one point: no line to fit
    f = tmp_path / "points.json"
    f.write_text(json.dumps({"points": points}))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "fit_tuning_curve.py"), str(f), "--layout",
                          "resolved"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rows = [r.split() for r in res.stdout.splitlines()[1:]]
    assert len(rows) == 1 and rows[0][:3] == ["active-50", "wikitext2", "3"]
    assert float(rows[0][3]) == pytest.approx(b, abs=1e-3)
    assert float(rows[0][4]) == pytest.approx(1 + c * 2 ** (-20 * b), abs=1e-3)  # predicted at 1M
    need = (c / (1.25 - 1)) ** (1 / b)  # the 1.25 bar
    assert int(rows[0][6].replace(",", "")) == pytest.approx(need, rel=1e-6)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "fit_tuning_curve.py"), str(f)],
                         capture_output=True, text=True)  # the default layout (fixed): none of these points
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 1


def test_fit_asymptote_recovers_a_floor_and_keeps_it_at_or_above_dense():
    r_inf, c, b = 1.30, 0.9, 0.3
    pts = [(t, r_inf + c * t ** -b) for t in (2 ** 20, 2 ** 22, 2 ** 24, 2 ** 25)]
    f = fit_asymptote(pts)
    assert f["r_inf"] == pytest.approx(r_inf, abs=1e-3) and f["b"] == pytest.approx(b, abs=0.011)
    assert f["at"][str(64 << 20)] == pytest.approx(r_inf + c * (64 << 20) ** -b, abs=2e-3)
    # three points whose exact floor would be 0.675, below the dense model: the floor is held at 1
    g = fit_asymptote([(2 ** 18, 1.9), (2 ** 20, 1.55), (2 ** 22, 1.30)])
    assert g["r_inf"] == 1.0 and g["c"] > 0 and g["rms"] < 0.05
    with pytest.raises(ValueError, match="at least 3"):
        fit_asymptote(pts[:2])
