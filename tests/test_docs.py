"""The words are part of the product: every relative link and anchor in README.md, BENCHMARKS.md and docs/ resolves,
every program a page names exists, and the command-line reference is the CLI's own --help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"(?<![\w/.-])(scripts/[\w.-]+\.(?:py|sh))")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        text = re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")
        n = seen.get(text, 0)
        seen[text] = n + 1
        out.add(text if n == 0 else f"{text}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are not links
    return [a or b for a, b in LINK.findall(text)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked here (no network in CI)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# A `code` heading: here\n## Again\n## Again\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-heading-here) [ok2](other.md#again-1) [gone](nothere.md) "
                    "[bad](other.md#nope) [web](https://example.org/x) ![img](other.md)\n```\n[in code](x.md)\n```\n")
    assert broken_links(page) == ["nothere.md: no such file", "other.md#nope: no heading with that anchor in other.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_program_a_page_names_exists(page):
    missing = sorted({s for s in SCRIPT.findall(page.read_text()) if not (ROOT / s).is_file()})
    assert not missing, f"{page.name} names programs that do not exist: {missing}"


def test_the_cli_reference_is_the_clis_own_help():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py"), "--check",
                          str(ROOT / "docs" / "cli.md")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_the_packaged_granularity_measurements_are_the_result_files():
    """moeify/data/granularity.json (what `plan` prints under its --serve table) and BENCHMARKS.md's granularity and
    trade-off tables are what scripts/granularity_table.py computes from results/granularity/ and results/quality/."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "granularity_table.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_the_anchor_rule_is_githubs():
    page = ROOT / "docs" / "cli.md"
    assert "moeify-convert" in anchors(page) and "command-line-reference" in anchors(page)
