"""What the CLI prints: a run's summary, the gate listing and the environment, as tables on a
terminal and, into a pipe or a CI log, as plain rows of one line each that `grep` keeps whole."""

from __future__ import annotations

import sys
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from suite.errors import ExitCode

console = Console()
err = Console(stderr=True)


def print_summary(report) -> None:
    """A run's results: a table on a terminal, plain rows into a pipe, then each reason."""
    title = f"suite {report.what}: exit {report.exit_code} ({ExitCode(report.exit_code).name.lower()}) in {report.duration_s:.0f} s"
    if not console.is_terminal:
        _print_summary_plain(report, title)
        return
    table = Table(title=title)
    longest = max([len(r.gate) for r in report.results] + [len(s.gate) for s in report.skipped] + [4])
    longest_preset = max([len(r.preset) for r in report.results] + [6])
    table.add_column("gate", no_wrap=True, min_width=longest)
    table.add_column("preset", no_wrap=True, min_width=longest_preset)
    for column in ("status", "s", "parity", "saboteurs", "bench"):
        table.add_column(column, overflow="fold")
    colours = {"passed": "green", "failed": "red", "could_not_run": "yellow", "ambiguous": "magenta", "skipped": "dim"}
    for r in report.results:
        status, seconds, parity, saboteurs, bench = _unit_row(r)
        table.add_row(r.gate, r.preset, f"[{colours[status]}]{status}[/]", seconds, parity, saboteurs, escape(bench))
    for s in report.skipped:
        table.add_row(s.gate, "-", "[dim]skipped[/]", "-", "-", "-", escape(s.reason))
    console.print(table)
    _print_reasons(report)


def _unit_row(r) -> tuple[str, str, str, str, str]:
    """A result's status, seconds, parity, saboteurs and bench, as the summary shows them."""
    from suite.harness.render import bench_summary

    parity = "-" if r.parity is None else ("pass" if r.parity.passed else "FAIL")
    caught = sum(s.caught for s in r.saboteurs)
    saboteurs = f"{caught}/{len(r.saboteurs)} caught" if r.saboteurs else "-"
    bench = bench_summary(r) if r.parity else (r.reason or "")
    return r.status, f"{r.duration_s:.0f}", parity, saboteurs, bench


def _print_summary_plain(report, title: str) -> None:
    """The summary into a pipe or a CI log: one line a row, never wrapped at 80 columns, so
    `suite run | grep GATE` keeps each of its rows whole."""
    from tabulate import tabulate

    rows = [(r.gate, r.preset, *_unit_row(r)) for r in report.results]
    rows += [(s.gate, "-", "skipped", "-", "-", "-", s.reason) for s in report.skipped]
    sys.stdout.write(f"{title}\n" + tabulate(rows, headers=("gate", "preset", "status", "s", "parity", "saboteurs",
                                                            "bench"), tablefmt="plain") + "\n")
    _print_reasons(report)


def _print_reasons(report) -> None:
    for r in report.results:
        where = f"[bold]{escape(r.gate)} {escape(f'[{r.preset}]')}[/]"
        if r.status != "passed" and r.reason:
            console.print(f"{where}: {escape(r.reason)}", soft_wrap=True)  # one line, as a log greps it
        if r.buffers is not None and r.buffers.source == "loaded" and r.saboteurs_note:
            console.print(f"{where} saboteurs: {escape(r.saboteurs_note)}", soft_wrap=True)  # why none ran on the user's buffers


def print_tracebacks(report, verbose: bool) -> None:
    """Where a gate raised: that the report keeps the traceback, or with --verbose the traceback."""
    raised = [r for r in report.results if r.traceback]
    if raised and not verbose:
        err.print("a gate raised unexpectedly: the report keeps its traceback, --verbose prints it here")
    for r in raised if verbose else []:
        err.print(f"traceback of {r.gate} [{r.preset}]:", markup=False, highlight=False)
        err.print(r.traceback.rstrip(), markup=False, highlight=False)


def names_table(title: str, names: dict[str, int], *others: str) -> Table:
    """A table whose name columns (column -> longest name in it) are never cut or wrapped."""
    table = Table(title=title)
    for column, longest in names.items():
        table.add_column(column, no_wrap=True, min_width=longest)
    for column in others:
        table.add_column(column, overflow="fold")  # wrapped, never cut
    return table


def print_listing(listing: list[dict], device) -> None:
    """`suite list`'s gates with their presets, then each contender and whether it runs here."""
    presets_of = {
        g["name"]: [f"{p['name']}{_where(p)}{' **' if p['in_run_here'] else ' *' if p['default_here'] else ''}"
                    for p in g["presets"]]
        for g in listing
    }
    if not console.is_terminal:
        _print_listing_plain(listing, presets_of, device)
        return
    gate_width = max(len(g["name"]) for g in listing)
    table = names_table(f"gates (device: {device})",
                        {"gate": gate_width, "presets": max(len(p) for names in presets_of.values() for p in names)},
                        "needs CUDA", "summary")
    for g in listing:
        table.add_row(escape(g["name"]), escape("\n".join(presets_of[g["name"]])),
                      "yes" if g["needs_cuda"] else "no", escape(g["summary"]))
    console.print(table)
    # one contender a row: a reason that wraps then stays in its own narrow column
    contenders = names_table("contenders", {"gate": gate_width, "contender": max(
        len(c["name"]) for g in listing for c in g["contenders"]), "role": len("reference")}, "here")
    for gate, name, role, here in _contender_rows(listing, device):
        contenders.add_row(escape(gate), escape(name), role, escape(here))
    console.print(contenders)
    console.print(LIST_LEGEND)


LIST_LEGEND = ("* = run by default on this device by `suite gate/bench NAME`; ** = by `suite run` too; "
               "GiB = the GPU memory a preset needs (a run refuses it where less is free)")


def _where(preset: dict) -> str:
    if preset["where"] == "any":
        return ""
    need = preset["memory_bytes"]
    return f" (cuda, {need / 2**30:.1f} GiB)" if need else " (cuda)"


def _contender_rows(listing: list[dict], device) -> Iterator[tuple[str, str, str, str]]:
    for g in listing:
        timing_here = device.type == "cuda" or all(set(b["modes"]) == {"wall"} for b in g["benches"])
        for c in g["contenders"]:
            here = (f"unavailable: {c['unavailable']}" if c["unavailable"] else "yes" if timing_here
                    else "gate needs CUDA" if g["needs_cuda"] else "no timing without CUDA")
            yield g["name"], c["name"], c["role"], here


def _print_listing_plain(listing: list[dict], presets_of: dict[str, list[str]], device) -> None:
    """`suite list` into a pipe: one line a row, never wrapped, so `suite list | grep GATE`
    keeps each of its rows whole."""
    from tabulate import tabulate

    gates_rows = [(g["name"], ", ".join(presets_of[g["name"]]), "yes" if g["needs_cuda"] else "no", g["summary"])
                  for g in listing]
    sys.stdout.write(tabulate(gates_rows, headers=("gate", "presets", "needs CUDA", "summary"), tablefmt="plain")
                     + "\n\n")
    sys.stdout.write(tabulate(list(_contender_rows(listing, device)), headers=("gate", "contender", "role", "here"),
                              tablefmt="plain") + "\n\n" + LIST_LEGEND + "\n")


def print_environment(fingerprint: dict, rows: list[dict]) -> None:
    """`suite env`: this machine's fingerprint, then what each gate lacks here."""
    if not console.is_terminal:
        from tabulate import tabulate

        gate_rows = [(r["gate"], "yes" if r["parity"] else "no", "yes" if r["bench"] else "no",
                      "; ".join(r["missing"]) or "-") for r in rows]
        sys.stdout.write(tabulate(list(fingerprint.items()), headers=("what", "value"), tablefmt="plain") + "\n\n"
                         + tabulate(gate_rows, headers=("gate", "parity", "bench", "missing"), tablefmt="plain")
                         + "\n")
        return
    table = Table(title="environment")
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in fingerprint.items():
        table.add_row(key, escape(str(value)))
    console.print(table)
    gates_table = names_table("gates on this machine", {"gate": max(len(r["gate"]) for r in rows)},
                              "parity", "bench", "missing")
    for row in rows:
        gates_table.add_row(escape(row["gate"]), "yes" if row["parity"] else "no", "yes" if row["bench"] else "no",
                            escape("\n".join(row["missing"]) or "-"))
    console.print(gates_table)
