"""The report store: a run's report directory written atomically, and found again.

reports/<UTC start time>_<what>/ holds report.json (the source) and its renderings; it is
written into a hidden temporary directory and published by one rename, so an interrupted run
leaves the whole directory or none.
"""

from __future__ import annotations

import errno
import itertools
import json
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from suite.errors import CouldNotRun, SuiteError, UsageError
from suite.files import atomic
from suite.harness.render import WRITTEN_BY, render_markdown, to_json
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


def check_writable(reports_dir: str | Path, option: str = "--reports") -> None:
    """Refuse now, before any gate runs, a reports_dir (given as `option`) under which no
    report could be written: it is a file, read-only, or has no room for a report's bytes."""
    try:
        with atomic.staging_directory(Path(reports_dir), "probe") as probe:
            atomic.write_bytes(probe / "probe", bytes(_PROBE_BYTES))
    except OSError as exc:
        raise unwritable(option, Path(reports_dir), exc) from exc


# a write that failed for lack of room could not run; one to a path that cannot be written
# (a file, read-only, no permission) is a bad option
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EIO}


def unwritable(option: str, path: Path, exc: OSError) -> SuiteError:
    """The error for an output directory `option` that cannot be written, naming why."""
    # the nearest existing ancestor: where a path "exists" as a file, mkdir only says EEXIST
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if path.is_file():
        reason = "it is a file, not a directory"
    elif existing is not None and not existing.is_dir():
        reason = f"{existing} is a file, not a directory"
    else:
        reason = exc.strerror or str(exc)
    if exc.errno in _NO_ROOM:
        return CouldNotRun(f"cannot write {option} {path}: {reason}; free space there or pass another {option}")
    return UsageError(f"cannot write {option} {path}: {reason}; pass {option} a directory you can write to")


def save_report(report: RunReport, reports_dir: str | Path, what: str | None = None) -> tuple[Path | None, str | None]:
    """`write_report` under reports_dir or, when that fails at the end of a run (the disk filled
    meanwhile), into a temporary directory, so the figures are kept: -> (where it went, None if
    nowhere; what to tell the user about it, None if all went as asked)."""
    try:
        return write_report(report, reports_dir, what), None
    except OSError as exc:
        first = exc.strerror or str(exc)
    try:
        path = write_report(report, Path(tempfile.mkdtemp(prefix="suite-reports-")), what)
    except OSError as exc:
        return None, (f"cannot write the report under {reports_dir} ({first}) nor into a temporary directory "
                      f"({exc.strerror or exc}); the summary is all that is kept")
    return path, f"cannot write the report under {reports_dir} ({first}); wrote it to {path} instead"


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


def _written_by_us(path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return any(WRITTEN_BY in fh.readline() for _ in range(5))


def write_baseline_pages(directory, pages: dict[str, str]) -> None:
    """`pages` written under `directory`, and its pages of baselines that are gone removed. Only
    pages this function wrote (they say so near their top) are replaced or removed: a directory
    of other Markdown (`--write docs` for docs/results) is refused before anything is written,
    and other files are left as they are. OSError from the disk passes through."""
    root = Path(directory)
    foreign = [p for p in (root / page for page in pages) if p.is_file() and not _written_by_us(p)]
    if foreign:
        raise UsageError(f"--write {root}: {foreign[0]} is not a page `suite baseline show` wrote, and --write never "
                         f"replaces one ({len(foreign)} such); pass the results directory (docs/results) or a new one")
    for stale in root.glob("*/*.md"):
        if str(stale.relative_to(root)) not in pages and _written_by_us(stale):
            stale.unlink()
    for page, text in pages.items():
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        (root / page).write_text(text, encoding="utf-8")
