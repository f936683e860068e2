"""`suite`: gate and bench the fast paths of a single-GPU training stack.

Thin on purpose: parse, call the runner, print, set the exit code (README: "Exit codes").
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import time
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from suite.errors import CouldNotRun, ExitCode, SuiteError, UsageError

app = typer.Typer(
    help="Gated parity-and-benchmark suite: prove a fast path matches its reference, then time it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
baseline_app = typer.Typer(help="Save a run's figures as the baseline, or compare a run against it.", no_args_is_help=True)
app.add_typer(baseline_app, name="baseline")

console = Console()
err = Console(stderr=True)

DeviceOpt = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cuda or cpu.")]
ProfileOpt = Annotated[
    Optional[str],
    typer.Option("--profile", help="auto | rtx (hold Triton configs to 99 KB shared memory) | none. "
                 "Default: SUITE_PROFILE, else auto."),
]
ReportsOpt = Annotated[Path, typer.Option("--reports", help="Directory the run's report directory is written under.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]


# ---- the options gate, bench and run share, declared once ----------------------------------


@dataclass
class RunFlags:
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when present), cuda or cpu.")] = "auto"
    preset: Annotated[Optional[list[str]], typer.Option(
        "--preset", help="Preset name (repeatable). Default: tiny on the CPU, the standard GPU presets on CUDA.")] = None
    buffers: Annotated[Optional[Path], typer.Option(
        "--buffers", help="Use saved buffers (suite record) instead of fresh ones.")] = None
    reports: ReportsOpt = Path("reports")
    seed: Annotated[int, typer.Option("--seed", help="Seed for fresh buffers.")] = 0
    profile: ProfileOpt = None
    sabotage: Annotated[bool, typer.Option(
        "--sabotage/--no-sabotage", help="Also run the gate's saboteurs and require each to be caught.")] = True
    thorough: Annotated[bool, typer.Option(
        "--thorough", help="Run every saboteur at every preset (default: once, at the smallest preset where it can show).")] = False
    strict: Annotated[bool, typer.Option(
        "--strict", help="Gates this device cannot run count as could-not-run (exit 3).")] = False


def run_flags(exclude: tuple[str, ...] = (), **defaults) -> Callable:
    """Add RunFlags' options to a command (less `exclude`, with other `defaults`); the
    command receives them as one `flags` argument."""

    def decorate(command: Callable) -> Callable:
        hints = {**typing.get_type_hints(command, include_extras=True),
                 **typing.get_type_hints(RunFlags, include_extras=True)}
        own = [p.replace(annotation=hints[p.name])
               for p in inspect.signature(command).parameters.values() if p.name != "flags"]
        shared = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                              default=defaults.get(f.name, f.default))
            for f in fields(RunFlags) if f.name not in exclude
        ]

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {f.name: kwargs.pop(f.name, defaults.get(f.name, f.default)) for f in fields(RunFlags)}
            return command(**kwargs, flags=RunFlags(**values))

        params = own + shared
        wrapper.__signature__ = inspect.Signature(params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # typer must read the new signature, not the command's
        return wrapper

    return decorate


# ---- running gates -------------------------------------------------------------------------


def _fail(exc: SuiteError) -> None:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(int(exc.exit_code))


class _RichProgress:
    """Drives a rich progress bar from the runner's callbacks; off a terminal, one line a phase."""

    def __init__(self, progress: Progress):
        self.bar = progress
        self.task = None
        self.where = ""

    def begin(self, total: int) -> None:
        self.task = self.bar.add_task("starting", total=total)

    def phase(self, gate: str, preset: str, phase: str) -> None:
        self.where = f"{gate} [{preset}] {phase}"
        self.bar.update(self.task, description=escape(self.where))
        if not self.bar.console.is_terminal:  # a log (CI, a remote run) gets each phase as a line
            self.bar.console.print(f"{time.strftime('%H:%M:%S')} {self.where}", soft_wrap=True, markup=False,
                                   highlight=False)

    def detail(self, text: str) -> None:
        self.bar.update(self.task, description=escape(f"{self.where}: {text}" if self.where else text))

    def advance(self) -> None:
        self.bar.advance(self.task)


def _setup(device: str, profile: str | None):
    """Decide device, Triton mode and profile before any gate (and so Triton) is imported."""
    from suite.settings import configure

    return configure(device, profile)


def _execute(what: str, name: str, flags: RunFlags, *, bench: bool) -> None:
    try:
        settings = _setup(flags.device, flags.profile)
        import gates
        from suite.harness.runner import RunOptions, Runner
        from suite.harness.store import write_report

        selected = gates.select(name)
        options = RunOptions(
            device=settings.device,
            presets=flags.preset,
            buffers_dir=flags.buffers,
            seed=flags.seed,
            bench=bench,
            sabotage=flags.sabotage,
            thorough=flags.thorough,
            explicit=name != "all",
            strict=flags.strict,
        )
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=True) as bar:
            report = Runner(options, _RichProgress(bar)).run(selected, what)
        path = write_report(report, flags.reports, what)
    except SuiteError as exc:
        _fail(exc)
    except OSError as exc:  # --reports is a file, a read-only place, a full disk
        _fail(CouldNotRun(f"cannot write the report under {flags.reports}: {exc}"))
    _print_summary(report)
    console.print(f"report: {path}", highlight=False)
    raise typer.Exit(report.exit_code)


def _names_table(title: str, names: dict[str, int], *others: str) -> Table:
    """A table whose name columns (column -> longest name in it) are never cut or wrapped."""
    table = Table(title=title)
    for column, longest in names.items():
        table.add_column(column, no_wrap=True, min_width=longest)
    for column in others:
        table.add_column(column, overflow="fold")  # wrapped, never cut
    return table


def _print_summary(report) -> None:
    from suite.harness.render import bench_summary

    title = f"suite {report.what}: exit {report.exit_code} ({ExitCode(report.exit_code).name.lower()}) in {report.duration_s:.0f} s"
    table = Table(title=title)
    longest = max([len(r.gate) for r in report.results] + [len(s.gate) for s in report.skipped] + [4])
    longest_preset = max([len(r.preset) for r in report.results] + [6])
    table.add_column("gate", no_wrap=True, min_width=longest)
    table.add_column("preset", no_wrap=True, min_width=longest_preset)
    for column in ("status", "s", "parity", "saboteurs", "bench"):
        table.add_column(column, overflow="fold")
    colours = {"passed": "green", "failed": "red", "could_not_run": "yellow", "ambiguous": "magenta", "skipped": "dim"}
    for r in report.results:
        parity = "-" if r.parity is None else ("pass" if r.parity.passed else "FAIL")
        caught = sum(s.caught for s in r.saboteurs)
        saboteurs = f"{caught}/{len(r.saboteurs)} caught" if r.saboteurs else "-"
        bench = bench_summary(r) if r.parity else (r.reason or "")
        table.add_row(r.gate, r.preset, f"[{colours[r.status]}]{r.status}[/]", f"{r.duration_s:.0f}", parity,
                      saboteurs, escape(bench))
    for s in report.skipped:
        table.add_row(s.gate, "-", "[dim]skipped[/]", "-", "-", "-", escape(s.reason))
    console.print(table)
    for r in report.results:
        if r.status != "passed" and r.reason:
            console.print(f"[bold]{escape(r.gate)} {escape(f'[{r.preset}]')}[/]: {escape(r.reason)}")


@app.command()
@run_flags()
def gate(name: Annotated[str, typer.Argument(help="Gate name or 'all'.")], flags: RunFlags) -> None:
    """Judge an arm against its reference (parity, anti-cheat, determinism, saboteurs)."""
    _execute(f"gate {name}", name, flags, bench=False)


@app.command()
@run_flags(sabotage=False)
def bench(name: Annotated[str, typer.Argument(help="Gate name or 'all'.")], flags: RunFlags) -> None:
    """Gate, then time the arm against its reference and peers, as CUDA-graph replays and as
    eager calls (needs CUDA, except for wall-clock benches)."""
    _execute(f"bench {name}", name, flags, bench=True)


@app.command()
@run_flags(exclude=("buffers", "sabotage"))
def run(flags: RunFlags) -> None:
    """CI style: gate, saboteurs and bench for every gate this device can run; list the ones it cannot."""
    _execute("run", "all", flags, bench=True)


# ---- the other commands --------------------------------------------------------------------


@app.command()
def record(
    name: Annotated[str, typer.Argument(help="Gate name.")],
    preset: Annotated[str, typer.Option("--preset", help="Preset whose buffers to save.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write buffers.safetensors and manifest.json into.")],
    device: DeviceOpt = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Seed for fresh buffers.")] = 0,
) -> None:
    """Save a gate's buffers (safetensors + manifest with shapes, dtypes, seed, versions, sha256)."""
    try:
        settings = _setup(device, None)
        import gates
        from suite.harness.buffers import save_buffers

        chosen = gates.get(name)
        p = chosen.preset(preset)
        if p.where == "cuda" and settings.device.type != "cuda":
            raise CouldNotRun(f"preset {p.name} is a GPU preset; record it with --device cuda on a GPU machine")
    except SuiteError as exc:
        _fail(exc)
    tensors = chosen.make_buffers(p, seed, settings.device)
    try:
        path = save_buffers(tensors, out, gate=chosen.name, preset=p.name, seed=seed, params=dict(p.params))
    except OSError as exc:
        _fail(CouldNotRun(f"cannot write buffers into {out}: {exc}"))
    console.print(f"recorded {', '.join(f'{n} {list(t.shape)} {t.dtype}' for n, t in tensors.items())} into {path}",
                  highlight=False)


def _report_path(path: Path | None, reports: Path) -> Path:
    from suite.harness.store import list_reports

    if path is None:
        runs = list_reports(reports)
        if not runs:
            raise UsageError(f"no report under {reports}; run `suite bench NAME` first or pass a report path")
        path = runs[-1]
    return path / "report.json" if path.is_dir() else path


@baseline_app.command("save")
def baseline_save(
    report: Annotated[Optional[Path], typer.Argument(help="report.json or its directory; default: the newest under --reports.")] = None,
    reports: ReportsOpt = Path("reports"),
    baselines: Annotated[Path, typer.Option("--baselines", help="Baselines directory.")] = Path("baselines"),
    gate_names: Annotated[Optional[list[str]], typer.Option("--gate", help="Only these gates (repeatable).")] = None,
    replace: Annotated[bool, typer.Option(
        "--replace", help="Replace each gate's file whole (default: replace only the presets this report measured)."
    )] = False,
) -> None:
    """Write a bench report's figures to baselines/<device-slug>/<gate>.json.

    The presets the report measured replace theirs; a gate's other presets keep the figures
    of the run that measured them (the file names each preset's run)."""
    from suite.harness.baseline import save_baseline
    from suite.harness.results import load_report

    try:
        saved = save_baseline(load_report(_report_path(report, reports)), baselines, gate_names, replace=replace)
    except SuiteError as exc:
        _fail(exc)
    for path in saved:
        console.print(f"saved {path}", highlight=False)


@baseline_app.command("compare")
def baseline_compare(
    report: Annotated[Optional[Path], typer.Argument(help="report.json or its directory; default: the newest under --reports.")] = None,
    reports: ReportsOpt = Path("reports"),
    baselines: Annotated[Path, typer.Option("--baselines", help="Baselines directory.")] = Path("baselines"),
    force: Annotated[bool, typer.Option("--force", help="Compare even across fingerprint classes (GPU, torch/triton minor).")] = False,
) -> None:
    """Judge a run against the saved baseline using the run's own noise floor."""
    from suite.harness.baseline import compare
    from suite.harness.render import render_comparison
    from suite.harness.results import load_report

    try:
        result = compare(load_report(_report_path(report, reports)), baselines, force=force)
    except SuiteError as exc:
        _fail(exc)
    sys.stdout.write(render_comparison(result) + "\n")
    judged = [e for e in result.entries if e.role == "arm" and e.status in ("same", "regressed", "improved")]
    if not judged:  # a comparison that compared nothing must not read as a pass
        _fail(CouldNotRun(f"nothing compared: no arm figure of this report has a baseline under {baselines}"))
    raise typer.Exit(int(ExitCode.OK if result.passed else ExitCode.FAILED))


@app.command("report")
def show_report(
    path: Annotated[Path, typer.Argument(help="report.json or its directory.")],
    fmt: Annotated[str, typer.Option("--format", help="md, json or junit.")] = "md",
) -> None:
    """Render a saved JSON report again."""
    from suite.harness.render import render_junit, render_markdown, to_json
    from suite.harness.results import load_report

    renderers = {"md": render_markdown, "json": to_json, "junit": render_junit}
    try:
        if fmt not in renderers:
            raise UsageError(f"--format must be one of {', '.join(renderers)}, not {fmt!r}")
        loaded = load_report(_report_path(path, Path("reports")))
    except SuiteError as exc:
        _fail(exc)
    sys.stdout.write(renderers[fmt](loaded) + "\n")


def _gate_listing(gate, device) -> dict:
    """What `suite list` says of one gate, as data (the table and --json both print it)."""
    return {
        "name": gate.name,
        "summary": gate.summary,
        "arm": gate.arm_name,
        "needs_cuda": gate.needs_cuda,
        "presets": [
            {"name": p.name, "where": p.where, "default_here": p in gate.default_presets(device),
             "memory_bytes": p.memory_bytes, "note": p.note}
            for p in gate.presets
        ],
        "contenders": [
            {"name": c.name, "role": c.role, "cases": list(c.cases) if c.cases else [b.name for b in gate.benches],
             "unavailable": c.unavailable(device), "note": c.note}
            for c in gate.contenders
        ],
        "benches": [{"case": b.name, "modes": list(b.modes), "ceiling": b.ceiling} for b in gate.benches],
        "saboteurs": [{"name": s.name, "caught_by": s.caught_by.value} for s in gate.saboteurs],
    }


@app.command("list")
def list_gates(device: DeviceOpt = "auto", as_json: JsonOpt = False) -> None:
    """List gates: arm, presets, contenders (and which are unavailable here, and why)."""
    try:
        settings = _setup(device, None)
        import gates
    except SuiteError as exc:
        _fail(exc)
    listing = [_gate_listing(g, settings.device) for g in gates.select("all")]
    if as_json:
        sys.stdout.write(json.dumps({"device": str(settings.device), "gates": listing}, indent=2) + "\n")
        return
    presets_of = {
        g["name"]: [f"{p['name']}{'' if p['where'] == 'any' else ' (cuda)'}{' *' if p['default_here'] else ''}"
                    for p in g["presets"]]
        for g in listing
    }
    widths = {"gate": max(len(g["name"]) for g in listing),
              "presets": max(len(p) for names in presets_of.values() for p in names)}
    table = _names_table(f"gates (device: {settings.device})", widths, "needs CUDA", "contenders", "summary")
    for g in listing:
        presets = "\n".join(presets_of[g["name"]])
        contenders = [f"{c['name']} ({c['role']})" + (f" unavailable: {c['unavailable']}" if c["unavailable"] else "")
                      for c in g["contenders"]]
        if settings.device.type != "cuda" and any(set(b["modes"]) - {"wall"} for b in g["benches"]):
            contenders.append("(timing needs CUDA)")
        table.add_row(escape(g["name"]), escape(presets), "yes" if g["needs_cuda"] else "no",
                      escape("\n".join(contenders)), escape(g["summary"]))
    console.print(table)
    console.print("* = run by default on this device")


@app.command()
def env(device: DeviceOpt = "auto", as_json: JsonOpt = False) -> None:
    """Show this machine's fingerprint and what each gate is missing here."""
    try:
        settings = _setup(device, None)
        import gates
        from suite.harness.fingerprint import fingerprint
    except SuiteError as exc:
        _fail(exc)
    fp = fingerprint(settings.device, settings.profile)
    rows = []
    for gate in gates.select("all"):
        missing = [f"{c.name}: {r}" for c in gate.contenders if (r := c.unavailable(settings.device))]
        can_gate = settings.device.type == "cuda" or not gate.needs_cuda
        if not can_gate:
            missing.insert(0, "CUDA (the gate needs a GPU)")
        can_bench = bool(gate.benches) and (settings.device.type == "cuda" or all(b.modes == ("wall",) for b in gate.benches))
        if not can_bench:
            missing.append("CUDA for timing")
        rows.append({"gate": gate.name, "parity": can_gate, "bench": can_bench, "missing": missing})
    if as_json:
        sys.stdout.write(json.dumps({"fingerprint": fp.model_dump(), "gates": rows}, indent=2) + "\n")
        return
    table = Table(title="environment")
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in fp.model_dump().items():
        table.add_row(key, escape(str(value)))
    console.print(table)
    gates_table = _names_table("gates on this machine", {"gate": max(len(r["gate"]) for r in rows)},
                               "parity", "bench", "missing")
    for row in rows:
        gates_table.add_row(escape(row["gate"]), "yes" if row["parity"] else "no", "yes" if row["bench"] else "no",
                            escape("\n".join(row["missing"]) or "-"))
    console.print(gates_table)


if __name__ == "__main__":
    app()
