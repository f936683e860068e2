"""The report store: a run's report directory written atomically, and found again.

reports/<UTC start time>_<what>/ holds report.json (the source) and its renderings; it is
written into a hidden temporary directory and published by one rename, so an interrupted run
leaves the whole directory or none.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from suite.harness.render import render_junit, render_markdown, render_pytest_benchmark, to_json
from suite.harness.results import RunReport, slugify

REPORT_FILES = ("report.json", "report.md", "junit.xml", "benchmark.json")
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600  # a temp dir this old belongs to a run that died; the next write removes it


def _utc_stamp(iso: str) -> str:
    """YYYYmmddTHHMMSSZ of the run's start, so directories sort by when runs began."""
    try:
        when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:  # a hand-made report; the time of writing is the next best name
        when = datetime.now(timezone.utc)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _remove_stale_tmp(reports_dir: Path) -> None:
    cutoff = time.time() - STALE_TMP_S
    for leftover in reports_dir.glob(TMP_PREFIX + "*"):
        try:
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # another writer removed it first


def _write_file(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        # on disk before the rename publishes the directory, so a power cut cannot leave a
        # complete-looking directory of empty files
        os.fsync(fh.fileno())


def write_report(report: RunReport, reports_dir: str | Path, what: str | None = None) -> Path:
    """Write report.json, report.md, junit.xml and benchmark.json as one directory
    reports_dir/<UTC start time>_<what slug>, published by one rename: an interrupted run
    leaves the whole directory or none. `what` defaults to report.what."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(reports_dir)
    # hidden, and without '_', so no reader's glob for "<time>_<what>" can pick it up
    tmp = reports_dir / f"{TMP_PREFIX}{slugify(report.run_id) or 'run'}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        contents = {
            "report.json": to_json(report),
            "report.md": render_markdown(report),
            "junit.xml": render_junit(report),
            "benchmark.json": json.dumps(render_pytest_benchmark(report), indent=4),
        }
        for name in REPORT_FILES:
            _write_file(tmp / name, contents[name])
        base = f"{_utc_stamp(report.started_utc)}_{slugify(what or report.what) or 'run'}"
        for n in itertools.count(1):
            final = reports_dir / (base if n == 1 else f"{base}-{n}")
            if final.exists():
                continue
            try:
                os.rename(tmp, final)
                return final
            except OSError:
                if not final.exists():
                    raise
                # another run took the name between the check and the rename; try the next
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_reports(reports_dir: str | Path) -> list[Path]:
    """Complete report directories, oldest first; temp dirs of unfinished writes are not reports."""
    reports_dir = Path(reports_dir)
    if not reports_dir.is_dir():
        return []
    return sorted(
        p for p in reports_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / "report.json").is_file()
    )
