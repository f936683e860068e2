"""The hand-written docs stay guides: each arm's page in the same four sections, and no run ids
or commit hashes anywhere in them (provenance lives on the generated results pages and in
git), and every link they give resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAND_WRITTEN = sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.relative_to(ROOT / "docs").parts)
ARM_PAGES = sorted((ROOT / "docs" / "arms").glob("*.md"))
SECTIONS = ["## What it does", "## How", "## Why this way", "## Limits"]
RUN_ID = re.compile(r"\d{8}T\d{6}Z")
# 7 to 40 hex digits with at least one letter and one digit: how a commit is named
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_gate_has_an_arm_page():
    from gates import names

    titled = {m for p in ARM_PAGES for m in re.findall(r"^# .*\(gate `([^`]+)`\)$", p.read_text(), re.M)}
    assert titled == set(names()) - {"train-step"}  # train-step benches the others inside a model


@pytest.mark.parametrize("page", ARM_PAGES, ids=_name)
def test_an_arm_page_has_the_four_sections_in_order(page):
    headings = [line for line in page.read_text().splitlines() if line.startswith("## ")]
    assert headings == SECTIONS, f"{_name(page)} has sections {headings}; write them as {SECTIONS}"


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=_name)
def test_a_hand_written_page_names_no_run_and_no_commit(page):
    text = page.read_text()
    assert not RUN_ID.findall(text), f"{_name(page)} names runs; their figures belong on the results pages"
    assert not COMMIT.findall(text), f"{_name(page)} names commits {COMMIT.findall(text)}; provenance is git's"


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=_name)
def test_every_link_of_a_hand_written_page_resolves(page):
    for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{_name(page)} links {target}"
