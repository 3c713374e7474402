"""GPUs dirty from outside the session: a state one check waited out is not waited for again while it stays
the same, and ``--gpuclean-outside`` says what a test gets for it (fail, skip, or stop the session).

The outside holders are real processes started here, before the inner session and not by it (they do not
carry its cookie); the inner sessions run in subprocesses over simulated devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from helpers import alive, exec_done, kill_all, read_pids, run_inner, summary_of

from pytest_gpuclean._model.records import MIB
from pytest_gpuclean.report import jsonreport
from pytest_gpuclean.report.terminal import NOT_CLEAN_PREFIX
from pytest_gpuclean.simulate import init_cuda

TIMEOUT = 1.0
"""Each marked test's timeout: what the first check under a new outside state waits."""

WAIT_THEN_HOLD = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
from pytest_gpuclean.simulate import main
main(sys.argv[2:])
"""
"""A holder that starts holding when a file appears: outside the inner session (started here, before it),
it puts memory on a GPU while an inner test runs."""


@pytest.fixture(autouse=True)
def _isolated_inner_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under an outer `-n`, an inner session would inherit the outer run's id (see test_outputs.py).
    for name in ("PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MARK_TIMEOUT", str(TIMEOUT))  # the inner suites' (tests/examples/outside) timeout


@pytest.fixture
def later_holder(sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An outside process that holds 300 MiB on GPU 0 once the file ``$GO`` exists, and then appends its
    pid to ``$LATER_PIDFILE``. Returns that pidfile."""
    go, pidfile = tmp_path / "go", tmp_path / "later.pid"
    monkeypatch.setenv("GO", str(go))
    monkeypatch.setenv("LATER_PIDFILE", str(pidfile))
    proc = subprocess.Popen([sys.executable, "-c", WAIT_THEN_HOLD, str(go), "hold", "--dir", str(sim),
                             "--device", "0", "--mib", "300", "--pidfile", str(pidfile)])
    yield pidfile
    kill_all([proc.pid])
    proc.wait()


@pytest.fixture
def unlisted_holder(sim: Path) -> Iterator[int]:
    """100 MiB on GPU 0 that the driver charges to no process: CUDA initialised, without a context, by a
    process that is not the session's (another container's memory looks like this)."""
    (sim / "0" / "context_overhead").write_text(str(100 * MIB))
    other = subprocess.Popen(["sleep", "600"])
    init_cuda(str(sim), 0, other.pid)
    yield other.pid
    other.kill()
    other.wait()


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # Not about dead sessions: the debris of another session of this user (a test of another suite on the
    # same host that killed its pytest) must not add findings here.
    return run_inner(pytester, "--gpuclean-dead-sessions=off", "--gpuclean-report=report.json", *args)


def report(pytester: pytest.Pytester) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((pytester.path / "report.json").read_text())
    jsonschema.Draft202012Validator(jsonreport.load_schema(),
                                    format_checker=jsonschema.FormatChecker()).validate(document)
    return document


def by_nodeid(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["nodeid"].split("::")[-1]: t for t in document["tests"]}


def again(nodeid: str, mib: int = 100, when: str = "before") -> str:
    """The heading of a check that did not wait again for what ``nodeid``'s check waited out."""
    return (f"{NOT_CLEAN_PREFIX} {when} the test: GPU 0: still the same {mib} MiB held from outside as at "
            f"test_inner.py::{nodeid}; not waiting again")


def waited(when: str = "before") -> str:
    # How long it waited is the box's business (a loaded box overshoots the timeout by a tick); that it
    # waited the whole timeout once is what these tests are about.
    return f"{NOT_CLEAN_PREFIX} {when} the test (waited *s of a {TIMEOUT:g}s timeout)"


@pytest.mark.parametrize("held_by", ["process", "no process"])
def test_n_tests_under_an_outside_holder_cost_one_timeout(
        held_by: str, example: Callable[..., Path], pytester: pytest.Pytester,
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process the driver lists that is not ours, or memory no process we can see holds (another
    # container's): the first check waits it out; the next ones find it unchanged and fail at once.
    if held_by == "process":
        holder = request.getfixturevalue("outside_holder")(mib=100)
        who = f"  foreign pid {holder} (user *, found as gpu): GPU 0 100 MiB; not started by this session*"
    else:
        holder = request.getfixturevalue("unlisted_holder")
        who = "  memory: 100 MiB used on GPU 0 beyond the tolerance of 0 MiB, held by no process we can see"
    example("outside/must_not_run")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    result = run(pytester)
    result.assert_outcomes(errors=4)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_marked[[]0[]]*", waited(), who,
        *(line for n in (1, 2, 3) for line in (f"*ERROR at setup of test_marked[[]{n}[]]*",
                                               again("test_marked[0]"), "still dirty after *s:", who)),
        "test_inner.py::test_marked[[]0[]]: setup: not clean (*); GPUs dirty from outside the session: fail",
        "test_inner.py::test_marked[[]1[]]: setup: not clean (*); GPUs dirty from outside the session: fail "
        "(not waited for again)",
    ])
    tests = by_nodeid(report(pytester))
    first = tests["test_marked[0]"]["before"]
    assert first["outside"] == {"devices": [{"device": "GPU 0", "mib": 100.0}], "only": True,
                                "same_as": None, "waited": True}
    assert first["waited_s"] >= TIMEOUT
    for n in (1, 2, 3):
        later = tests[f"test_marked[{n}]"]
        assert later["before"]["outside"] == {"devices": [{"device": "GPU 0", "mib": 100.0}], "only": True,
                                              "same_as": "test_inner.py::test_marked[0]", "waited": False}
        assert later["before"]["waited_s"] < TIMEOUT  # it did not wait the timeout out again
        assert later["outside_action"] == "fail" and later["outcome"] == "not_clean"
    annotations = [text for text in result.stdout.lines if text.startswith("::error")]
    assert [text.count("not waited for again") for text in annotations] == [0, 1, 1, 1]
    assert "; the same outside state as at test_inner.py::test_marked[0]: not waited for again)" in (
        annotations[1])
    assert alive(holder)  # not the session's: waited for, never signalled


def test_a_changed_outside_state_is_waited_for_and_a_freed_gpu_passes(
        example: Callable[..., Path], pytester: pytest.Pytester, outside_holder: Callable[..., int],
        later_holder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = outside_holder(mib=100)
    monkeypatch.setenv("FIRST_HOLDER", str(first))
    example("outside/changing")
    result = run(pytester)
    result.assert_outcomes(passed=4, errors=5)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_1*", waited(),
        "*ERROR at setup of test_2_same*", again("test_1"),
        "*ERROR at setup of test_4_more_memory*", waited(),
        "*ERROR at setup of test_5_same*", again("test_4_more_memory", mib=300),
        "*ERROR at setup of test_7_new_holder*", waited(),
    ])
    tests = by_nodeid(report(pytester))
    same_as = {name: t["before"]["outside"] and t["before"]["outside"]["same_as"]
               for name, t in tests.items() if t["before"] is not None}
    assert same_as == {"test_1": None, "test_2_same": "test_inner.py::test_1", "test_4_more_memory": None,
                       "test_5_same": "test_inner.py::test_4_more_memory", "test_7_new_holder": None,
                       "test_9_clean_again": None}
    later = read_pids(later_holder)[0]
    assert [o["process"]["pid"] for o in tests["test_7_new_holder"]["before"]["offenders"]] == [later]
    for name in ("test_1", "test_4_more_memory", "test_7_new_holder"):
        assert tests[name]["before"]["waited_s"] >= TIMEOUT, name  # a new state is waited for in full
    # The remembered state never makes a check pass: only a clean reading does.
    clean = tests["test_9_clean_again"]
    assert (clean["outcome"], clean["before"]["clean"], clean["outside_action"]) == ("clean", True, None)


def test_a_leak_of_ours_is_still_reaped_and_blamed_where_the_outside_is_known(
        example: Callable[..., Path], pytester: pytest.Pytester, outside_holder: Callable[..., int]) -> None:
    outside_holder(mib=100)
    pidfile = example("outside/our_leak")
    result = run(pytester)
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=1, errors=2, warnings=0)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_3*", again("test_1"), "reaped 1 process(es):",
        f"  pid {leaked} ended by SIGTERM*(found as descendant, spawned by "
        "test_inner.py::test_2_unmarked_leaks)*",
        f"test_inner.py::test_2_unmarked_leaks: leaked 1 process(es) found by a later check (pid {leaked} "
        "SIGTERM)",
    ])
    assert not alive(leaked)
    tests = by_nodeid(report(pytester))
    assert [r["process"]["pid"] for r in tests["test_2_unmarked_leaks"]["found_later"]] == [leaked]
    assert tests["test_3"]["before"]["outside"]["same_as"] == "test_inner.py::test_1"


def test_a_leak_of_ours_is_still_waited_for_where_the_outside_is_known(
        example: Callable[..., Path], pytester: pytest.Pytester, outside_holder: Callable[..., int]) -> None:
    # Reaping off: our leftover is waited for until it ends by itself; only the outside part is not.
    outside_holder(mib=100)
    pidfile = example("outside/our_leak_ends")
    result = run(pytester, "--gpuclean-reap=off")
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_3*", again("test_1"), "outlived the test, then ended by themselves:",
        f"  leaked pid {leaked} (*spawned by test_inner.py::test_2_unmarked_leaks): GPU 0 64 MiB; outlived "
        "its test, ended by itself within *s (reaping is off)",
    ])
    before = by_nodeid(report(pytester))["test_3"]["before"]
    assert [o["process"]["pid"] for o in before["lingered"]] == [leaked]  # the check saw it end
    assert before["outside"]["same_as"] == "test_inner.py::test_1"


def test_a_leak_of_ours_that_hides_the_outside_memory_does_not_make_it_new(
        example: Callable[..., Path], pytester: pytest.Pytester, unlisted_holder: int) -> None:
    # While a leak of ours sits on the GPU, the memory there is blamed on it, not reported apart: the
    # memory held from outside is still there, and once our leak is gone it is the same as before.
    pidfile = example("outside/hides")
    result = run(pytester, "--gpuclean-reap=off")
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=2, errors=3)
    tests = by_nodeid(report(pytester))
    meets = tests["test_3_meets_our_leak"]["before"]
    assert [(o["reason"], o["process"]["pid"]) for o in meets["offenders"]] == [("leaked", leaked)]
    assert tests["test_5"]["before"]["outside"]["same_as"] == "test_inner.py::test_1"
    result.stdout.fnmatch_lines(["*ERROR at setup of test_5*", again("test_1")])


def test_an_outside_holder_rewriting_its_allocation_never_reads_as_clean(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 37: once in about 25 runs, five marked tests passed beside an outside process holding 512 MiB.
    # A reading that met the holder's file between its truncation and its write took the holder for gone
    # (so did a wall clock set forward: tests/test_devices.py); one such reading in a check's polls is a
    # clean verdict. Here every reading of every check meets a file rewritten in place, without end.
    pidfile = tmp_path / "rewriter.pid"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "examples" / "scripts" /
                                              "rewriting_holder.py"), str(sim), "0", "512", str(pidfile)])
    try:
        holder = read_pids(pidfile)[0]
        monkeypatch.setenv("MARKED_TESTS", "5")
        example("outside/marked")
        result = run(pytester)
        result.assert_outcomes(errors=5)
        tests = report(pytester)["tests"]
        assert [t["outcome"] for t in tests] == ["not_clean"] * 5
        assert all(t["before"]["clean"] is False for t in tests)
        assert f"foreign pid {holder}" in result.stdout.str()
    finally:
        kill_all([proc.pid])
        proc.wait()


def test_skip_skips_before_the_test_and_warns_after_it(
        example: Callable[..., Path], pytester: pytest.Pytester, later_holder: Path) -> None:
    example("outside/skip")
    result = run(pytester, "--gpuclean-outside=skip", "--junitxml=junit.xml")
    holder = read_pids(later_holder)[0]
    # The test that ran cannot be skipped, and another job's memory is no failure of its: a note (no
    # warning, which -W error would make its error).
    result.assert_outcomes(passed=1, skipped=2, warnings=0)
    cause = f"GPU 0 dirty from outside the session (GPU 0 300 MiB; foreign pid {holder})"
    first = "test_1_gpu_taken_from_outside_while_it_runs"
    result.stdout.fnmatch_lines([
        f"SKIPPED [[]2[]] *: gpuclean: {cause} before the test, the same as at test_inner.py::{first}: not "
        "waiting again (--gpuclean-outside=skip, from the command line)",
    ])
    assert f"gpuclean: test_inner.py::{first}: {cause} after the test, waited {TIMEOUT:.1f}s of a " \
           f"{TIMEOUT:g}s timeout; the test has run: not failed (--gpuclean-outside=skip, from the command " \
           "line)" in summary_of(result)
    document = report(pytester)
    assert [t["outside_action"] for t in document["tests"]] == ["skip"] * 3
    assert document["summary"]["dirty_from_outside"] == 3
    assert document["session"]["settings"]["outside"] == "skip"
    junit = ET.parse(pytester.path / "junit.xml")
    actions = [p.get("value") for p in junit.iter("property") if p.get("name") == "gpuclean_outside_action"]
    assert actions == ["skip"] * 3


def test_stop_stops_the_session_with_one_line(example: Callable[..., Path], pytester: pytest.Pytester,
                                              outside_holder: Callable[..., int]) -> None:
    holder = outside_holder(mib=100)
    pytester.makeini("[pytest]\ngpuclean_outside = stop\n")
    example("outside/stop")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(errors=1)  # the test that found it: its check failed; nothing after it ran
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_marked[[]0[]]*", waited(),
        f"!* Interrupted: gpuclean: GPU 0 dirty from outside the session (GPU 0 100 MiB; foreign pid "
        f"{holder}) at test_inner.py::test_marked[[]0[]]; stopping the session (--gpuclean-outside=stop, "
        "from ini option gpuclean_outside in *) !*",
    ])
    document = report(pytester)
    assert [(t["nodeid"], t["outside_action"]) for t in document["tests"]] == [
        ("test_inner.py::test_marked[0]", "stop")]


def test_xdist_workers_share_what_one_of_them_waited_out(example: Callable[..., Path],
                                                          pytester: pytest.Pytester,
                                                          outside_holder: Callable[..., int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers take turns on the GPUs (their locks); the first to meet the holder waits it out, and no
    # other worker waits for it again.
    outside_holder(mib=100)
    monkeypatch.setenv("MARKED_TESTS", "6")
    example("outside/marked")
    result = run(pytester, "-n", "2")
    result.assert_outcomes(errors=6)
    workers = {line.split()[0] for line in result.stdout.lines if line.startswith("[gw")}
    assert workers == {"[gw0]", "[gw1]"}  # both workers checked
    checks = [t["before"] for t in report(pytester)["tests"]]
    waited_out = [c for c in checks if c["outside"]["waited"]]
    assert len(waited_out) == 1, [c["outside"] for c in checks]
    first = next(t["nodeid"] for t in report(pytester)["tests"] if t["before"]["outside"]["waited"])
    assert sorted(c["outside"]["same_as"] for c in checks if c not in waited_out) == [first] * 5
    assert all(c["waited_s"] < TIMEOUT for c in checks if c not in waited_out)


def test_stop_in_an_xdist_worker_ends_the_run(example: Callable[..., Path], pytester: pytest.Pytester,
                                              outside_holder: Callable[..., int],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    holder = outside_holder(mib=100)
    monkeypatch.setenv("GPUCLEAN_OUTSIDE", "stop")
    monkeypatch.setenv("MARKED_TESTS", "8")
    example("outside/marked")
    result = run(pytester, "-n", "2")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([
        f"!*Interrupted: gpuclean: GPU 0 dirty from outside the session (GPU 0 100 MiB; foreign pid "
        f"{holder}) at test_inner.py::test_marked[[]*[]]; stopping the session (--gpuclean-outside=stop, "
        "from environment variable GPUCLEAN_OUTSIDE) !*",
    ])
    # Each worker stops after the test that found the GPUs dirty (the second one at once): the rest never ran.
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) == 0 and 1 <= outcomes["errors"] <= 2, outcomes
    tests = report(pytester)["tests"]
    assert [t["outside_action"] for t in tests] == ["stop"] * outcomes["errors"]
    assert sum(t["before"]["outside"]["waited"] for t in tests) == 1


@contextlib.contextmanager
def _running(cookie: str) -> Iterator[int]:
    proc = exec_done(subprocess.Popen(["sleep", "600"], env={**os.environ, "GPUCLEAN_TEST": cookie}))
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_sibling_xdist_workers_process_is_never_outside() -> None:
    # What a sibling worker's test started carries the controller's cookie extended by that worker's
    # session: the run's, not outside the session (its own worker accounts for it).
    from pytest_gpuclean._check.checker import Checker
    from pytest_gpuclean._ownership.census import Census, XdistPeers
    worker = Checker(None, census=Census.of_its_own(peers=XdistPeers("run1", "gc.1.2.3.aa:session")))
    alone = Checker(None)
    with _running("gc.1.2.3.aa:session/gc.4.5.3.bb:t7") as sibling, \
            _running("gc.9.9.3.cc:session/gc.4.5.3.bb:t7") as other_run, \
            _running("gc.1.2.3.aa:session") as worker_itself:
        assert worker.of_our_run(sibling)
        assert not worker.of_our_run(other_run)
        assert not worker.of_our_run(worker_itself)  # (a peer worker: excused as such, not by this)
        assert not alone.of_our_run(sibling)  # no xdist run: no siblings
        assert alive(sibling)


def test_the_shared_memory_of_an_xdist_run_round_trips_and_shrugs_off_a_bad_file(tmp_path: Path) -> None:
    from pytest_gpuclean._check.decisions import OutsideState
    from pytest_gpuclean._check.outside import OutsideMemory
    path = tmp_path / "outside.json"
    one, other = OutsideMemory(str(path)), OutsideMemory(str(path))  # two workers
    state = OutsideState(frozenset({(4242, 99)}), 719 * MIB, "t.py::test_1", 12.5)
    one.update({"GPU-a": state, "GPU-b": state._replace(holders=frozenset())}, forget=())
    assert other.load() == {"GPU-a": state, "GPU-b": state._replace(holders=frozenset())}
    other.forget(["GPU-b"])
    assert one.load() == {"GPU-a": state}
    path.write_text("{not json")
    assert one.load() == {}  # only an optimisation: a check waits, as if nothing were known
    one.update({"GPU-a": state}, forget=())
    assert other.load() == {"GPU-a": state}
    gone = OutsideMemory(str(tmp_path / "no-such-dir" / "outside.json"))  # the run's directory removed
    gone.update({"GPU-a": state}, forget=())
    gone.forget(["GPU-a"])
    assert gone.load() == {}
