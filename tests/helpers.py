"""Helpers for gpuclean's own tests: real processes, pidfiles, inner pytest sessions in subprocesses.

A plain module (``pythonpath = ["tests"]`` in pyproject.toml puts it on ``sys.path``), so that the tests
import it under every ``--import-mode``; the fixtures that use it are in conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

HOLD = [sys.executable, "-m", "pytest_gpuclean.simulate", "hold"]
INNER_TIMEOUT = 180
TEST_TIMEOUT_S = 600
"""pytest-timeout's limit for each of these tests (conftest.py), unless the test or the command line
(``--timeout``, ``PYTEST_TIMEOUT``) says otherwise: not ``timeout`` in pyproject.toml, whose key would warn
in every run of an environment without pytest-timeout (README's first minute, in this checkout)."""
EXAMPLES = Path(__file__).resolve().parent / "examples"
"""The inner suites and the scripts they start (``pytester_example_dir``)."""


def copy_example(name: str, into: Path) -> Path:
    """``pytester.copy_example`` into a directory of one's own (a folder's files, or a file): the copy."""
    source = EXAMPLES / name
    if source.is_dir():
        shutil.copytree(source, into, dirs_exist_ok=True)
        return into
    return Path(shutil.copy(source, into / source.name))


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie does not count: it holds nothing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exec_done(proc: subprocess.Popen[Any], timeout: float = 10.0) -> subprocess.Popen[Any]:
    """``proc`` once /proc shows its command line and environment. ``Popen`` returns when the exec closed
    its error pipe, but the kernel sets the new program's argument and environment bounds only after that
    (``create_elf_tables``): a read of /proc/<pid>/environ in between finds it empty, and a check that
    looks for the test's cookie there finds none (a CI run failed so). For a process started from an argument
    list, with an environment that is not empty."""
    argv = proc.args
    assert isinstance(argv, (list, tuple)), f"exec_done needs an argument list, not {argv!r}"
    wanted = b"".join(os.fsencode(a) + b"\0" for a in argv)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if (Path(f"/proc/{proc.pid}/cmdline").read_bytes() == wanted
                    and Path(f"/proc/{proc.pid}/environ").read_bytes()):
                return proc
        time.sleep(0.001)
    raise AssertionError(f"{argv} did not start within {timeout}s")


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until every pid is gone; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        living = [p for p in pids if alive(p)]
        if not living:
            return []
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def read_pids(path: Path, expected: int = 1, timeout: float = 60.0) -> list[int]:
    """Pids appended to ``path`` by holders (``--pidfile``), waiting until ``expected`` are there (up to 60 s:
    on a 2-core box at load 15 a holder once took more than 15 s to start and write its pid)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) >= expected:
                return pids
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {expected} pids after {timeout}s")


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def owner_uid(pid: int) -> int | None:
    """Real uid of ``pid`` (None if gone)."""
    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.Error:
        return None


def reap_orphans(pids: list[int]) -> None:
    """Collect the exit status of those ``pids`` that were re-parented to this (subreaper) process."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@contextlib.contextmanager
def pytest_behind_older_processes(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                  script: str, before: str = "") -> Iterator[tuple[pytest.RunResult, Path]]:
    """``<older process> & exec pytest``: a shell starts the example ``script`` (``OLDER_PIDS`` and
    ``OLDER_GO`` tell it where to write its pids and when to act), then becomes the inner pytest, which
    inherits it as a child from before the session. ``before``: shell commands to run first (``{pids}``: the
    pid file). Yields the run's result and the pid file; everything it names is killed and collected after."""
    older_pids, go = tmp_path / "older.pids", tmp_path / "go"
    path = pytester.copy_example(script)
    monkeypatch.setenv("OLDER_PIDS", str(older_pids))
    monkeypatch.setenv("OLDER_GO", str(go))
    python = sys.executable
    shell = (f"{before.format(pids=older_pids)}{python} {path} {older_pids} {go} & "
             f"exec {python} -m pytest -p gpuclean -p no:cacheprovider -rA")
    try:
        yield pytester.run("sh", "-c", shell, timeout=120), older_pids
    finally:
        left = [int(x) for x in older_pids.read_text().split()] if older_pids.exists() else []
        kill_all(left)
        wait_dead(left)
        reap_orphans(left)  # re-parented to this process if it is a subreaper


def wait_for_file(path: Path, proc: subprocess.Popen[Any], timeout: float = 30, *, empty_ok: bool = False,
                  output: Callable[[], str] | None = None) -> str:
    """The text of ``path`` once it exists and (unless ``empty_ok``) holds something. Fails at once, with what
    ``proc`` printed (``output``, by default its stdout pipe), if that process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and ((text := path.read_text()) or empty_ok):
            return text
        if proc.poll() is not None:
            printed = output() if output is not None else proc.communicate()[0]
            pytest.fail(f"session ended before writing {path.name}:\n{printed}")
        time.sleep(0.02)
    raise AssertionError(f"{path} not written after {timeout}s")


@contextlib.contextmanager
def children_sigint(ignored: bool = False) -> Iterator[None]:
    """Processes started inside get SIGINT at its default, as a pytest run from a terminal has it (or
    ignored, with ``ignored``), whatever this session inherited. A shell starts a background job (``cmd &``,
    ``nohup``) with SIGINT ignored; an ignored signal stays ignored across exec, and Python then installs no
    KeyboardInterrupt handler: an inner pytest would shrug off the Ctrl-C a test sends it. (Main thread only;
    this process's own SIGINT is set for the few microseconds of the spawn.)"""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


NOBODY_UID = 65534


def unprivileged(command: list[str]) -> list[str]:
    """``command`` as user nobody where this runs as root (root passes every permission check, so a
    directory of mode 000 stops only another user), else as it is. Skips the test where that cannot be:
    no ``setpriv``, or nobody cannot run this interpreter with gpuclean (a checkout under root's home)."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv to run a command as user nobody")
    prefix = [setpriv, f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import pytest, pytest_gpuclean.plugin"],
                           cwd="/", capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run {sys.executable} with gpuclean: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return [*prefix, *command]


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without gpuclean's and pytest's settings (the session's cookie kept: what
    a command starts stays this session's), plus ``extra``."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("GPUCLEAN_", "PYTEST_")) or name == "GPUCLEAN_TEST"}
    env.update(extra)
    return env


def summary_of(result: pytest.RunResult) -> list[str]:
    """The lines of gpuclean's terminal summary section."""
    lines = result.outlines
    starts = [i for i, line in enumerate(lines) if line.startswith("=") and " gpuclean " in line]
    assert starts, "no gpuclean summary"
    section: list[str] = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("="):
            break
        section.append(line)
    return section


def marked_line(path: Path, function: str) -> int:
    """The 1-based line pytest reports for ``function``: its first decorator's."""
    lines = path.read_text().splitlines()
    index = lines.index(f"def {function}():")
    while index > 0 and lines[index - 1].startswith("@"):
        index -= 1
    return index + 1


def isolate_inner_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner sessions a test starts see nothing of the run the test is part of: under an outer ``-n``,
    they and the holders started here would inherit the outer run's id, and the checker would excuse those
    holders as sibling xdist workers of its own run; on GitHub Actions they would annotate that job."""
    for name in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "GITHUB_WORKSPACE", "PYTEST_XDIST_TESTRUNUID",
                 "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)


def run_inner(pytester: pytest.Pytester, *args: str, timeout: float = INNER_TIMEOUT) -> pytest.RunResult:
    """An inner pytest session with gpuclean, in a subprocess (signals, children and kills stay there)."""
    return pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", *args,
                                         timeout=timeout)


# What an inline inner module starts with (the ``inner`` fixture copies prelude.py next to it).
INNER_PRELUDE = """
import os, subprocess, sys, time
import pytest
from prelude import PIDFILE, SIM, hold, wait_holders
"""


def _identity(process: dict[str, Any]) -> tuple[int, int]:
    return process["pid"], process["start_ticks"]


def assert_report_consistent(document: dict[str, Any], summary: list[str] | None = None) -> None:
    """Whatever a JSON report (``--gpuclean-report``) found, its ``summary`` says the same as its records:
    each count equals the count derived from the per-test records (and the fixtures, and what the session's
    end reaped); every process left behind is listed once; every fixture is reported at a test the report
    lists. With ``summary`` (the terminal summary's lines, ``summary_of``), its totals line says the same."""
    tests, counts = document["tests"], document["summary"]
    outcomes = [t["outcome"] for t in tests]
    checks = [c for t in tests for c in (t["before"], t["after"], t.get("cluster_before"),
                                         t.get("cluster_after")) if c]
    # A process reaped more than once is counted once: where it was ended.
    reaped = {_identity(r["process"]) for c in checks for r in c["reaped"]}
    reaped |= {_identity(r["process"]) for t in tests for r in t["found_later"]}
    reaped |= {_identity(r["process"]) for f in document.get("fixtures", []) for r in f["reaped"]}
    reaped |= {_identity(r["process"]) for r in document["session_reaped"]}
    derived = {
        "tests": len(tests),
        "checked": sum(1 for t in tests if t["before"] is not None),
        "with_findings": sum(1 for t in tests if t["findings"]),
        "clean": outcomes.count("clean"), "leaked": outcomes.count("leaked"),
        "not_clean": outcomes.count("not_clean"), "gpu_fault": outcomes.count("gpu_fault"),
        "reaped": len(reaped),
        "lock_timeouts": sum(1 for t in tests if t["lock_timeout"] is not None),
        "fixture_leaks": len(document.get("fixtures", [])),
        "device_errors": sum(1 for t in tests if any(c is not None and c["error"] is not None
                                                     for c in (t["before"], t["after"]))),
        "dirty_from_outside": sum(1 for t in tests if t.get("outside_action") is not None),
    }
    without_lock = sum(1 for t in tests if t.get("gpu_without_lock"))
    if without_lock:
        derived["gpu_without_lock"] = without_lock
    assert {k: counts.get(k) for k in derived} == derived, (counts, derived)
    assert len({t["nodeid"] for t in tests}) == len(tests), "a test listed twice"
    for t in tests:
        # (a test that GPUs holding only a known, unreaped leak kept from running is noticed, not at fault)
        blocked = bool(t.get("blocked_by")) and t["after"] is None and t["outcome"] == "not_clean"
        assert t["findings"] is ((t["outcome"] in ("leaked", "not_clean", "gpu_fault") and not blocked)
                                 or bool(t["in_process_mib"]) or bool(t.get("gpu_without_lock"))), t
    left = [(p["pid"], p["owner"]) for t in tests for p in t["leaked"]]
    left += [(p["pid"], p["owner"]) for f in document.get("fixtures", []) for p in f["leaked"]]
    assert len({pid for pid, _ in left}) == len(left), f"a process listed as left behind twice: {left}"
    nodeids = {t["nodeid"] for t in tests}
    assert all(f["reported_on"] in nodeids for f in document.get("fixtures", [])), document.get("fixtures")
    if summary is not None:
        # (the last line of gpuclean's own, before any GitHub annotation)
        totals = next(line for line in reversed(summary) if " checked test(s), " in line)
        assert totals.startswith(f"{derived['checked']} checked test(s), {derived['with_findings']} with "
                                 "findings"), (totals, derived)
        assert f", {derived['reaped']} process(es) reaped" in totals, (totals, derived)
        fixtures = derived["fixture_leaks"]
        assert (f", {fixtures} fixture(s) that leaked processes" in totals) is bool(fixtures), totals
