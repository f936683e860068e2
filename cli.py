"""`suite`: gate and bench the fast paths of a single-GPU training stack.

Thin on purpose: parse, call the runner, print, set the exit code (README: "Exit codes").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from typer.exceptions import TyperException

from suite.errors import CouldNotRun, ExitCode, Interrupted, SuiteError, UsageError
from suite.harness.terminal import console, err, print_environment, print_listing, print_summary, print_tracebacks

app = typer.Typer(
    help="Gated parity-and-benchmark suite: prove a fast path matches its reference, then time it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # a docstring's later paragraphs are wrapped to the terminal, not kept at the source's breaks
    rich_markup_mode="markdown",
)
baseline_app = typer.Typer(help="Save a run's figures as the baseline, or compare a run against it.", no_args_is_help=True,
                           rich_markup_mode="markdown")
app.add_typer(baseline_app, name="baseline")
checkpoint_app = typer.Typer(help="Directory-atomic checkpoints (suite.arms.checkpoint).", no_args_is_help=True,
                             rich_markup_mode="markdown")
app.add_typer(checkpoint_app, name="checkpoint")


DeviceOpt = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cuda or cpu.")]
ProfileOpt = Annotated[
    Optional[str],
    typer.Option("--profile", help="auto | rtx (hold Triton configs to 99 KB shared memory) | none. "
                 "Default: SUITE_PROFILE, else auto."),
]
ReportsOpt = Annotated[Path, typer.Option("--reports", help="Directory the run's report directory is written under.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
# torch seeds a generator with an unsigned 64-bit number: a larger seed cannot be used, and -1
# would silently be 2^64-1
SeedOpt = Annotated[int, typer.Option("--seed", min=0, max=2**64 - 1, help="Seed for fresh buffers (0 to 2^64-1).")]


# ---- the options gate, bench and run share, declared once ----------------------------------


@dataclass
class RunFlags:
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when present), cuda or cpu.")] = "auto"
    preset: Annotated[Optional[list[str]], typer.Option(
        "--preset", help="Preset name (repeatable). Default: tiny on the CPU, the standard GPU presets on CUDA.")] = None
    buffers: Annotated[Optional[Path], typer.Option(
        "--buffers", help="Use saved buffers (suite record) instead of fresh ones.")] = None
    reports: ReportsOpt = Path("reports")
    seed: SeedOpt = 0
    profile: ProfileOpt = None
    gpu_memory: Annotated[Optional[str], typer.Option(
        "--gpu-memory", help="GiB this process may allocate on the GPU, as on a smaller card (16: the RTX card's), "
        "or none; presets that need more are skipped, or could not run where named. Default: SUITE_GPU_MEMORY, "
        "else the whole card.")] = None
    sabotage: Annotated[bool, typer.Option(
        "--sabotage/--no-sabotage", help="Also run the gate's saboteurs and require each to be caught.")] = True
    thorough: Annotated[bool, typer.Option(
        "--thorough", help="Run every saboteur at every preset (default: once, at the smallest preset where it can show).")] = False
    strict: Annotated[bool, typer.Option(
        "--strict", help="Gates, and benches, this device cannot run count as could-not-run (exit 3).")] = False
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="Print the traceback of a gate that raised unexpectedly (the report keeps it anyway).")] = False


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


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def _interrupts_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP all raise (a KeyboardInterrupt), so a job that CI cancels or
    a closed terminal unwinds through the same cleanup as Ctrl-C: temporaries are removed."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers, and it is the one signals interrupt
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig in previous:
        signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _guarded(command: Callable) -> Callable:
    """Every command's way out: a SuiteError as one line with its exit code, an interrupt as
    130, and a bug in suite as 3 with its traceback, never the 1 that CI reads as a failed
    gate."""

    @functools.wraps(command)
    def guarded(*args, **kwargs):
        try:
            with _interrupts_raise():
                return command(*args, **kwargs)
        except SuiteError as exc:
            _fail(exc)
        except KeyboardInterrupt as exc:
            name = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
            err.print(f"[bold red]interrupted[/] by {name}: stopped, and no partial report, recording or baseline "
                      "was left behind", soft_wrap=True)
            raise typer.Exit(int(ExitCode.INTERRUPTED))
        except (typer.Exit, typer.Abort, TyperException):
            raise  # the command's own exit code, or the parser's usage error
        except Exception as exc:
            err.print(traceback.format_exc(), markup=False, highlight=False)
            first = (str(exc).strip().splitlines() or [""])[0]
            _fail(CouldNotRun(f"internal error ({type(exc).__name__}: {first}); a bug in suite, its traceback is above"))

    return guarded


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


def _setup(device: str, profile: str | None, gpu_memory: str | None = None):
    """Decide device, Triton mode, profile and memory cap before any gate (and so Triton) is imported."""
    from suite.settings import configure

    return configure(device, profile, gpu_memory)


def _execute(what: str, name: str, flags: RunFlags, *, bench: bool) -> None:
    settings = _setup(flags.device, flags.profile, flags.gpu_memory)
    import gates
    from suite.harness.runner import RunOptions, Runner
    from suite.harness.store import check_writable

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
    check_writable(flags.reports)  # now, not after an hour of gates
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        report = Runner(options, _RichProgress(bar)).run(selected, what)
    path, code = _save_report(report, flags.reports, what)
    print_summary(report)
    print_tracebacks(report, flags.verbose)
    if path is not None:
        console.print(f"report: {path}", markup=False, highlight=False)
    raise typer.Exit(code)


def _save_report(report, reports: Path, what: str) -> tuple[Path | None, int]:
    """Write the report under --reports or, when that fails at the end of a run (the disk
    filled meanwhile), into a temporary directory: the figures are kept, and so is the gates'
    exit code. Returns where it went (None: nowhere) and the exit code."""
    from suite.harness.store import save_report

    path, trouble = save_report(report, reports, what)
    if trouble is not None:
        err.print(f"[bold red]error:[/] {escape(trouble)}" if path is None else f"[yellow]warning:[/] {escape(trouble)}",
                  soft_wrap=True)
    return path, _kept_exit_code(report, path)


def _kept_exit_code(report, path: Path | None) -> int:
    """A failed gate still exits 1; a run whose report was kept nowhere otherwise could not run."""
    return report.exit_code if path is not None or report.exit_code == ExitCode.FAILED else int(ExitCode.COULD_NOT_RUN)


@app.command()
@run_flags()
@_guarded
def gate(name: Annotated[str, typer.Argument(help="Gate name or 'all'.")], flags: RunFlags) -> None:
    """Judge an arm against its reference (parity, anti-cheat, determinism, saboteurs)."""
    _execute(f"gate {name}", name, flags, bench=False)


@app.command()
@run_flags(sabotage=False)
@_guarded
def bench(name: Annotated[str, typer.Argument(help="Gate name or 'all'.")], flags: RunFlags) -> None:
    """Gate, then time the arm against its reference and peers, as CUDA-graph replays and as
    eager calls (needs CUDA, except for wall-clock benches)."""
    _execute(f"bench {name}", name, flags, bench=True)


@app.command()
@run_flags(exclude=("buffers", "sabotage"))
@_guarded
def run(flags: RunFlags, gpus: Annotated[Optional[str], typer.Option(
        "--gpus", help="Spread the gates over N GPUs of this host, or 'all' (pytest-xdist, one worker a GPU; "
        "with --device cpu, N CPU workers).")] = None) -> None:
    """CI style: gate, saboteurs and bench for every gate this device can run; list the ones it cannot."""
    if gpus is not None:
        _spread(flags, gpus)
    _execute("run", "all", flags, bench=True)


def _spread(flags: RunFlags, gpus: str) -> None:
    """`suite run` as pytest items over several devices (suite.harness.pytest_plugin), one
    merged report, the suite's exit code."""
    import pytest
    import torch

    import gates
    from suite.harness.pytest_plugin import spread
    from suite.harness.runner import check_presets
    from suite.harness.store import check_writable

    settings = _setup(flags.device, flags.profile, flags.gpu_memory)  # its workers inherit the cap
    check_presets(gates.select("all"), flags.preset)
    check_writable(flags.reports)
    count = torch.cuda.device_count() if settings.device.type == "cuda" else None
    limit = count
    if count is None:  # CPU workers each load torch and use every core: more than the cores only thrash
        limit = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = count if gpus == "all" and count else int(gpus) if gpus.isdigit() else None
    if not workers or workers > limit:
        raise UsageError(f"--gpus must be 'all' or a number from 1 to this host's GPUs ({count or 'none'}), "
                         f"not {gpus!r}" + (f"; on the CPU give a number of workers from 1 to its {limit} cores"
                                             if count is None else ""))
    report, path, status = spread(workers, settings.device.type, flags.profile, flags.preset, str(flags.reports),
                                  flags.seed, flags.thorough, flags.strict)
    if status == pytest.ExitCode.INTERRUPTED:
        raise KeyboardInterrupt
    if report is None:
        raise CouldNotRun(f"pytest stopped before the gates ran (its exit status {status}); run "
                          f"`pytest --suite --suite-bench -n {workers}` to see why")
    print_summary(report)
    print_tracebacks(report, flags.verbose)
    console.print(f"report: {path or 'not written (see the warning above)'}", markup=False, highlight=False)
    if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise CouldNotRun(f"pytest ended with exit status {status} ({pytest.ExitCode(status).name.lower()}), "
                          "not with its items' outcomes: the report may be incomplete")
    if status == pytest.ExitCode.TESTS_FAILED and report.exit_code == ExitCode.OK:
        raise CouldNotRun("pytest failed an item that the report passes: the report is incomplete")
    raise typer.Exit(_kept_exit_code(report, path))


# ---- the other commands --------------------------------------------------------------------


@app.command()
@_guarded
def record(
    name: Annotated[str, typer.Argument(help="Gate name.")],
    preset: Annotated[str, typer.Option("--preset", help="Preset whose buffers to save.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write buffers.safetensors and manifest.json into.")],
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a recording already in --out.")] = False,
) -> None:
    """Save a gate's buffers (safetensors + manifest with shapes, dtypes, seed, versions, sha256)."""
    settings = _setup(device, None)
    import gates
    from suite.files.buffers import check_destination, save_buffers
    from suite.harness.store import unwritable

    chosen = gates.get(name)
    p = chosen.preset(preset)
    if p.where == "cuda" and settings.device.type != "cuda":
        raise CouldNotRun(f"preset {p.name} is a GPU preset; record it with --device cuda on a GPU machine")
    check_destination(out, overwrite)  # before making buffers, which can take minutes
    tensors = chosen.make_buffers(p, seed, settings.device)
    try:
        path = save_buffers(tensors, out, gate=chosen.name, preset=p.name, seed=seed, params=dict(p.params),
                            overwrite=overwrite)
    except OSError as exc:
        raise unwritable("--out", out, exc) from exc
    console.print(f"recorded {', '.join(f'{n} {list(t.shape)} {t.dtype}' for n, t in tensors.items())} into {path}",
                  markup=False, highlight=False)


def _report_path(path: Path | None, reports: Path) -> Path:
    from suite.harness.store import list_reports

    if path is None:
        runs = list_reports(reports)
        if not runs:
            raise UsageError(f"no report under {reports}; run `suite bench NAME` first or pass a report path")
        path = runs[-1]
    runs_inside = list_reports(path) if path.is_dir() and not (path / "report.json").exists() else []
    if runs_inside:
        raise UsageError(f"{path} is a reports directory, not a run's: pass one of its runs (the newest is "
                         f"{runs_inside[-1]})")
    return path / "report.json" if path.is_dir() else path


@baseline_app.command("save")
@_guarded
def baseline_save(
    report: Annotated[Optional[Path], typer.Argument(help="report.json or its directory; default: the newest under --reports.")] = None,
    reports: ReportsOpt = Path("reports"),
    baselines: Annotated[Path, typer.Option("--baselines", help="Baselines directory.")] = Path("baselines"),
    gate_names: Annotated[Optional[list[str]], typer.Option("--gate", help="Only these gates (repeatable).")] = None,
    replace: Annotated[bool, typer.Option(
        "--replace", help="Replace each gate's file whole (default: replace only the presets this report measured)."
    )] = False,
    add: Annotated[bool, typer.Option(
        "--add", help="Add this run to the runs its presets hold (the newest 5 kept): their spread widens the bar a change must clear."
    )] = False,
) -> None:
    """Write a bench report's figures to `baselines/<device-slug>/<gate>.json`.

    The presets the report measured replace theirs (or, with --add, gain this run beside
    theirs); a gate's other presets keep the figures of the runs that measured them (the file
    names each preset's runs)."""
    from suite.harness.baseline import save_baseline
    from suite.harness.results import load_report
    from suite.harness.store import unwritable

    run = load_report(_report_path(report, reports))
    try:
        saved = save_baseline(run, baselines, gate_names, replace=replace, add=add)
    except OSError as exc:
        raise unwritable("--baselines", baselines, exc) from exc
    for path in saved:
        console.print(f"saved {path}", markup=False, highlight=False)
    if saved:  # the pages docs/results holds are rendered from these files; CI fails on a stale one
        console.print(f"render the pages again: suite baseline show --baselines {baselines} --write docs/results",
                      markup=False, highlight=False)


@baseline_app.command("compare")
@_guarded
def baseline_compare(
    report: Annotated[Optional[Path], typer.Argument(help="report.json or its directory; default: the newest under --reports.")] = None,
    reports: ReportsOpt = Path("reports"),
    baselines: Annotated[Path, typer.Option("--baselines", help="Baselines directory.")] = Path("baselines"),
    force: Annotated[bool, typer.Option("--force", help="Compare even across fingerprint classes (GPU, torch/triton minor).")] = False,
) -> None:
    """Judge a run against the saved baseline: its noise floor, and how far the saved runs lie apart."""
    from suite.harness.baseline import compare
    from suite.harness.render import render_comparison
    from suite.harness.results import load_report

    if not baselines.is_dir():
        raise UsageError(f"--baselines {baselines} is not a directory; pass the baselines directory "
                         "(suite baseline save writes baselines/ by default)")
    result = compare(load_report(_report_path(report, reports)), baselines, force=force)
    sys.stdout.write(render_comparison(result) + "\n")
    if not result.judged:  # a comparison that compared nothing must not read as a pass
        raise CouldNotRun(f"nothing compared: no arm timing of this report has a baseline under {baselines}")
    raise typer.Exit(int(ExitCode.OK if result.passed else ExitCode.FAILED))


@baseline_app.command("show")
@_guarded
def baseline_show(
    gate_names: Annotated[Optional[list[str]], typer.Argument(help="Gates to show; default: every saved one.")] = None,
    baselines: Annotated[Path, typer.Option("--baselines", help="Baselines directory.")] = Path("baselines"),
    write: Annotated[Optional[Path], typer.Option(
        "--write", help="Write the pages under this directory (docs/results: `<machine>/<gate>.md` and an index) "
                        "instead of printing them; its pages of baselines that are gone are removed, and no other "
                        "file is touched.")] = None,
) -> None:
    """Render the saved figures as Markdown pages: per preset its runs, per case each contender's
    median ms in both timing modes, throughput, share of the ceiling, host time, spread."""
    from suite.harness.render import baseline_pages
    from suite.harness.store import unwritable, write_baseline_pages

    if not baselines.is_dir():
        raise UsageError(f"--baselines {baselines} is not a directory; pass the baselines directory")
    pages = baseline_pages(baselines, gate_names)
    if gate_names and len(pages) == 1:
        raise UsageError(f"no baseline under {baselines} for {', '.join(gate_names)}")
    if write is None:
        sys.stdout.write("\n".join(text for page, text in pages.items() if page != "README.md"))
        return
    if gate_names:
        raise UsageError("--write renders every baseline (the index lists them all); drop the gate names")
    try:
        write_baseline_pages(write, pages)
    except OSError as exc:
        raise unwritable("--write", write, exc) from exc
    console.print(f"wrote {len(pages)} pages under {write}", markup=False, highlight=False)


@checkpoint_app.command("verify")
@_guarded
def checkpoint_verify(
    directory: Annotated[Path, typer.Argument(help="A checkpoint directory.")],
) -> None:
    """Exit 0 when DIR is a whole checkpoint (its stamp, every file's size and sha256), 3 with one
    line saying what is wrong when it is not."""
    from suite.arms.checkpoint import read_stamp

    meta = read_stamp(directory, verify=True)
    console.print(f"{directory}: whole checkpoint of step {meta['step']} (format {meta['format_version']}, "
                  f"{len(meta['files'])} files verified)", soft_wrap=True)


@app.command("report")
@_guarded
def show_report(
    path: Annotated[Path, typer.Argument(help="report.json or its directory.")],
    fmt: Annotated[str, typer.Option("--format", help="md, json or junit.")] = "md",
) -> None:
    """Render a saved JSON report again."""
    from suite.harness.render import render_markdown, to_json
    from suite.harness.render_ci import render_junit
    from suite.harness.results import load_report

    renderers = {"md": render_markdown, "json": to_json, "junit": render_junit}
    if fmt not in renderers:
        raise UsageError(f"--format must be one of {', '.join(renderers)}, not {fmt!r}")
    loaded = load_report(_report_path(path, Path("reports")))
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
             "in_run_here": p in gate.default_presets(device, all_gates=True) and gate.missing() is None,
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
@_guarded
def list_gates(device: DeviceOpt = "auto", as_json: JsonOpt = False) -> None:
    """List gates (presets, summary), then their contenders and whether each runs here, or why not."""
    settings = _setup(device, None)
    import gates

    listing = [_gate_listing(g, settings.device) for g in gates.select("all")]
    if as_json:
        sys.stdout.write(json.dumps({"device": str(settings.device), "gates": listing}, indent=2) + "\n")
        return
    print_listing(listing, settings.device)


@app.command()
@_guarded
def env(device: DeviceOpt = "auto", as_json: JsonOpt = False) -> None:
    """Show this machine's fingerprint and what each gate is missing here."""
    settings = _setup(device, None)
    import gates
    from suite.harness.fingerprint import fingerprint

    fp = fingerprint(settings.device, settings.profile)
    rows = []
    for gate in gates.select("all"):
        missing = [f"{c.name}: {r}" for c in gate.contenders if (r := c.unavailable(settings.device))]
        lacks = gate.missing()  # an optional extra not installed
        can_gate = (settings.device.type == "cuda" or not gate.needs_cuda) and lacks is None
        if lacks is not None:
            missing.insert(0, lacks)
        elif not can_gate:
            missing.insert(0, "CUDA (the gate needs a GPU)")
        can_bench = bool(gate.benches) and (settings.device.type == "cuda" or all(b.modes == ("wall",) for b in gate.benches))
        if not can_bench:
            missing.append("CUDA for timing")
        rows.append({"gate": gate.name, "parity": can_gate, "bench": can_bench, "missing": missing})
    if as_json:
        sys.stdout.write(json.dumps({"fingerprint": fp.model_dump(), "gates": rows}, indent=2) + "\n")
        return
    print_environment(fp.model_dump(), rows)


if __name__ == "__main__":
    app()
