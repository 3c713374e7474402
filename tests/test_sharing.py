"""Sharing GPUs: concurrent sessions, killed holders, xdist, lock timeouts, pytest-timeout.

Every session here is a real pytest process over simulated devices, with its own lock directory under
``tmp_path``. Tests record when they ran on which GPU; "no overlap" is checked on those intervals.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    EXAMPLES,
    alive,
    children_sigint,
    copy_example,
    read_pids,
    run_inner,
    wait_dead,
    wait_for_file,
)

from pytest_gpuclean._locks.gpus import GpuLocks, LockTimeout
from pytest_gpuclean._locks.held import HELD_VAR
from pytest_gpuclean._model.records import LockHolder
from pytest_gpuclean._reading.simulated import SimulatedBackend
from pytest_gpuclean.report import jsonreport
from pytest_gpuclean.report.terminal import LEAK_PREFIX, NOT_CLEAN_PREFIX

SESSION_TIMEOUT = 120
"""A session that runs longer than this is deadlocked (they take a few seconds)."""


class Sessions:
    """Inner pytest sessions started with Popen (so several run at once); all killed at the end."""

    def __init__(self, sim: Path, lock_dir: Path, suite: Path) -> None:
        self.sim, self.lock_dir, self.suite = sim, lock_dir, suite
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str, **env: str) -> subprocess.Popen[str]:
        # (GPUCLEAN_DEAD_SESSIONS as ``sim`` or ``dead_sessions_on`` set it: conftest.py says why.)
        environ = {k: v for k, v in os.environ.items()
                   if (not k.startswith(("PYTEST_", "GPUCLEAN_")) or k == "GPUCLEAN_DEAD_SESSIONS")
                   and k != "CUDA_VISIBLE_DEVICES"}
        environ.update(env, PYTHONDONTWRITEBYTECODE="1")
        with children_sigint():  # a test interrupts a session with SIGINT
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider", "-rA",
                 f"--gpuclean-simulate={self.sim}", f"--gpuclean-lock-dir={self.lock_dir}", *args],
                cwd=self.suite, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.started.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen[str], timeout: float = SESSION_TIMEOUT) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"session {proc.args!r} still running after {timeout}s (deadlock?):\n{out}")
        return proc.returncode, out

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture
def sessions(sim: Path, tmp_path: Path) -> Iterator[Sessions]:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")  # this directory is the rootdir, whatever is above
    started = Sessions(sim, tmp_path / "locks", suite)
    try:
        yield started
    finally:
        started.kill_all()


def uuids_of(sim: Path) -> list[str]:
    return [d.uuid for d in SimulatedBackend(sim).devices()]


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def overlaps(events: list[dict[str, Any]]) -> list[str]:
    """Pairs of tests that ran on one GPU at the same time."""
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for event in events:
        for uuid in event["visible"].split(","):
            spans[uuid].append((event["start"], event["end"], f"{event['session']} {event['test']}"))
    found = []
    for uuid, items in spans.items():
        items.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(items):
            if start < end:
                found.append(f"{uuid}: {first} and {second}")
    return found


def validate_report(document: Any) -> None:
    import jsonschema  # type: ignore[import-untyped]

    jsonschema.Draft202012Validator(jsonreport.load_schema()).validate(document)


def collect(pid: int) -> None:
    """Kill ``pid`` and, if it was re-parented to us (our subreaper), collect its zombie."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    assert not wait_dead([pid])


# ---- concurrent sessions --------------------------------------------------------------------------

def test_four_sessions_share_two_gpus_without_overlap(sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    copy_example("sharing/intervals.py", sessions.suite)
    copy_example("sharing/four_sessions", sessions.suite)
    procs = [sessions.start("test_shared.py", SHARING_EVENTS=str(events), SESSION_TAG=f"s{i}")
             for i in range(4)]
    for proc in procs:
        rc, out = sessions.finish(proc)
        assert rc == 0, out
        assert "5 passed" in out, out
    recorded = read_events(events)
    assert len(recorded) == 16
    gpus = set(uuids_of(sim))
    for event in recorded:
        assert event["visible"] in gpus, event  # exactly one UUID, one of the two
        assert event["visible_at_end"] == event["visible"], event
    assert not overlaps(recorded)
    # Everything was released: no session left a holder record behind.
    assert all(not p.read_text().strip() for p in (tmp_path / "locks").glob("*.holder"))


def test_sigkilled_session_frees_its_gpus(sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    holding, release = tmp_path / "holding", tmp_path / "release"
    copy_example("sharing/test_hold.py", sessions.suite)
    copy_example("sharing/after_kill", sessions.suite)  # conftest.py, test_after.py
    holder = sessions.start("test_hold.py", HOLDING=str(holding), RELEASE=str(release))
    assert int(wait_for_file(holding, holder)) == holder.pid
    locks = GpuLocks(str(tmp_path / "locks"))
    for uuid in uuids_of(sim):
        recorded = locks.holder(uuid)
        assert recorded is not None and recorded.pid == holder.pid
        assert recorded.test == "test_hold.py::test_hold"
    holder.send_signal(signal.SIGKILL)  # no teardown, no release: only the kernel frees the locks
    holder.wait()

    rc, out = sessions.finish(sessions.start("test_after.py", "-s", "--gpuclean-lock-timeout=30",
                                             LOCK_DIR=str(tmp_path / "locks")))
    assert rc == 0, out
    waited = float(out.split("WAITED ")[1].split()[0])
    assert waited < 15, f"waited {waited:.1f}s for locks a dead session held\n{out}"


def test_lock_timeout_names_the_holder_and_is_a_finding(sessions: Sessions, sim: Path,
                                                        tmp_path: Path) -> None:
    holding, release = tmp_path / "holding", tmp_path / "release"
    report_file, step_summary = tmp_path / "report.json", tmp_path / "summary.md"
    copy_example("sharing/test_hold.py", sessions.suite)
    copy_example("sharing/test_wants_one.py", sessions.suite)
    holder = sessions.start("test_hold.py", HOLDING=str(holding), RELEASE=str(release))
    wait_for_file(holding, holder)
    rc, out = sessions.finish(sessions.start(
        "test_wants_one.py", "--gpuclean-lock-timeout=1", f"--gpuclean-report={report_file}",
        GITHUB_ACTIONS="true", GITHUB_STEP_SUMMARY=str(step_summary)))
    release.touch()
    holder_rc, holder_out = sessions.finish(holder)
    assert holder_rc == 0, holder_out
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "1 error" in out.splitlines()[-1], out
    # Busy GPUs are listed in lock order (by UUID).
    busy = "; ".join(f"{uuid}: pid {holder.pid} (user *) on * running test_hold.py::test_hold, for *s"
                     for uuid in sorted(uuids_of(sim)))
    matcher = pytest.LineMatcher(out.splitlines())
    matcher.fnmatch_lines([
        f"gpuclean: test_wants_one.py::test_wants_one waits for GPU lock(s) held by: {busy}",
        "gpuclean: test_wants_one.py::test_wants_one gave up waiting for GPU lock(s) after 1.*s",
        f"*gpuclean: could not lock the GPUs: waited 1.*s for 1 of 2 GPU lock(s); held by: {busy}",
    ])
    # A finding everywhere: the summary, the JSON report (with the real wait), an annotation, the job
    # summary.
    matcher.fnmatch_lines([
        "*= gpuclean =*",
        "test_wants_one.py::test_wants_one: never got its GPU locks: waited 1.*s for 1 of 2 GPU lock(s)*",
        "0 checked test(s), 0 with findings, 0 process(es) reaped, 1 gave up waiting for GPU locks",
        "::error file=test_wants_one.py,line=*,title=GPU lock timeout::test_wants_one.py::test_wants_one "
        "never got its GPU locks: waited 1.*s*",
    ])
    document = json.loads(report_file.read_text())
    (test,) = document["tests"]
    assert test["lock_timeout"].startswith("waited 1.") and f"pid {holder.pid}" in test["lock_timeout"]
    assert test["timings"]["lock_wait_s"] >= 1.0
    assert document["summary"]["lock_timeouts"] == 1
    summary = step_summary.read_text()
    assert "1 gave up waiting for GPU locks" in summary and "| lock timeout |" in summary
    assert "Every checked test found the GPUs clean" not in summary


def test_wait_lines_reach_the_terminal_while_waiting(sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    holding, release = tmp_path / "holding", tmp_path / "release"
    copy_example("sharing/test_hold.py", sessions.suite)
    copy_example("sharing/test_wants_one.py", sessions.suite)
    holder = sessions.start("test_hold.py", HOLDING=str(holding), RELEASE=str(release))
    wait_for_file(holding, holder)
    waiter = sessions.start("test_wants_one.py", "-v", "--gpuclean-lock-timeout=30")
    assert waiter.stdout is not None
    seen: list[str] = []
    # Read as it comes: the line must show while the session waits (not filed under "Captured stdout").
    while not any("waits for GPU lock(s)" in line for line in seen):
        line = waiter.stdout.readline()
        assert line, "the waiter ended without saying it waits:\n" + "".join(seen)
        seen.append(line)
    release.touch()
    rc, rest = sessions.finish(waiter)
    out = "".join(seen) + rest
    assert rc == 0, out
    assert sessions.finish(holder)[0] == 0
    pytest.LineMatcher(out.splitlines()).fnmatch_lines([
        "gpuclean: test_wants_one.py::test_wants_one waits for GPU lock(s) held by: GPU-*: pid "
        f"{holder.pid} (user *) on * running test_hold.py::test_hold, for *s; GPU-*",
        "gpuclean: test_wants_one.py::test_wants_one got GPU lock(s) GPU-* after *s",
        "test_wants_one.py::test_wants_one PASSED*",
    ])
    assert "Captured stdout" not in out
    assert out.count("waits for GPU lock(s)") == 1


# ---- a GPU's lock file and its waiters concern that GPU only ------------------------------------------

def test_a_free_gpu_does_not_wait_for_a_busy_one(sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    # The issue's case: a session holds GPU 0; GPU 1's lock file has never existed. The second session
    # makes it and runs at once: it does not wait until nobody holds any GPU in the directory.
    holding, ran = tmp_path / "holding", tmp_path / "ran"
    # test_hold.py, failing if RELEASE (here: the file the other session's test writes) never came
    copy_example("sharing/hold_until_ran", sessions.suite)
    copy_example("sharing/test_noop.py", sessions.suite)
    holder = sessions.start("test_hold.py", "--gpuclean-devices=0", HOLDING=str(holding), RELEASE=str(ran))
    wait_for_file(holding, holder)
    assert [p.name for p in (tmp_path / "locks").glob("*.lock")] == [f"{uuids_of(sim)[0]}.lock"]
    rc, out = sessions.finish(sessions.start("test_noop.py", "--gpuclean-devices=1",
                                             "--gpuclean-lock-timeout=10", RAN=str(ran)))
    assert rc == 0, out
    assert "waits for GPU lock" not in out, out
    holder_rc, holder_out = sessions.finish(holder)
    assert holder_rc == 0, holder_out  # it held GPU 0 all the while


def test_a_stream_of_tests_keeps_out_neither_another_gpu_nor_a_waiter(sessions: Sessions,
                                                                      tmp_path: Path) -> None:
    # Continuous load on GPU 0: tests back to back, the lock free only for the moment between two of them.
    # A session on GPU 1 (a lock file never made before) runs at once; a session that waits for GPU 0 gets
    # it once it has waited a second (the stream's next test lets it go first), not when the stream ends:
    # the stream lasts 30 s, longer than the waiter's lock timeout.
    streaming, stop, ran = tmp_path / "streaming", tmp_path / "stop", tmp_path / "ran"
    copy_example("sharing/test_stream.py", sessions.suite)
    copy_example("sharing/test_noop.py", sessions.suite)
    copy_example("sharing/test_waiter.py", sessions.suite)
    stream = sessions.start("test_stream.py", "-q", "--gpuclean-devices=0", STREAMING=str(streaming),
                            STOP=str(stop))
    wait_for_file(streaming, stream, empty_ok=True)
    waiter = sessions.start("test_waiter.py", "--gpuclean-devices=0", "--gpuclean-lock-timeout=20",
                            RAN=str(ran), STOP=str(stop))
    rc, out = sessions.finish(sessions.start("test_noop.py", "--gpuclean-devices=1",
                                             "--gpuclean-lock-timeout=20", RAN=str(ran)))
    assert rc == 0, out
    assert "waits for GPU lock" not in out, out
    rc, out = sessions.finish(waiter)
    assert rc == 0, out
    rc, out = sessions.finish(stream)
    assert rc == 0, out


def test_a_session_keeps_its_locks_between_its_tests_and_no_unchecked_test_runs_with_them(
        sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    # Between two tests the GPUs stay locked (nobody else waits for them), the records name each checked
    # test in turn; an unchecked test's setup lets them go (it runs with nothing locked), and so does the
    # setup of a test that needs other GPUs, and the end of the last test.
    events = tmp_path / "events.jsonl"
    copy_example("sharing/kept", sessions.suite)
    rc, out = sessions.finish(sessions.start("test_kept.py", LOCK_DIR=str(sessions.lock_dir),
                                             EVENTS=str(events)))
    assert rc == 0, out
    both = sorted(f"{u}.lock" for u in uuids_of(sim))
    seen = {(e.get("during") or e.get("between") or "end", "during" in e): e for e in read_events(events)}

    def between(test: str) -> list[str]:
        return list(seen[f"test_kept.py::{test}", False]["held"])

    def during(test: str) -> dict[str, Any]:
        return seen[f"test_kept.py::{test}", True]

    assert during("test_a")["held"] == both and between("test_a") == both  # kept: test_b is checked
    assert during("test_b")["records"] == ["test_kept.py::test_b"] * 2  # the records name each test
    assert between("test_b") == both  # kept for whatever follows: whether it is checked, its setup says
    assert during("test_unchecked")["held"] == [] and during("test_unchecked")["inherits"] is None
    assert between("test_unchecked") == []
    assert during("test_b")["inherits"] is not None  # (what a session it starts inherits)
    one = during("test_one")["held"]
    assert len(one) == 1 and between("test_one") == one and during("test_one_again")["held"] == one
    assert during("test_one_again")["records"] == ["test_kept.py::test_one_again"]
    assert f"{during('test_one_again')['visible']}.lock" == one[0]
    assert between("test_one_again") == one  # kept, though test_both needs one more
    assert during("test_both")["held"] == both
    assert during("test_both")["records"] == ["test_kept.py::test_both"] * 2
    assert between("test_both") == []  # the last test
    assert seen["end", False]["records"] == []  # every record released


def test_locks_kept_for_a_test_that_never_runs_are_let_go(sessions: Sessions, tmp_path: Path) -> None:
    # The session stops between test_first, whose teardown kept the locks for test_never_runs, and that
    # test (pytest.exit from a hook there, as a Ctrl-C would): the session's end lets them go. A record
    # left up would name a holder that is gone.
    events = tmp_path / "events.jsonl"
    copy_example("sharing/kept", sessions.suite)
    rc, out = sessions.finish(sessions.start("test_stops.py", LOCK_DIR=str(sessions.lock_dir),
                                             EVENTS=str(events), EXIT_AFTER="test_stops.py::test_first"))
    assert rc == pytest.ExitCode.INTERRUPTED, out
    assert "stopped between two tests" in out and "1 passed" in out, out
    recorded = read_events(events)
    assert recorded[1] == {"between": "test_stops.py::test_first", "held": recorded[0]["held"]}
    assert len(recorded[0]["held"]) == 2  # kept for test_never_runs
    assert recorded[-1] == {"end": True, "held": [], "records": []}


@pytest.mark.parametrize("inner_devices", ["own", "more"])
def test_nested_session_makes_lock_files_while_its_outer_session_holds_gpus(
        sessions: Sessions, sim: Path, tmp_path: Path, inner_devices: str) -> None:
    # An inner session that a test starts needs lock files its outer session never made: simulated devices
    # of its own (the example suite, run with --gpuclean-simulate on the command line, hands its inner
    # sessions another directory through GPUCLEAN_SIMULATE), or more GPUs than the outer session checks
    # (the one its test holds is inherited). It must not wait for its own outer session to let go.
    inner_sim = sim
    if inner_devices == "own":
        inner_sim = tmp_path / "inner-sim"
        for index in (0, 1):
            (inner_sim / str(index)).mkdir(parents=True)
    copy_example("sharing/nested_own_locks", sessions.suite)  # test_outer.py, nested/test_nested.py
    rc, out = sessions.finish(sessions.start("test_outer.py", "--gpuclean-devices=0",
                                             NESTED_SIM=str(inner_sim),
                                             NESTED_LOCK_DIR=str(tmp_path / "locks")))
    assert rc == 0, out


def test_raw_fork_child_of_a_killed_session_keeps_no_gpu(sessions: Sessions, tmp_path: Path) -> None:
    # A test forks through libc (no Python at-fork hook runs), then pytest is SIGKILLed: the child lives on.
    child_file = tmp_path / "child"
    copy_example("sharing/raw_fork", sessions.suite)  # test_fork.py, test_next.py
    forker = sessions.start("test_fork.py", CHILD=str(child_file))
    child = int(wait_for_file(child_file, forker))
    try:
        forker.send_signal(signal.SIGKILL)
        forker.wait()
        rc, out = sessions.finish(sessions.start("test_next.py", "--gpuclean-lock-timeout=30"))
        assert rc == 0, out
        assert "waits for GPU lock" not in out
    finally:
        collect(child)


def test_nested_session_uses_the_gpu_its_test_holds(sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    # A checked test that runs a gpuclean session of its own (pytester does) must not wait for itself.
    copy_example("sharing/nested_held_gpu", sessions.suite)  # test_outer.py, nested/test_nested.py
    rc, out = sessions.finish(sessions.start("test_outer.py", NESTED_SIM=str(sim),
                                             NESTED_LOCK_DIR=str(tmp_path / "locks")))
    assert rc == 0, out


def test_only_descendants_of_the_holder_inherit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock_dir = str(tmp_path / "locks")
    holder = subprocess.Popen([sys.executable, EXAMPLES / "scripts" / "lock_parent.py", lock_dir],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "CHILD ('GPU-a',) [] ['GPU-a']"
        held_value = holder.stdout.readline().strip().removeprefix("HELD ")
        # We are not the holder's descendant: its environment, copied here, gives us nothing.
        monkeypatch.setenv(HELD_VAR, held_value)
        assert GpuLocks(lock_dir).inherited() == {}
        with pytest.raises(LockTimeout, match="running parent::test"):
            GpuLocks(lock_dir).acquire(["GPU-a"], 1, 0.2, "outsider::test")
        holder.stdin.close()
        assert holder.stdout.read().split() == ["AFTER", "None"]
    finally:
        holder.kill()
        holder.wait()


# ---- xdist ----------------------------------------------------------------------------------------

def test_xdist_workers_share_three_gpus_in_pairs(sessions: Sessions, sim: Path, tmp_path: Path) -> None:
    (sim / "2").mkdir()
    events, pidfile = tmp_path / "events.jsonl", tmp_path / "leak.pids"
    copy_example("sharing/intervals.py", sessions.suite)
    copy_example("sharing/pairs", sessions.suite)
    rc, out = sessions.finish(sessions.start("test_pairs.py", "-n", "2", SHARING_EVENTS=str(events),
                                             LEAK_PIDFILE=str(pidfile), SIM=str(sim)))
    leaked = read_pids(pidfile)[0]
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "7 passed, 1 error" in out.splitlines()[-1], out
    # The controller ran no test, yet prints what its workers found.
    pytest.LineMatcher(out.splitlines()).fnmatch_lines([
        "*= gpuclean =*",
        f"test_pairs.py::test_leaks_a_holder: teardown: reaped 1 (pid {leaked} SIGTERM)*",
        "7 checked test(s), 1 with findings, 1 process(es) reaped",
    ])
    assert not alive(leaked)
    recorded = read_events(events)
    assert len(recorded) == 7
    gpus = set(uuids_of(sim))
    for event in recorded:
        given = event["visible"].split(",")
        assert len(set(given)) == 2 and set(given) <= gpus, event
    assert not overlaps(recorded)


def test_xdist_controller_interrupted_reports_what_workers_sent(sessions: Sessions, sim: Path,
                                                                tmp_path: Path) -> None:
    pidfile, started, seen, release = (tmp_path / n for n in ("leak.pids", "started", "seen", "release"))
    report_file = tmp_path / "report.json"
    copy_example("sharing/xdist_interrupt", sessions.suite)  # conftest.py, test_x.py
    controller = sessions.start("test_x.py", "-n", "2", "--dist", "loadfile",
                                f"--gpuclean-report={report_file}", SHARING_EVENTS=str(tmp_path / "events"),
                                LEAK_PIDFILE=str(pidfile), SIM=str(sim), STARTED=str(started), SEEN=str(seen),
                                RELEASE=str(release))
    try:
        wait_for_file(started, controller, timeout=60, empty_ok=True)
        wait_for_file(seen, controller, timeout=60, empty_ok=True)
        controller.send_signal(signal.SIGINT)
        rc, out = sessions.finish(controller)
    finally:
        release.touch()
    leaked = read_pids(pidfile)[0]
    assert not alive(leaked)
    assert rc == pytest.ExitCode.INTERRUPTED, out
    document = json.loads(report_file.read_text())
    tests = {t["nodeid"]: t for t in document["tests"]}
    assert [p["pid"] for p in tests["test_x.py::test_leaks"]["leaked"]] == [leaked], document
    assert tests["test_x.py::test_leaks"]["outcome"] == "leaked"
    assert document["summary"]["leaked"] == 1


@pytest.mark.parametrize(("workers", "how"), [(2, "child"), (4, "child"), (2, "in-process")])
def test_xdist_sibling_gpu_use_is_not_a_victims_finding(sessions: Sessions, sim: Path, tmp_path: Path,
                                                        workers: int, how: str) -> None:
    """A process of another worker of the run is neither waited for nor a failure of the test that meets
    it; it is named, and the test that started it has the finding (issue 27, item 1)."""
    pidfile, started, report_file = tmp_path / "leak.pids", tmp_path / "victim_started", tmp_path / "r.json"
    copy_example("sharing/sibling/test_a.py", sessions.suite)
    victims = ("test_b.py", "test_c.py", "test_d.py")
    for name in victims:
        shutil.copy(EXAMPLES / "sharing" / "sibling" / "victim.py", sessions.suite / name)
    # A short timeout: a victim that waits for the sibling's process fails in seconds, not minutes.
    rc, out = sessions.finish(sessions.start(
        "-n", str(workers), "--dist", "loadfile", "--gpuclean-timeout=5", f"--gpuclean-report={report_file}",
        SIM=str(sim), LEAK_PIDFILE=str(pidfile), VICTIM_STARTED=str(started), HOW=how))
    holder = read_pids(pidfile)[0]
    assert rc == pytest.ExitCode.OK, out
    assert "9 passed" in out.splitlines()[-1], out
    document = json.loads(report_file.read_text())
    validate_report(document)
    tests = {t["nodeid"]: t for t in document["tests"]}
    assert len(tests) == len(document["tests"]), document  # one record per test, whoever found what
    victim_tests = [t for nodeid, t in tests.items() if nodeid.startswith(victims)]
    assert len(victim_tests) == 6
    assert all(t["outcome"] == "clean" for t in victim_tests), document
    assert document["summary"]["not_clean"] == 0
    notes = [n for t in victim_tests for c in (t["before"], t["after"]) for n in c["notes"]]
    leaker = tests.get("test_a.py::test_unmarked_leak")
    if how == "in-process":
        # The worker itself holds it (its test used the GPU in-process): excused like a peer's context.
        assert any(n.startswith(f"pid {holder}: another worker of this xdist run, its pytest process itself")
                   for n in notes), notes
        assert leaker is None and "gpu_without_lock" not in document["summary"], document
        return
    # Named as what it is in the victim's check that met it...
    assert leaker is not None, document
    worker = leaker["gpu_without_lock"][0]["worker"]
    assert worker.startswith("gw"), leaker
    assert any(n.startswith(f"pid {holder}: in use by {worker}'s test test_a.py::test_unmarked_leak "
                            "(GPU 0 64 MiB); another worker of this xdist run: not waited for, never "
                            "signalled") for n in notes), notes
    # ... reaped by its own worker (never by a victim), blamed on the test that started it ...
    reapers = [nodeid for nodeid, t in tests.items() for c in (t["before"], t["after"]) if c
               for r in c["reaped"] if r["process"]["pid"] == holder]
    assert all(nodeid.startswith("test_a.py::") for nodeid in reapers), reapers
    assert reapers or [r["process"]["pid"] for r in document["session_reaped"]] == [holder]
    assert leaker["outcome"] == "leaked" and [p["pid"] for p in leaker["leaked"]] == [holder]
    # ... which also has the finding of its own: it used a GPU whose lock another worker's test held.
    (use,) = leaker["gpu_without_lock"]
    assert use["process"]["pid"] == holder and use["worker"] == worker
    assert use["owner"] == {"kind": "test", "name": "test_a.py::test_unmarked_leak"}
    assert use["mib_per_device"] == [{"device": "GPU 0", "mib": 64.0}]
    assert use["lock_held_by"]["nodeid"].startswith(victims) and use["lock_held_by"]["worker"] != worker
    assert document["summary"]["leaked"] == 1 and document["summary"]["gpu_without_lock"] == 1
    pytest.LineMatcher(out.splitlines()).fnmatch_lines([
        "*= gpuclean =*",
        f"test_a.py::test_unmarked_leak: leaked 1 process(es) found by a later check (pid {holder} SIG*); "
        f"used a GPU whose lock another xdist worker's test held: pid {holder} GPU 0 64 MiB while gw*'s "
        "test_*.py::test_victim* held it",
        "8 checked test(s), * with findings, 1 unchecked test(s) that leaked processes, 1 process(es) "
        "reaped, 1 used a GPU another xdist worker held the lock of",
    ])
    assert not alive(holder)


def test_xdist_host_scope_names_no_sibling_worker_nor_what_it_runs(sessions: Sessions, sim: Path,
                                                                     tmp_path: Path) -> None:
    """``--gpuclean-scope=host``: the other workers and what their tests run are no stray Python processes
    of this user. (Other Python processes of the user may run beside this test and be named: the outcome
    is not asserted, only that no process of the run is named.)"""
    files = {name: tmp_path / name for name in ("leak.pids", "leaker", "victim", "checked", "r.json")}
    copy_example("sharing/host_scope", sessions.suite)  # conftest.py, test_a.py, test_b.py
    _, out = sessions.finish(sessions.start(
        "-n", "2", "--dist", "loadfile", "--gpuclean-scope=host", "--gpuclean-timeout=1",
        f"--gpuclean-report={files['r.json']}", SIM=str(sim), LEAK_PIDFILE=str(files["leak.pids"]),
        LEAKER_PID=str(files["leaker"]), VICTIM_PID=str(files["victim"]),
        VICTIM_CHECKED=str(files["checked"])))
    holder = read_pids(files["leak.pids"])[0]
    document = json.loads(files["r.json"].read_text())
    (leaker,) = [t for t in document["tests"] if t["nodeid"] == "test_a.py::test_unmarked_leak"]
    # Its worker reaped both when its session ended.
    run = {holder, int(files["leaker"].read_text()), *(p["pid"] for p in leaker["leaked"])}
    assert len(run) == 3, (leaker, out)
    (victim,) = [t for t in document["tests"] if t["nodeid"] == "test_b.py::test_victim"]
    # The check met the other worker's process (and named it as what it is)...
    assert any(n.startswith(f"pid {holder}: in use by gw") for n in victim["before"]["notes"]), victim
    # ... and named no process of the run as a stray: not the other worker, nor what its test runs.
    named = {o["process"]["pid"] for c in (victim["before"], victim["after"]) if c for o in c["offenders"]
             if o["process"]}
    assert not run & named, (run, victim, out)


@pytest.mark.usefixtures("dead_sessions_on")
def test_xdist_sibling_keeps_what_its_dead_nested_session_left(sessions: Sessions, sim: Path,
                                                               tmp_path: Path) -> None:
    """A dead nested session's debris inside a live sibling worker's test is that worker's to reap, never
    another worker's (which signalled it as a dead session's debris)."""
    pidfile, report_file = tmp_path / "leak.pids", tmp_path / "r.json"
    copy_example("sharing/nested_debris", sessions.suite)  # test_a.py, test_b.py
    rc, out = sessions.finish(sessions.start(
        "-n", "2", "--dist", "loadfile", "--gpuclean-timeout=5", f"--gpuclean-report={report_file}",
        SIM=str(sim), LEAK_PIDFILE=str(pidfile), NESTED_DEAD=str(tmp_path / "nested_dead"),
        VICTIM_CHECKED=str(tmp_path / "victim_checked")))
    holder = read_pids(pidfile)[0]
    assert rc == pytest.ExitCode.OK, out
    tests = {t["nodeid"]: t for t in json.loads(report_file.read_text())["tests"]}
    victim = tests["test_b.py::test_victim"]
    assert victim["outcome"] == "clean", victim
    assert not [r for c in (victim["before"], victim["after"]) for r in c["reaped"]], victim
    leaker = "test_a.py::test_nested_session_died"
    assert any(n.startswith(f"pid {holder}: in use by ") and f"'s test {leaker} " in n
               for n in victim["before"]["notes"]), victim
    assert [u["process"]["pid"] for u in tests[leaker]["gpu_without_lock"]] == [holder]
    assert wait_dead([holder]) == []


# ---- pytest-timeout -------------------------------------------------------------------------------

def test_pytest_timeout_signal_method_still_reaps(example: Callable[..., Path],
                                                  pytester: pytest.Pytester) -> None:
    pidfile = example("sharing/hangs")
    result = run_inner(pytester, "-p", "timeout", "--timeout=2", "--timeout-method=signal",
                       "--gpuclean-grace=2")
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_hangs*",
        f"{LEAK_PREFIX} 1 process(es) (reaped)",
        f"  pid {leaked} ended by SIGTERM*spawned by test_inner.py::test_hangs*",
        "FAILED test_inner.py::test_hangs - Failed: Timeout (>2.0s) from pytest-timeout.",
    ])
    assert not alive(leaked)


def test_pytest_timeout_counts_the_lock_wait_unless_func_only(sessions: Sessions, tmp_path: Path) -> None:
    holding, release = tmp_path / "holding", tmp_path / "release"
    copy_example("sharing/test_hold.py", sessions.suite)
    copy_example("sharing/test_wants_one.py", sessions.suite)
    holder = sessions.start("test_hold.py", HOLDING=str(holding), RELEASE=str(release))
    wait_for_file(holding, holder)
    waiting = ("test_wants_one.py", "-p", "timeout", "--timeout=1", "--timeout-method=signal",
               "--gpuclean-lock-timeout=60")
    # By default pytest-timeout's clock runs from setup to teardown: it cuts the wait for a lock short.
    rc, out = sessions.finish(sessions.start(*waiting))
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "1 error" in out.splitlines()[-1], out
    assert "Failed: Timeout (>1.0s) from pytest-timeout" in out
    # With timeout_func_only it times the test function only, and the session waits for the GPU.
    waiter = sessions.start(*waiting, "-o", "timeout_func_only=true")
    time.sleep(3)  # well past --timeout, the waiter still waits for the lock
    release.touch()
    rc, out = sessions.finish(waiter)
    assert rc == 0, out
    assert sessions.finish(holder)[0] == 0


@pytest.mark.parametrize("dead_sessions", ["on", "off"])
@pytest.mark.usefixtures("dead_sessions_on")  # (the option on the command line says which, for the 2nd)
def test_pytest_timeout_thread_method_exits_without_teardown(example: Callable[..., Path],
                                                             pytester: pytest.Pytester,
                                                             dead_sessions: str) -> None:
    # pytest-timeout's thread method ends the process with os._exit(1): no teardown, no reaping. The
    # next session's first check finds the leftover: its cookie names a session whose pytest is dead,
    # so it is that session's debris, reaped and blamed on the test that made it. With the option off,
    # it is a foreign process: waited for, never killed.
    pidfile = example("sharing/hangs")
    leaked: int | None = None
    try:
        result = run_inner(pytester, "-p", "timeout", "--timeout=2", "--timeout-method=thread")
        leaked = read_pids(pidfile)[0]
        assert result.ret == 1
        result.stdout.fnmatch_lines(["*+ Timeout +*"])
        assert "checked test(s)" not in result.stdout.str()  # no gpuclean summary: it never got there
        assert alive(leaked)

        example("sharing/next_session")  # its test_inner.py replaces the one that hung
        result = run_inner(pytester, f"--gpuclean-dead-sessions={dead_sessions}")
        if dead_sessions == "off":
            result.assert_outcomes(errors=1)
            result.stdout.fnmatch_lines([
                f"{NOT_CLEAN_PREFIX} before the test*",
                f"  foreign pid {leaked} *",
            ])
            assert alive(leaked)
            return
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([
            f"test_inner.py::test_hangs: leaked 1 process(es) found by a later check (pid {leaked} SIGTERM)",
            f"gpuclean: pid {leaked}: left by dead session gc.* (pytest pid *, started *), spawned by "
            "test_inner.py::test_hangs: reaped (SIGTERM) before test_inner.py::test_next*",
        ])
        assert wait_dead([leaked]) == []
    finally:
        if leaked is not None:
            collect(leaked)


# ---- the lock primitive ---------------------------------------------------------------------------

def test_waiting_reports_holders_once(tmp_path: Path) -> None:
    locks = GpuLocks(str(tmp_path / "locks"))
    held = locks.acquire(["GPU-a", "GPU-b"], 1, 1.0, "first::test")
    assert held.uuids == ("GPU-a",)
    told: list[dict[str, LockHolder]] = []
    try:
        # flock conflicts between two opens of a file, even in one process.
        second = locks.acquire(["GPU-a", "GPU-b"], 1, 1.0, "second::test")
        assert second.uuids == ("GPU-b",)
        with pytest.raises(LockTimeout, match=r"for 2 of 2 GPU lock\(s\); held by: GPU-a: pid \d+ "
                                              r"\(user \S+\) on .* running first::test.*; GPU-b: .* "
                                              r"running second::test"):
            locks.acquire(["GPU-a", "GPU-b"], 2, 0.3, "third::test", on_wait=told.append)
        second.release()
    finally:
        held.release()
    assert [sorted(t) for t in told] == [["GPU-a", "GPU-b"]]
    record = told[0]["GPU-a"].record
    assert record is not None and record.test == "first::test"
    fourth = locks.acquire(["GPU-a", "GPU-b"], 2, 0, "fourth::test")
    fourth.release()  # (else this worker's later tests would inherit them through HELD_VAR)
    assert fourth.uuids == ("GPU-a", "GPU-b")


def test_interrupted_acquire_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locks = GpuLocks(str(tmp_path / "locks"))
    real_try = GpuLocks._try

    def interrupted(self: GpuLocks, state: Any, name: str) -> int | None:
        # (A new lock directory: each lock file is opened and locked through _try.)
        if name == "GPU-b.lock":
            raise KeyboardInterrupt  # as pytest-timeout's SIGALRM would, between two locks
        return real_try(self, state, name)

    monkeypatch.setattr(GpuLocks, "_try", interrupted)
    # Keep the traceback (and so acquire's frame) alive, as pytest's reports and sys.last_traceback do.
    with pytest.raises(KeyboardInterrupt) as interruption:
        locks.acquire(["GPU-a", "GPU-b"], 2, 5, "interrupted::test")
    assert interruption.tb is not None
    # Another process can have GPU-a at once (the one that took it was interrupted).
    other = subprocess.run([sys.executable, "-c", "import sys; "
                            "from pytest_gpuclean._locks.gpus import GpuLocks; "
                            "GpuLocks(sys.argv[1]).acquire(['GPU-a'], 1, 0, 'next::test')", locks.directory],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr


def test_lock_file_deleted_by_hand_is_not_trusted(tmp_path: Path) -> None:
    # The session keeps each lock file open between tests. If someone deletes the file, a lock on the old
    # inode would lock nothing: another session creates a new file and holds that one.
    locks = GpuLocks(str(tmp_path / "locks"))
    locks.acquire(["GPU-a"], 1, 5, "first::test").release()  # the descriptor stays cached
    os.unlink(locks.lock_path("GPU-a"))
    ready = tmp_path / "ready"
    other = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from pytest_gpuclean._locks.gpus import GpuLocks; "
        "held = GpuLocks(sys.argv[1]).acquire(['GPU-a'], 1, 5, 'other::test'); "
        "Path(sys.argv[2]).write_text('x'); time.sleep(60)"), locks.directory, str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the other session never took the new lock file"
        with pytest.raises(LockTimeout, match="other::test"):
            locks.acquire(["GPU-a"], 1, 0.3, "second::test")
    finally:
        other.kill()
        other.wait()
    # Once the other session is gone, the new file is ours to lock.
    locks.acquire(["GPU-a"], 1, 5, "third::test").release()


def test_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    # A holder forks (as multiprocessing or vLLM do) and is killed; its child lives on.
    lock_dir = str(tmp_path / "locks")
    child_file = tmp_path / "child.pid"
    subprocess.run([sys.executable, EXAMPLES / "scripts" / "forking_lock_holder.py", lock_dir, child_file],
                   stdout=subprocess.DEVNULL, timeout=60)
    child = int(child_file.read_text())
    try:
        assert alive(child)
        GpuLocks(lock_dir).acquire(["GPU-a"], 1, 5, "next::test").release()
    finally:
        collect(child)


def _as_user(uid: int, action: Callable[[], str]) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.close(read)
            os.setgid(uid)
            os.setuid(uid)
            answer = action()
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        answer = f.read()
    os.waitpid(pid, 0)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as several users needs root")
def test_three_users_share_one_lock_directory() -> None:
    base = Path(tempfile.mkdtemp(prefix="gpuclean-users-"))
    base.chmod(0o1777)
    lock_dir = str(base / "locks")

    def lock_and_release() -> str:
        locks = GpuLocks(lock_dir)
        held = locks.acquire(["GPU-a"], 1, 5, f"user {os.getuid()}")
        recorded = locks.holder("GPU-a")
        held.release()
        return f"ok {recorded is not None and recorded.pid == os.getpid()}"

    def lock_and_die() -> str:
        GpuLocks(lock_dir).acquire(["GPU-a"], 1, 5, f"user {os.getuid()}")
        os.kill(os.getpid(), signal.SIGKILL)
        return "not reached"

    try:
        assert _as_user(4001, lambda: str(GpuLocks(lock_dir).directory)) == lock_dir  # owns the directory
        assert _as_user(4002, lock_and_release) == "ok True"  # owns the lock file
        # Neither the file's nor the directory's owner; its record stays behind when it is killed.
        assert _as_user(4003, lock_and_die) == ""
        assert _as_user(4002, lock_and_release) == "ok True"  # the newest record is the holder's
        assert _as_user(4001, lock_and_release) == "ok True"
    finally:
        shutil.rmtree(base)
