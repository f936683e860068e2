"""`suite baseline show`: the saved figures rendered as pages, and docs/results kept current (a
page that differs from what its baseline renders fails here, so CI fails)."""

from __future__ import annotations

import statistics
from pathlib import Path

from typer.testing import CliRunner

from cli import app
from suite.errors import ExitCode
from suite.harness.baseline import load_baseline
from suite.harness.render import baseline_pages

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_the_committed_result_pages_are_what_the_baselines_render():
    pages = baseline_pages(ROOT / "baselines")
    committed = {str(p.relative_to(ROOT / "docs/results")): p.read_text(encoding="utf-8")
                 for p in (ROOT / "docs/results").rglob("*.md")}
    stale = sorted(page for page in pages.keys() | committed.keys() if pages.get(page) != committed.get(page))
    assert not stale, f"docs/results is stale for {stale}: run `suite baseline show --write docs/results`"


def test_a_figure_is_the_median_of_the_saved_runs():
    baseline = load_baseline(ROOT / "baselines/nvidia-h200/rmsnorm.json")
    entries = [e for e in baseline.entries
               if (e.preset, e.case, e.mode, e.contender) == ("4096x2048", "fwd", "graph", "arm")]
    assert len(entries) >= 2
    page = baseline_pages(ROOT / "baselines", ["rmsnorm"])["nvidia-h200/rmsnorm.md"]
    section = page.split("\n## 4096x2048\n")[1].split("\n## ")[0].split("\n### fwd\n")[1].split("\n### ")[0]
    arm_row = next(line for line in section.splitlines() if line.startswith("| arm "))
    assert f"{statistics.median(e.median_ms for e in entries):.4f}" in arm_row
    assert f"| {len(entries)} " in arm_row


def test_show_prints_write_writes_and_removes_stale_pages(tmp_path):
    shown = invoke("baseline", "show", "split-muon", "--baselines", ROOT / "baselines")
    # one page per class of machine that saved the gate, each headed by its card
    assert shown.exit_code == 0 and shown.output.startswith("# split-muon on NVIDIA ")
    assert "\n# split-muon on NVIDIA H200" in shown.output or shown.output.startswith("# split-muon on NVIDIA H200")
    stale = tmp_path / "nvidia-h200" / "gone.md"  # a page of a baseline since removed
    stale.parent.mkdir(parents=True)
    stale.write_text((ROOT / "docs/results/nvidia-h200/rmsnorm.md").read_text())
    notes = tmp_path / "nvidia-h200" / "notes.md"  # not a page of ours: never touched
    notes.write_text("old")
    written = invoke("baseline", "show", "--baselines", ROOT / "baselines", "--write", tmp_path)
    assert written.exit_code == 0, written.output
    assert not stale.exists() and notes.read_text() == "old"
    assert (tmp_path / "nvidia-h200" / "moe-bwd.md").read_text() == (ROOT / "docs/results/nvidia-h200/moe-bwd.md").read_text()
    assert "[nvidia-h200/rmsnorm](nvidia-h200/rmsnorm.md)" in (tmp_path / "README.md").read_text()


def test_write_into_a_directory_of_other_markdown_is_refused_and_deletes_nothing(tmp_path):
    """`--write docs` for `--write docs/results`: docs/README.md would have been replaced by the
    index and docs/arms/*.md deleted as stale pages."""
    docs = {"README.md": "# the project's docs\n", "arms/moe.md": "# MoE\n", "arms/rmsnorm.md": "# RMSNorm\n"}
    for name, text in docs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    result = invoke("baseline", "show", "--baselines", ROOT / "baselines", "--write", tmp_path)
    assert result.exit_code == ExitCode.USAGE
    assert f"{tmp_path / 'README.md'} is not a page `suite baseline show` wrote" in " ".join(result.output.split())
    assert {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*.md")} == docs
    (tmp_path / "README.md").unlink()  # with the index's name free: the pages beside the other files
    assert invoke("baseline", "show", "--baselines", ROOT / "baselines", "--write", tmp_path).exit_code == 0
    assert (tmp_path / "arms/moe.md").read_text() == "# MoE\n" and (tmp_path / "nvidia-h200/rmsnorm.md").is_file()


def test_bad_input_is_one_line(tmp_path):
    for args, says in (
        (("baseline", "show", "no-such-gate", "--baselines", ROOT / "baselines"), "no baseline under"),
        (("baseline", "show", "--baselines", tmp_path / "missing"), "is not a directory"),
        (("baseline", "show", "rmsnorm", "--baselines", ROOT / "baselines", "--write", tmp_path), "drop the gate names"),
    ):
        result = invoke(*args)
        assert result.exit_code == ExitCode.USAGE and says in result.output, result.output


def test_a_train_step_page_gives_each_contenders_setup_and_advice():
    baseline = load_baseline(ROOT / "baselines/nvidia-h200/train-step.json")
    advised = [e for e in baseline.entries if e.recommendation is not None]
    assert advised and all(e.setup_s is not None for e in baseline.entries)
    page = baseline_pages(ROOT / "baselines", ["train-step"])["nvidia-h200/train-step.md"]
    assert "setup s (compile, capture)" in page
    entry = advised[0]
    rec = entry.recommendation
    row = next(line for line in page.split(f"\n## {entry.preset}\n")[1].split(f"\n### {entry.case}\n")[1].splitlines()
               if line.startswith(f"| {entry.contender} "))
    assert f"{rec.speedup:.3f}x [{rec.ci_low:.3f}, {rec.ci_high:.3f}] over {rec.against}: {rec.advice}" in row
