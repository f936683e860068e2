"""The run plans scripts/device_check.sh carries to the GPU machine, checked here before a device
call is spent on them: each step's mode is one the script knows, its limit fits one device
command, its tests exist, its suite command line parses and names gates and presets that exist,
and its probe script takes its arguments. The later calls a plan lists in its comments are
checked alike."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

import gates
from cli import app
from scriptload import SCRIPTS, load_script

ROOT = SCRIPTS.parent
PLANS = sorted(SCRIPTS.glob("*.plan"))
COMMAND_LIMIT_S = 600  # the device tool's limit on one command
# a later call in a comment: "#   suite bench ...   (why)", or a step for another host: "# 420 suite run --gpus 2"
LATER = re.compile(r"^#\s+(?:\d+\s+)?((?:suite|python|tests) .*?)(?:\s{3,}\(.*)?$")


def steps(plan: Path) -> list[tuple[int | None, str, list[str]]]:
    """(limit or None for a later call, mode, arguments) of each step and each later call."""
    found = []
    for line in plan.read_text().splitlines():
        later = LATER.match(line)
        if later:
            mode, *args = shlex.split(later.group(1))
            found.append((None, mode, args))
        elif line.strip() and not line.startswith("#"):
            limit, mode, *args = shlex.split(line)  # as device_check.sh splits it
            found.append((int(limit), mode, args))
    return found


def check_suite(args: list[str]) -> None:
    """The command line parses as the CLI would take it; its gate and presets exist."""
    group = typer.main.get_command(app)
    context = group.make_context("suite", list(args))
    name, command, rest = group.resolve_command(context, list(args))
    params = command.make_context(name, rest, parent=context).params
    if params.get("name") is not None:
        for gate in gates.select(params["name"]):
            for preset in params.get("preset") or ():
                gate.preset(preset)
    elif params.get("preset"):
        known = {p.name for gate in gates.select("all") for p in gate.presets}
        assert set(params["preset"]) <= known, params["preset"]


def check_python(args: list[str]) -> None:
    script, *rest = args
    path = ROOT / script
    assert path.is_file(), script
    module = load_script(path.stem)
    if hasattr(module, "parse_args"):
        module.parse_args(rest)


def check_tests(args: list[str]) -> None:
    for arg in args:
        if not arg.startswith("-"):
            assert (ROOT / arg.split("::")[0]).exists(), arg


CHECKS = {"suite": check_suite, "python": check_python, "tests": check_tests}


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_step_of_a_plan_runs_as_written(plan):
    found = steps(plan)
    assert found, f"{plan.name} has no step"
    for limit, mode, args in found:
        assert limit is None or 0 < limit <= COMMAND_LIMIT_S, (limit, mode, args)
        assert mode in CHECKS, f"{plan.name}: device_check.sh has no mode {mode!r}"
        CHECKS[mode](args)


def test_a_typo_in_a_step_is_caught(tmp_path):
    """The checks' teeth: a misspelt preset, option, script argument and test path."""
    with pytest.raises(Exception, match="olmo"):
        check_suite(["bench", "moe-bwd", "--preset", "olmo"])
    with pytest.raises(Exception, match="--presett"):
        check_suite(["bench", "moe-bwd", "--presett", "olmoe"])
    with pytest.raises(SystemExit):
        check_python(["scripts/moe_peer_profile.py", "--case", "blok"])
    with pytest.raises(AssertionError):
        check_tests(["tests/arms/moe/test_nothing.py"])
    plan = tmp_path / "x.plan"
    plan.write_text("700 suite run\n#   suite bench moe-bwd --preset olmoe   (a later call)\n"
                    "9 python s.py --contender 'block suite compiled'\n")
    assert steps(plan) == [(700, "suite", ["run"]), (None, "suite", ["bench", "moe-bwd", "--preset", "olmoe"]),
                           (9, "python", ["s.py", "--contender", "block suite compiled"])]
