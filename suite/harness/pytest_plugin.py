"""The suite's gates as pytest items: `pytest --suite` (registered as a pytest11 entry point,
idle without --suite), and spread over the GPUs of one host by pytest-xdist: `pytest --suite -n N`
or `suite run --gpus N`.

Each gate x preset is a collector (suite::moe-bwd[tiny]) whose items are its steps: `gate`
(buffers, reference, parity, saboteurs), one a bench case x mode (`fwd+bwd graph`), and, where
it benches, `recheck` (the determinism run after timing). A unit's items share its buffers, so
they run in order on one worker (xdist's `--dist loadscope`, set here, keeps a collector's
items together). Each worker owns one GPU: worker gwK takes the K-th visible
device, pinned through CUDA_VISIBLE_DEVICES before CUDA initialises, so no two timing items
share a GPU. An item passes, fails or skips as the gate's verdict says: a unit that could not
run fails with its one-line reason, timing that stayed ambiguous is an xfail, never a pass.
The controller merges every unit's result into one run report (report.json, report.md,
junit.xml, benchmark.json), each result with its worker's fingerprint.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # torch and the harness load only for a --suite run
    from suite.harness.results import RunReport
    from suite.harness.runner import Runner, Unit, UnitRun

# the merged report, once the session finishes (for `suite run --gpus`, which reads it back)
REPORT: pytest.StashKey[RunReport] = pytest.StashKey()
REPORT_PATH: pytest.StashKey[str] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("suite", "the suite's gates as pytest items")
    group.addoption("--suite", action="store_true", help="collect the suite's gates (and benches) as the items")
    group.addoption("--suite-gate", action="append", metavar="NAME",
                    help="a gate to run (repeatable; default: every gate, as `suite run`)")
    group.addoption("--suite-preset", action="append", metavar="NAME", help="a preset to run (repeatable)")
    group.addoption("--suite-bench", action="store_true", help="time the benches too, as `suite run` does")
    group.addoption("--suite-no-sabotage", action="store_true", help="skip the saboteurs")
    group.addoption("--suite-thorough", action="store_true", help="every saboteur at every preset")
    group.addoption("--suite-strict", action="store_true", help="gates and benches this device cannot run count "
                    "as could-not-run")
    group.addoption("--suite-seed", type=_seed, default=0, help="the buffers' seed (0 to 2^64-1)")
    group.addoption("--suite-device", default="auto", choices=("auto", "cuda", "cpu"))
    group.addoption("--suite-profile", default=None, choices=("auto", "rtx", "none"),
                    help="as suite's --profile (default: SUITE_PROFILE, else auto)")
    group.addoption("--suite-reports", default="reports", metavar="DIR", help="where the merged report goes")


def _seed(text: str) -> int:
    """--suite-seed takes what suite's --seed takes."""
    value = int(text) if text.strip().isdigit() else -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to 2^64-1, not {text!r}")
    return value


def _suite_options_given(config: pytest.Config) -> list[str]:
    """The --suite-* options set away from their defaults."""
    defaults = {"suite_seed": 0, "suite_device": "auto", "suite_reports": "reports"}
    return [f"--{name.replace('_', '-')}" for name in ("suite_gate", "suite_preset", "suite_bench", "suite_no_sabotage",
                                                        "suite_thorough", "suite_strict", "suite_seed", "suite_device",
                                                        "suite_profile", "suite_reports")
            if getattr(config.option, name) not in (None, False, defaults.get(name))]


def _worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker.removeprefix("gw")) if worker.startswith("gw") else None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """A worker's GPU, before anything (a conftest, the device check) initialises CUDA."""
    index = _worker_index()
    if index is None or "--suite" not in args:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d.strip()] if visible else None
    if devices is not None and index >= len(devices):
        raise pytest.UsageError(f"xdist worker gw{index} has no GPU of its own: CUDA_VISIBLE_DEVICES={visible} "
                                f"names {len(devices)}; run at most that many workers (-n)")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[index] if devices is not None else str(index)
    os.environ["SUITE_PHYSICAL_DEVICE"] = os.environ["CUDA_VISIBLE_DEVICES"]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("suite"):
        given = _suite_options_given(config)
        if given:  # alone they would collect nothing of the suite, and say nothing
            raise pytest.UsageError(f"{', '.join(given)} given without --suite: add --suite to run the suite's gates "
                                    f"as pytest items")
        return
    if config.option.suite_gate:  # a gate named twice runs once
        config.option.suite_gate = list(dict.fromkeys(config.option.suite_gate))
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # a unit's items share its buffers: one worker runs them, in order. They are the items
        # of one collector, which is the scope xdist's loadscope keeps together
        if config.option.dist in ("no", "load"):
            config.option.dist = "loadscope"
        _check_workers(config.option.numprocesses, config.option.suite_device)
    from suite.errors import SuiteError
    from suite.harness.store import check_writable

    session = _Session(config)
    try:  # a gate, preset, device or report directory that is not there stops the run first
        session.plan()
        if not hasattr(config, "workerinput") and not config.option.collectonly:
            check_writable(config.option.suite_reports, "--suite-reports")  # now, not after the gates
    except SuiteError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.pluginmanager.register(session, "suite-session")




def _check_workers(workers: int, device: str) -> None:
    """Each worker owns a GPU: more workers than GPUs would time two items on one."""
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count()
    if count and workers > count:
        raise pytest.UsageError(f"-n {workers}: this host has {count} GPU(s) and each xdist worker owns one; "
                                f"run at most -n {count}")
    if not count and device == "cuda":
        raise pytest.UsageError("--suite-device cuda: this host has no CUDA GPU")


class _Session:
    """A --suite session in one process (a plugin object): the runner with its ceilings and
    host-time caches, the units in progress, and on the controller what the items carried back."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.runner: Runner | None = None
        self.planned: tuple[list[Unit], list[Any], list[Any]] | None = None
        self.runs: dict[str, UnitRun] = {}
        self.results: list[tuple[int, Any]] = []  # (collection order, GateResult)
        self.expected: set[str] = set()  # the units whose items are to run (after -k, on every worker)
        self.accounted: set[str] = set()  # the units whose result (or skip) came back
        self.failures: dict[str, str] = {}  # unit -> its first failed item's one line
        self.skipped: list[Any] = []
        self.ceilings: Any = None
        self.started = datetime.now(timezone.utc)
        self.clock = time.perf_counter()

    def setup(self) -> Runner:
        """The settings decided before any gate (and so Triton) is imported, as the CLI does."""
        if self.runner is None:
            from suite.harness.runner import RunOptions, Runner
            from suite.settings import configure

            opt = self.config.option
            settings = configure(opt.suite_device, opt.suite_profile)
            self.runner = Runner(RunOptions(
                device=settings.device, presets=opt.suite_preset, bench=opt.suite_bench,
                sabotage=not opt.suite_no_sabotage, thorough=opt.suite_thorough, seed=opt.suite_seed,
                strict=opt.suite_strict, explicit=bool(opt.suite_gate) and "all" not in opt.suite_gate,
                plan_memory=False))
        return self.runner

    def plan(self) -> tuple[list[Unit], list[Any], list[Any]]:
        """The run's units, skipped gates and refused ones. Every process plans alike (a preset
        too large for a GPU's free memory is found when its item runs, not here), as xdist
        requires, and the controller knows which units must report back."""
        if self.planned is None:
            runner = self.setup()  # before the gates import Triton
            import gates

            selected = [gate for name in self.config.option.suite_gate or ["all"] for gate in gates.select(name)]
            self.planned = runner.plan(list({gate.name: gate for gate in selected}.values()))  # each gate once
        return self.planned

    def pytest_ignore_collect(self, collection_path) -> bool:
        """Under --suite the gates are the items: no test file is collected beside them."""
        return True

    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        """The gates' items, collected as pytest collects any node (genitems), so its count and
        reports see them."""
        runner = self.setup()
        units, skipped, refused = self.plan()

        def unit_items(node: _Gates, unit: Unit) -> list[pytest.Item]:
            made = [_GateItem.from_parent(node, name="gate", unit=unit)]
            made += [_BenchItem.from_parent(node, name=f"{case.name} {mode}", unit=unit, case=case, mode=mode)
                     for case, mode in runner.bench_plan(unit)[0]]
            return made + ([_RecheckItem.from_parent(node, name="recheck", unit=unit)] if unit.bench else [])

        def suite_nodes(parent: _Gates) -> list[pytest.Node]:
            made: list[pytest.Node] = [_SkippedItem.from_parent(parent, name=s.gate, skipped=s) for s in skipped]
            made += [_RefusedItem.from_parent(parent, name=r.gate, result=r) for r in refused]
            return made + [_Gates.from_parent(parent, name=_unit_key(unit), make=functools.partial(unit_items, unit=unit))
                           for unit in units]

        items[:] = session.genitems(_Gates.from_parent(session, name="suite", nodeid="suite", make=suite_nodes))
        for order, item in enumerate(items):
            item.user_properties.append((_ORDER, order))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.expected.update(_units_of(item.nodeid for item in session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        """The controller's view of what a worker will run (it collects nothing itself)."""
        self.expected.update(_units_of(ids))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        """xdist's loadscope, except that a unit whose worker crashed is not run again."""
        from xdist.scheduler import LoadScopeScheduling

        class CrashedUnitsStay(LoadScopeScheduling):
            """loadscope puts a crashed worker's whole scope back in the queue, the item that
            crashed included, so a unit that ends its process (a device fault) would run again
            on each new worker until xdist's restart limit. Its scope is dropped instead: the
            crash is reported once, and the rest of the unit could not run without it."""

            def remove_node(self, node):
                workload = self.assigned_work.get(node, {})
                crashed = next((nodeid for scope in workload.values() for nodeid, done in scope.items() if not done),
                               None)
                if crashed is None:
                    return super().remove_node(node)
                self.assigned_work[node] = {name: scope for name, scope in workload.items() if crashed not in scope}
                super().remove_node(node)  # the rest of its work goes back in the queue
                return crashed

        return CrashedUnitsStay(config, log) if config.option.dist == "loadscope" else None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Keep what each item carried back (on the controller, from every worker)."""
        from suite.harness.results import Ceilings, GateResult, SkippedGate

        unit = _unit_of(report.nodeid)
        if report.failed and unit is not None:  # a crashed worker's item fails too, with no call report
            self.failures.setdefault(unit, (report.longreprtext.strip().splitlines() or ["failed"])[-1])
        if report.when != "call":  # an item's properties ride on each of its three reports
            return
        props = dict(report.user_properties)
        if unit is not None and (_RESULT in props or _SKIPPED in props):
            self.accounted.add(unit)
        if _RESULT in props:
            self.results.append((props[_ORDER], GateResult.model_validate_json(props[_RESULT])))
        if _SKIPPED in props:
            self.skipped.append(SkippedGate.model_validate_json(props[_SKIPPED]))
        if _CEILINGS in props and self.ceilings is None:
            self.ceilings = Ceilings.model_validate_json(props[_CEILINGS])

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The controller merges the units' results into one run report and writes it. A unit
        whose result never came back (its worker crashed, or pytest stopped first) could not run:
        a run report never passes what did not run. An interrupted run leaves no report, as
        `suite run` leaves none."""
        if hasattr(self.config, "workerinput") or self.config.option.collectonly:
            return
        if session.exitstatus == pytest.ExitCode.INTERRUPTED:
            return
        from suite.harness.store import save_report

        opt = self.config.option
        runner = self.setup()
        results = [result for _, result in sorted(self.results, key=lambda pair: pair[0])]
        for unit in self.plan()[0]:
            key = _unit_key(unit)
            if key in self.expected and key not in self.accounted:
                why = self.failures.get(key, "its last item did not run (stopped by -x, or deselected by -k?)")
                results.append(runner.could_not_run(unit.gate, unit.preset, f"no result came back: {why}"))
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if not results and not self.skipped:  # -k deselected every item: an empty report would read as a pass
            if reporter is not None:
                reporter.write_line("suite: no gate ran (every item was deselected), so no report was written",
                                    yellow=True)
            return
        report = runner.report(
            results, self.skipped, "run" if opt.suite_bench else "gate " + ",".join(opt.suite_gate or ["all"]),
            " ".join(["pytest", *self.config.invocation_params.args]), self.started,
            time.perf_counter() - self.clock, ceilings=self.ceilings)
        self.config.stash[REPORT] = report
        path, trouble = save_report(report, self.config.option.suite_reports, report.what)
        self.config.stash[REPORT_PATH] = str(path) if path is not None else None
        if reporter is not None:
            if trouble is not None:
                reporter.write_line(f"suite: {trouble}", yellow=True)
            reporter.write_line(f"suite: report {path or 'not written'} (the suite's exit code {report.exit_code})")


_ORDER, _RESULT, _SKIPPED, _CEILINGS = "suite-order", "suite-result", "suite-skipped", "suite-ceilings"


def _unit_key(unit: Unit) -> str:
    return f"{unit.gate.name}[{unit.preset.name}]"


def _unit_of(nodeid: str) -> str | None:
    """The unit of an item's node id (suite::moe-bwd[tiny]::gate), None for a gate-level item."""
    parts = nodeid.split("::")
    return parts[1] if len(parts) == 3 and parts[0] == "suite" else None


def _units_of(nodeids) -> set[str]:
    return {unit for unit in map(_unit_of, nodeids) if unit is not None}


class _Gates(pytest.Collector):
    """The suite (nodeid "suite"), and in it one collector a unit: suite::moe-bwd[tiny]::gate.
    `make(self)` gives its children (planned in _Session.pytest_collection_modifyitems)."""

    def __init__(self, *, make, **kwargs) -> None:
        super().__init__(**kwargs)
        self.make = make

    def collect(self):
        return self.make(self)


class _Verdict(Exception):
    """A gate's verdict that is not a pass, with its one-line reason."""


class _SuiteItem(pytest.Item):
    def __init__(self, *, unit: Unit | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.unit = unit

    @property
    def session_state(self) -> _Session:
        return self.config.pluginmanager.get_plugin("suite-session")

    def reportinfo(self):
        return "suite", None, self.name

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, _Verdict):
            return str(excinfo.value)  # the gate's one-line reason, not a traceback of the plugin
        return super().repr_failure(excinfo, style)

    def carry(self, result) -> None:
        """The unit's whole result, with this worker's fingerprint and device, to the controller."""
        from suite.device_profile import active_profile
        from suite.harness.fingerprint import fingerprint

        runner = self.session_state.setup()
        device = runner.options.device
        if result.fingerprint is None:
            result.fingerprint = fingerprint(device, active_profile(device))
            # a worker sees its GPU as device 0: the host's index is the one it was pinned to
            physical = os.environ.get("SUITE_PHYSICAL_DEVICE", str(device.index or 0))
            result.fingerprint.device = f"cuda:{physical}" if device.type == "cuda" else device.type
        self.user_properties.append((_RESULT, result.model_dump_json()))
        if runner.ceilings is not None:
            self.user_properties.append((_CEILINGS, runner.ceilings.model_dump_json()))

    @staticmethod
    def judge(status: str, reason: str | None) -> None:
        if status == "could_not_run":
            raise _Verdict(f"could not run: {reason}")
        if status == "failed":
            raise _Verdict(f"failed: {reason}")
        if status == "ambiguous":
            pytest.xfail(f"ambiguous: {reason}")


class _SkippedItem(_SuiteItem):
    """A gate this run cannot run here (no CUDA, a missing extra): listed, as `suite run` lists it."""

    def __init__(self, *, skipped, **kwargs) -> None:
        super().__init__(**kwargs)
        self.skipped = skipped

    def runtest(self) -> None:
        self.user_properties.append((_SKIPPED, self.skipped.model_dump_json()))
        pytest.skip(self.skipped.reason)


class _RefusedItem(_SuiteItem):
    """A gate named on the command line that cannot run here: could not run, never a skip."""

    def __init__(self, *, result, **kwargs) -> None:
        super().__init__(**kwargs)
        self.result = result

    def runtest(self) -> None:
        self.carry(self.result)
        self.judge(self.result.status, self.result.reason)


class _GateItem(_SuiteItem):
    """Buffers, reference, parity and saboteurs of one gate at one preset (and, without a
    bench, its whole result)."""

    def runtest(self) -> None:
        from suite.harness.results import status_of

        runner = self.session_state.setup()
        # workers plan alike, without free memory: a default preset too large for this GPU is
        # skipped here, as `suite run` skips it when it plans
        reason = runner.too_large(self.unit.preset)
        if reason is not None:
            from suite.harness.results import SkippedGate

            self.user_properties.append((_SKIPPED, SkippedGate(gate=self.unit.gate.name, reason=reason).model_dump_json()))
            pytest.skip(reason)
        run = runner.start(self.unit)
        if not self.unit.bench:
            result = runner.finish(run)
            self.carry(result)
            self.judge(result.status, result.reason)
            return
        self.session_state.runs[_unit_key(self.unit)] = run
        if not run.timeable:  # it could not run or failed parity: no bench follows, its result is final here
            result = runner.finish(run)
            self.carry(result)
            self.judge(result.status, result.reason)
            return
        self.judge(*status_of(run.result))


class _BenchItem(_SuiteItem):
    """One bench case in one timing mode of the unit the _GateItem before it judged."""

    def __init__(self, *, case, mode: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.case, self.mode = case, mode

    def runtest(self) -> None:
        run = self.session_state.runs.get(_unit_key(self.unit))
        if run is None:
            pytest.skip("not timed: its gate did not run")
        if not run.timeable:
            pytest.skip(f"not timed: {run.raised[0] if run.raised else run.result.bench_skipped}")
        bench = self.session_state.setup().time(run, self.case, self.mode)
        error = next((e for e in run.result.bench_errors if (e.case, e.mode) == (self.case.name, self.mode)), None)
        if error is not None:
            raise _Verdict(f"could not run: {error.message}")
        if bench is None:
            pytest.skip(f"not timed: {run.result.bench_skipped}")  # the case cannot run on this device
        missed = [f"{c.name}: {c.detail}" for c in bench.criteria if not c.passed and not c.ambiguous and not c.target]
        if missed:
            raise _Verdict("failed: performance: " + "; ".join(missed))
        if bench.ambiguous:
            pytest.xfail(f"ambiguous: timing stayed ambiguous against the noise floor ({bench.case}, {bench.mode})")


class _RecheckItem(_SuiteItem):
    """The unit's determinism run after its timing; it carries the unit's whole result. It
    fails for what the recheck finds (or a recheck that could not run) and skips where the
    gate item already finished the unit, so a unit's failure is one failed item."""

    def runtest(self) -> None:
        run = self.session_state.runs.pop(_unit_key(self.unit), None)
        if run is None:
            pytest.skip("its gate did not run")
        # where the gate item failed, that item says why: the recheck is not a pass, nor a second failure
        if run.finished and run.raised is not None:
            pytest.skip(f"its gate could not run: {run.raised[0]}")
        if run.finished:
            pytest.skip("its gate failed parity: no recheck to judge")
        raised = run.raised
        result = self.session_state.setup().finish(run)
        self.carry(result)
        if raised is not None:  # a bench item could not run and said so
            pytest.skip(f"a bench could not run: {raised[0]}")
        if result.status == "could_not_run":
            self.judge(result.status, result.reason)
        if not result.parity.passed:
            raise _Verdict("failed: the recheck after timing: " + "; ".join(str(f) for f in result.parity.failures))


# ---- `suite run --gpus N`: the same items through pytest-xdist, from the CLI ----


class _Capture:
    """Takes the merged report back out of the session `spread` runs."""

    report: RunReport | None = None
    path: str | None = None

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.report = config.stash.get(REPORT, None)
        self.path = config.stash.get(REPORT_PATH, None)


def spread(workers: int, device: str, profile: str | None, presets: list[str] | None, reports: str, seed: int = 0,
           thorough: bool = False, strict: bool = False,
           gates: list[str] | None = None) -> tuple[RunReport | None, str | None, int]:
    """`suite run` (of `gates`, default every one) as pytest items over `workers` xdist
    workers, one device each: the merged report, where it was written, and pytest's own exit
    status (the report is None when pytest stopped before the session ended, a usage error).
    pytest runs in an empty directory of its own, so no test file or configuration of the
    caller's is collected."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="suite-spread-") as here:
        ini = os.path.join(here, "pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
        args = ["-c", ini, "--rootdir", here, "-p", "xdist", "-p", "no:cacheprovider", "-q", "-n", str(workers),
                "--suite", "--suite-bench", "--suite-device", device, "--suite-reports", reports,
                "--suite-seed", str(seed), here]
        args += ["--suite-profile", profile] if profile else []
        args += [a for name in presets or [] for a in ("--suite-preset", name)]
        args += ["--suite-thorough"] if thorough else []
        args += ["--suite-strict"] if strict else []
        args += [a for name in gates or [] for a in ("--suite-gate", name)]
        capture = _Capture()
        status = pytest.main(args, plugins=[capture])
    return capture.report, capture.path, int(status)
