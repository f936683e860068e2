"""`suite`: gate and bench the fast paths of a single-GPU training stack.

Thin on purpose: parse, call the runner, print, set the exit code (README: "Exit codes").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

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
PresetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--preset", help="Preset name (repeatable). Default: tiny on the CPU, the standard GPU presets on CUDA."),
]
BuffersOpt = Annotated[Optional[Path], typer.Option("--buffers", help="Use saved buffers (suite record) instead of fresh ones.")]
ReportsOpt = Annotated[Path, typer.Option("--reports", help="Directory the run's report directory is written under.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for fresh buffers.")]
ProfileOpt = Annotated[
    str, typer.Option("--profile", help="auto | rtx (hold Triton configs to 99 KB shared memory) | none.")
]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Gates this device cannot run count as could-not-run (exit 3).")]
SabotageOpt = Annotated[
    bool, typer.Option("--sabotage/--no-sabotage", help="Also run the gate's saboteurs and require each to be caught.")
]


def _fail(exc: SuiteError) -> None:
    err.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
    raise typer.Exit(int(exc.exit_code))


class _RichProgress:
    """Drives a rich progress bar from the runner's callbacks."""

    def __init__(self, progress: Progress):
        self.bar = progress
        self.task = None

    def begin(self, total: int) -> None:
        self.task = self.bar.add_task("starting", total=total)

    def status(self, text: str) -> None:
        self.bar.update(self.task, description=escape(text))
        if not self.bar.console.is_terminal:  # a log (CI, a remote run) gets each step as a line
            self.bar.console.print(f"{time.strftime('%H:%M:%S')} {text}", soft_wrap=True, markup=False)

    def advance(self) -> None:
        self.bar.advance(self.task)


def _setup(device: str, profile: str):
    """Pick the device and profile before any gate (and so Triton) is imported."""
    from suite.harness.runner import prepare_triton, resolve_device, set_profile

    set_profile(profile)
    resolved = resolve_device(device)
    prepare_triton(resolved)
    return resolved


def _execute(
    what: str,
    name: str,
    *,
    device: str,
    presets: list[str] | None,
    buffers: Path | None,
    reports: Path,
    seed: int,
    profile: str,
    bench: bool,
    sabotage: bool,
    strict: bool,
) -> None:
    try:
        resolved = _setup(device, profile)
        import gates
        from suite.harness.report import write_report
        from suite.harness.runner import RunOptions, Runner

        selected = gates.select(name)
        options = RunOptions(
            device=resolved,
            presets=presets,
            buffers_dir=buffers,
            seed=seed,
            profile=profile,
            bench=bench,
            sabotage=sabotage,
            explicit=name != "all",
            strict=strict,
        )
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=True) as bar:
            report = Runner(options, _RichProgress(bar)).run(selected, what)
        path = write_report(report, reports, what)
    except SuiteError as exc:
        _fail(exc)
    except OSError as exc:  # --reports is a file, a read-only place, a full disk
        _fail(CouldNotRun(f"cannot write the report under {reports}: {exc}"))
    _print_summary(report)
    console.print(f"report: {path}")
    raise typer.Exit(report.exit_code)


def _print_summary(report) -> None:
    from suite.harness.report import bench_summary

    table = Table(title=f"suite {report.what}: exit {report.exit_code} ({ExitCode(report.exit_code).name.lower()})")
    for column in ("gate", "preset", "status", "parity", "saboteurs", "bench"):
        table.add_column(column)
    colours = {"passed": "green", "failed": "red", "could_not_run": "yellow", "ambiguous": "magenta", "skipped": "dim"}
    for r in report.results:
        parity = "-" if r.parity is None else ("pass" if r.parity.passed else "FAIL")
        caught = sum(s.caught for s in r.saboteurs)
        saboteurs = f"{caught}/{len(r.saboteurs)} caught" if r.saboteurs else "-"
        bench = bench_summary(r) if r.parity else (r.reason or "")
        table.add_row(r.gate, r.preset, f"[{colours[r.status]}]{r.status}[/]", parity, saboteurs, escape(bench))
    for s in report.skipped:
        table.add_row(s.gate, "-", "[dim]skipped[/]", "-", "-", escape(s.reason))
    console.print(table)
    for r in report.results:
        if r.status != "passed" and r.reason:
            console.print(f"[bold]{escape(r.gate)} {escape(f'[{r.preset}]')}[/]: {escape(r.reason)}")


@app.command("list")
def list_gates(device: DeviceOpt = "auto") -> None:
    """List gates: arm, peers (and which are unavailable here, and why), presets, CUDA need."""
    try:
        resolved = _setup(device, "auto")
        import gates
    except SuiteError as exc:
        _fail(exc)
    table = Table(title=f"gates (device: {resolved})")
    for column in ("gate", "arm", "needs CUDA", "presets", "peers", "summary"):
        table.add_column(column)
    for gate in gates.select("all"):
        presets = ", ".join(
            f"{p.name}{'' if p.where == 'any' else ' (cuda)'}{' *' if p.standard else ''}" for p in gate.presets
        )
        peers = []
        for peer in gate.peers:
            reason = peer.unavailable(resolved)
            peers.append(peer.name + (f" [unavailable: {reason}]" if reason else ""))
        if resolved.type != "cuda" and gate.benches:
            peers.append("(timing needs CUDA)")
        table.add_row(gate.name, gate.arm_name, "yes" if gate.needs_cuda else "no", presets, "\n".join(peers), gate.summary)
    console.print(table)
    console.print("* = run by default on its device")


@app.command()
def gate(
    name: Annotated[str, typer.Argument(help="Gate name or 'all'.")],
    device: DeviceOpt = "auto",
    preset: PresetOpt = None,
    buffers: BuffersOpt = None,
    reports: ReportsOpt = Path("reports"),
    seed: SeedOpt = 0,
    profile: ProfileOpt = "auto",
    sabotage: SabotageOpt = True,
    strict: StrictOpt = False,
) -> None:
    """Judge an arm against its reference (parity, anti-cheat, determinism, saboteurs)."""
    _execute(f"gate {name}", name, device=device, presets=preset, buffers=buffers, reports=reports, seed=seed,
             profile=profile, bench=False, sabotage=sabotage, strict=strict)


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="Gate name or 'all'.")],
    device: DeviceOpt = "auto",
    preset: PresetOpt = None,
    buffers: BuffersOpt = None,
    reports: ReportsOpt = Path("reports"),
    seed: SeedOpt = 0,
    profile: ProfileOpt = "auto",
    sabotage: SabotageOpt = False,
    strict: StrictOpt = False,
) -> None:
    """Gate, then time the arm against its reference and peers (needs CUDA; skipped on the CPU)."""
    _execute(f"bench {name}", name, device=device, presets=preset, buffers=buffers, reports=reports, seed=seed,
             profile=profile, bench=True, sabotage=sabotage, strict=strict)


@app.command()
def run(
    device: DeviceOpt = "auto",
    preset: PresetOpt = None,
    reports: ReportsOpt = Path("reports"),
    seed: SeedOpt = 0,
    profile: ProfileOpt = "auto",
    strict: StrictOpt = False,
) -> None:
    """CI style: gate and bench every gate this device can run; list the ones it cannot."""
    _execute("run", "all", device=device, presets=preset, buffers=None, reports=reports, seed=seed,
             profile=profile, bench=True, sabotage=True, strict=strict)


@app.command()
def record(
    name: Annotated[str, typer.Argument(help="Gate name.")],
    preset: Annotated[str, typer.Option("--preset", help="Preset whose buffers to save.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write buffers.safetensors and manifest.json into.")],
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
) -> None:
    """Save a gate's buffers (safetensors + manifest with shapes, dtypes, seed, versions, sha256)."""
    try:
        resolved = _setup(device, "auto")
        import gates
        from suite.harness.buffers import save_buffers

        chosen = gates.get(name)
        p = chosen.preset(preset)
        if p.where == "cuda" and resolved.type != "cuda":
            raise UsageError(f"preset {p.name} is a GPU preset; record it with --device cuda on a GPU machine")
    except SuiteError as exc:
        _fail(exc)
    tensors = chosen.make_buffers(p, seed, resolved)
    try:
        path = save_buffers(tensors, out, gate=chosen.name, preset=p.name, seed=seed, params=dict(p.params))
    except OSError as exc:
        _fail(CouldNotRun(f"cannot write buffers into {out}: {exc}"))
    console.print(f"recorded {', '.join(f'{n} {list(t.shape)} {t.dtype}' for n, t in tensors.items())} into {path}")


def _report_path(path: Path | None, reports: Path) -> Path:
    from suite.harness.report import list_reports

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
    from suite.harness.report import load_report

    try:
        saved = save_baseline(load_report(_report_path(report, reports)), baselines, gate_names, replace=replace)
    except SuiteError as exc:
        _fail(exc)
    for path in saved:
        console.print(f"saved {path}")


@baseline_app.command("compare")
def baseline_compare(
    report: Annotated[Optional[Path], typer.Argument(help="report.json or its directory; default: the newest under --reports.")] = None,
    reports: ReportsOpt = Path("reports"),
    baselines: Annotated[Path, typer.Option("--baselines", help="Baselines directory.")] = Path("baselines"),
    force: Annotated[bool, typer.Option("--force", help="Compare even across fingerprint classes (GPU, torch/triton minor).")] = False,
) -> None:
    """Judge a run against the saved baseline using the run's own noise floor."""
    from suite.harness.baseline import compare, render_comparison
    from suite.harness.report import load_report

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
    from suite.harness.report import load_report, render_junit, render_markdown, to_json

    renderers = {"md": render_markdown, "json": to_json, "junit": render_junit}
    try:
        if fmt not in renderers:
            raise UsageError(f"--format must be one of {', '.join(renderers)}, not {fmt!r}")
        loaded = load_report(_report_path(path, Path("reports")))
    except SuiteError as exc:
        _fail(exc)
    sys.stdout.write(renderers[fmt](loaded) + "\n")


@app.command()
def env(device: DeviceOpt = "auto") -> None:
    """Show this machine's fingerprint and what each gate is missing here."""
    try:
        resolved = _setup(device, "auto")
        import gates
        from suite.harness.fingerprint import fingerprint
    except SuiteError as exc:
        _fail(exc)
    fp = fingerprint(resolved, "auto")
    table = Table(title="environment")
    table.add_column("what")
    table.add_column("value")
    for key, value in fp.model_dump().items():
        table.add_row(key, str(value))
    console.print(table)
    gates_table = Table(title="gates on this machine")
    for column in ("gate", "parity", "bench", "missing"):
        gates_table.add_column(column)
    for gate in gates.select("all"):
        missing = [f"{p.name}: {r}" for p in gate.peers if (r := p.unavailable(resolved))]
        can_gate = resolved.type == "cuda" or not gate.needs_cuda
        if not can_gate:
            missing.insert(0, "CUDA (the gate needs a GPU)")
        can_bench = resolved.type == "cuda" and bool(gate.benches)
        if not can_bench:
            missing.append("CUDA for timing")
        gates_table.add_row(gate.name, "yes" if can_gate else "no", "yes" if can_bench else "no", "\n".join(missing) or "-")
    console.print(gates_table)


if __name__ == "__main__":
    app()
