"""The suite's subprocesses: the command line (``python -m example_suite.extract``) and inner pytest sessions
under gpuclean, each followed by reaping the orphans it left to us."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from example_suite.reaping import orphans_reaped

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 600  # an offline run starts an engine: 15-60 s on 2 busy CPU cores, ~70 s on an H200


@dataclass(frozen=True)
class CliRun:
    """Exit status and output (stdout and stderr together) of a command-line run."""

    returncode: int
    output: str


def run_cli(arguments: list[str], log_path: Path, timeout_s: float = CLI_TIMEOUT_S) -> CliRun:
    """``python -m example_suite.extract ARGS`` in a subprocess, its output to a file (never a pipe)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    with log_path.open("wb") as log, orphans_reaped():
        completed = subprocess.run(
            [sys.executable, "-m", "example_suite.extract", *arguments],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    return CliRun(completed.returncode, log_path.read_text(errors="replace"))


INNER_TIMEOUT_S = 420  # an inner session starts one engine or server: 15-110 s on 2 busy CPU cores
# An inner test still running after this long dumps every thread's stack into its output (and goes on): a
# hang then leaves something to read, well before the timeout above ends it.
INNER_STACKS_AFTER_S = 240


def run_inner_session(pytester: pytest.Pytester) -> pytest.RunResult:
    """Run the inner test file under gpuclean in a subprocess; reap its orphaned zombies afterwards.

    ``runpytest_subprocess`` sends the inner output to files, not pipes: a leaked EngineCore inherits the
    inner session's stdout/stderr and could otherwise keep us waiting for EOF forever (seen on an H200 when
    the suite was written).
    """
    with orphans_reaped():
        try:
            return pytester.runpytest_subprocess(
                "-p", "gpuclean", "-v", "-p", "no:cacheprovider",
                "-o", f"faulthandler_timeout={INNER_STACKS_AFTER_S}",
                timeout=INNER_TIMEOUT_S,
            )  # fmt: skip
        except pytester.TimeoutExpired:
            # Show what the inner session had printed: otherwise a hang leaves nothing to go on.
            printed = [(pytester.path / name) for name in ("stdout", "stderr")]
            tails = "\n".join(p.read_text(errors="replace")[-6000:] for p in printed if p.exists())
            pytest.fail(f"inner session still running after {INNER_TIMEOUT_S}s; it printed:\n{tails}")
