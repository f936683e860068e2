"""The report store: a run's report directory written atomically, and found again.

reports/<UTC start time>_<what>/ holds report.json (the source) and its renderings; it is
written into a hidden temporary directory and published by one rename, so an interrupted run
leaves the whole directory or none.
"""

from __future__ import annotations

import itertools
import json
import re
from datetime import datetime, timezone
from pathlib import Path

from suite.files import atomic
from suite.harness.render import render_markdown, to_json
from suite.harness.render_ci import render_junit, render_pytest_benchmark
from suite.harness.results import RunReport, slugify

REPORT_FILES = ("report.json", "report.md", "junit.xml", "benchmark.json")
# <UTC start>_<what>, and -<n> when that name was taken: runs that began in the same second
_NAME = re.compile(r"(\d{8}T\d{6}Z)_.*?(?:-(\d+))?")
_PROBE_BYTES = 1 << 16  # about a CPU run's report


def _utc_stamp(iso: str) -> str:
    """YYYYmmddTHHMMSSZ of the run's start, so directories sort by when runs began."""
    try:
        when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:  # a hand-made report; the time of writing is the next best name
        when = datetime.now(timezone.utc)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def check_writable(reports_dir: str | Path) -> None:
    """Raise OSError now, before any gate runs, if no report could be written under
    reports_dir: it is a file, read-only, or has no room for a report's worth of bytes."""
    with atomic.staging_directory(Path(reports_dir), "probe") as probe:
        atomic.write_bytes(probe / "probe", bytes(_PROBE_BYTES))


def write_report(report: RunReport, reports_dir: str | Path, what: str | None = None) -> Path:
    """Write report.json, report.md, junit.xml and benchmark.json as one directory
    reports_dir/<UTC start time>_<what slug>, published by one rename: an interrupted run
    leaves the whole directory or none. `what` defaults to report.what."""
    reports_dir = Path(reports_dir)
    contents = {
        "report.json": to_json(report),
        "report.md": render_markdown(report),
        "junit.xml": render_junit(report),
        "benchmark.json": json.dumps(render_pytest_benchmark(report), indent=4),
    }
    base = f"{_utc_stamp(report.started_utc)}_{slugify(what or report.what) or 'run'}"
    # hidden, and without '_', so no reader's glob for "<time>_<what>" can pick it up
    with atomic.staging_directory(reports_dir, slugify(report.run_id) or "run") as staged:
        for name in REPORT_FILES:
            atomic.write_bytes(staged / name, contents[name].encode("utf-8"))
        for n in itertools.count(1):
            final = reports_dir / (base if n == 1 else f"{base}-{n}")
            if final.exists():
                continue
            try:
                atomic.publish_directory(staged, final)
                return final
            except OSError:
                if not final.exists():
                    raise
                # another run took the name between the check and the rename; try the next


def _newest_last(path: Path) -> tuple:
    """Runs in the order they were written: start second, then the time report.json was
    written, then the -n a name taken in the same second got (file times can tie)."""
    match = _NAME.fullmatch(path.name)
    stamp, n = (match.group(1), int(match.group(2) or 1)) if match else ("", 0)
    return stamp, (path / "report.json").stat().st_mtime_ns, n, path.name


def list_reports(reports_dir: str | Path) -> list[Path]:
    """Complete report directories, oldest first; temp dirs of unfinished writes are not reports."""
    reports_dir = Path(reports_dir)
    if not reports_dir.is_dir():
        return []
    runs = [
        p for p in reports_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / "report.json").is_file()
    ]
    return sorted(runs, key=_newest_last)
