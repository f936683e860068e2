"""Exit codes and the errors that map onto them (README: "Exit codes")."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # every gate ran and passed
    FAILED = 1  # a gate failed: parity, determinism, anti-cheat or performance
    USAGE = 2  # bad command line: unknown gate or preset, bad option
    COULD_NOT_RUN = 3  # no CUDA for a CUDA gate, OOM, compile error, bad buffers
    AMBIGUOUS = 4  # timing stayed ambiguous against the noise floor
    INTERRUPTED = 130  # stopped by SIGINT, SIGTERM or SIGHUP (the shell's 128 + SIGINT)


class SuiteError(Exception):
    """An error the CLI reports as one clear message with its exit code."""

    exit_code = ExitCode.COULD_NOT_RUN


class UsageError(SuiteError, ValueError):
    """A bad argument: the CLI's exit 2, and for a library call a ValueError naming it."""

    exit_code = ExitCode.USAGE


class CouldNotRun(SuiteError):
    exit_code = ExitCode.COULD_NOT_RUN


class BadBuffers(CouldNotRun):
    """A buffer directory that is corrupt or does not match the gate and preset."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like SIGINT's KeyboardInterrupt so that the same cleanup runs."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def combine(statuses: list[str]) -> ExitCode:
    """One exit code for a run: a failure outranks could-not-run, which outranks ambiguous."""
    if "failed" in statuses:
        return ExitCode.FAILED
    if "could_not_run" in statuses:
        return ExitCode.COULD_NOT_RUN
    if "ambiguous" in statuses:
        return ExitCode.AMBIGUOUS
    return ExitCode.OK
