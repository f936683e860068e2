"""The README stays a guide a newcomer reads in ten minutes: within its size and run-id budget,
the two commands on its first screen (the test one exactly what CI runs), and every link it
gives to a file of the repository resolving. Figures live in docs/results, rendered."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 350
MAX_RUN_IDS = 1
FIRST_SCREEN = 40  # lines
RUN_ID = re.compile(r"\d{8}T\d{6}Z")


def test_the_readme_keeps_within_its_size_and_run_id_budget():
    lines = README.count("\n")
    assert lines <= MAX_LINES, f"README.md is {lines} lines; move detail into docs/ (at most {MAX_LINES})"
    run_ids = RUN_ID.findall(README)
    assert len(run_ids) <= MAX_RUN_IDS, f"README.md names runs {run_ids}; figures belong in docs/results"


def test_the_first_screen_gives_both_commands_and_ci_runs_the_test_one():
    commands = re.findall(r"```bash\n(.+?)\n```", README)
    main_job, tests = commands[0], commands[1]
    first_screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    assert main_job in first_screen and tests in first_screen
    assert main_job.endswith("&& suite run") and tests.endswith("python -m pytest -q -n 2")
    # .ci/run installs what the README's test command installs, then runs exactly its test step
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    *installs, run = tests.split(" && ")
    assert ci[-1] == run
    for pin in re.findall(r"pip install (.+)$", "\n".join(installs), re.M):
        assert any(pin in line for line in ci), pin


def test_every_link_to_a_repository_file_resolves():
    for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
