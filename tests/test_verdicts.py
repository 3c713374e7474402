"""Verdicts and counts that must not depend on how a suite is laid out or run: a wide fixture's leak whatever
test ends its scope, the victims of a known leak under ``--gpuclean-reap=off``, xdist's controller bookkeeping
(a crashed worker, SIGTERM to the controller), and the GPU memory of a fixture that a check excuses.

Inner pytest sessions over simulated devices, with real processes; every JSON report is held to its own
summary (``helpers.assert_report_consistent``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import (
    assert_report_consistent,
    isolate_inner_sessions,
    kill_all,
    read_pids,
    run_inner,
    summary_of,
    wait_dead,
    wait_for_file,
)

from pytest_gpuclean._check import decisions
from pytest_gpuclean._model.outcomes import reaped_count
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    DeviceInfo,
    DeviceSnapshot,
    GpuProcess,
    Owner,
    ProcessInfo,
    Reaped,
)
from pytest_gpuclean._model.records import TestRecord as Record
from pytest_gpuclean._session import store as session_records
from pytest_gpuclean.report.serialize import to_dict


@pytest.fixture(autouse=True)
def _isolated_inner_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_inner_sessions(monkeypatch)


def load(path: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads(path.read_text())
    return document


# ---- xdist: one count everywhere ---------------------------------------------------------------------------

@pytest.mark.usefixtures("dead_sessions_on")
def test_a_marked_test_whose_worker_exits_is_checked_leaked_and_counted_once(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    """A marked test holds memory and calls ``os._exit(3)`` under ``-n 2``: the controller reaps what it left
    (its worker is dead), and every output calls it a checked test that leaked one process, reaped once."""
    pidfile = example("verdicts/crash")
    report = tmp_path / "report.json"
    result = run_inner(pytester, "-n", "2", "-p", "xdist", f"--gpuclean-report={report}",
                       "--gpuclean-timeout=20")
    leaked = read_pids(pidfile)[0]
    assert wait_dead([leaked], timeout=2) == [], result.stdout.str()
    result.assert_outcomes(passed=4, failed=1)
    summary = summary_of(result)
    document = load(report)
    assert_report_consistent(document, summary)
    tests = {t["nodeid"]: t for t in document["tests"]}  # type: ignore[attr-defined]
    crashed = tests["test_inner.py::test_holds_then_exits"]
    # Marked, and its check before ran (its worker sent the record of its setup): checked, not "unchecked".
    assert crashed["before"] is not None and crashed["outcome"] == "leaked" and crashed["findings"]
    assert [p["pid"] for p in crashed["leaked"]] == [leaked]
    assert summary[-1] == "5 checked test(s), 1 with findings, 1 process(es) reaped", summary
    # The pid is reaped once (by the controller, or by the other worker's check that met it first), never
    # also "exited by itself" where a check saw it end while the other one reaped it.
    mentions = [line for line in summary if f"pid {leaked} " in line]
    assert mentions and not [line for line in mentions if "exited by" in line], summary


def _proc(pid: int) -> ProcessInfo:
    return ProcessInfo(pid, 1000 + pid, 1, 0, "ci", "sleep 600", "sleeping")


def test_a_process_reaped_anywhere_is_not_also_collected_as_exited_by_itself() -> None:
    """One worker's check saw the crashed worker's orphan end (the controller was reaping it) and collected it
    as "exited by itself"; the controller reaped it. Merged, the pid is reaped once and collected nowhere, and
    the count of reaped processes counts it once."""
    owner = Owner("test", "t.py::test_crashed")
    orphan, other = _proc(4242), _proc(4343)
    ended = Reaped(orphan, owner, "cookie", "SIGTERM", (("GPU 0", 512.0),), 0.01, 0.01)
    seen_exit = Reaped(orphan, owner, "cookie", "exited by itself", (), None)
    really = Reaped(other, owner, "cookie", "exited by itself", (), None)
    witness = Record("t.py::test_later", before=CheckResult("setup", True, (), (),
                                                                 collected=(seen_exit, really)))
    found = session_records.RecordStore()
    found.add_worker({"records": [to_dict(witness)], "session_reaped": [], "notes": []})
    found.found_later(ended)  # (the controller: reap_crashed)
    merged = found.merged()
    by_id = {r.nodeid: r for r in merged.records}
    assert by_id["t.py::test_crashed"].found_later == (ended,)
    assert by_id["t.py::test_later"].before is not None
    assert by_id["t.py::test_later"].before.collected == (really,)
    assert reaped_count(merged.records, merged.session_reaped) == 1


def test_sigterm_to_the_xdist_controller_still_gives_the_whole_summary_and_report(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    """A cancelled CI job: SIGTERM to the controller of an ``-n 2`` run while a test that leaked is still
    running. The controller dies of SIGTERM as it would without the plugin, nothing is left alive, and its
    summary and JSON report hold what the workers found, the leaking test's record among them (its worker
    sent it when the controller's shutdown interrupted it)."""
    pidfile = example("verdicts/xdist_sigterm")
    started, release, report = tmp_path / "started", tmp_path / "release", tmp_path / "report.json"
    env = dict(os.environ, STARTED=str(started), RELEASE=str(release), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider",
                             "-rA", "-n", "2", "-p", "xdist", f"--gpuclean-report={report}"],
                            cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_for_file(started, proc, timeout=60, empty_ok=True)
        leaked = read_pids(pidfile)[0]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM, out
    assert wait_dead([leaked], timeout=2) == [], out
    lines = out.splitlines()
    summary = summary_of(pytest.RunResult(proc.returncode, lines, [], 0.0))
    document = load(report)
    assert_report_consistent(document, summary)
    tests = {t["nodeid"]: t for t in document["tests"]}  # type: ignore[attr-defined]
    leaker = tests["test_inner.py::test_leaks_and_hangs"]
    assert leaker["outcome"] == "leaked" and [p["pid"] for p in leaker["leaked"]] == [leaked], leaker
    assert any(line.startswith("test_inner.py::test_leaks_and_hangs: ") and f"pid {leaked} " in line
               for line in summary), summary


# ---- a wide fixture's leak, whatever test ends its scope -------------------------------------------------

def _fixture_line(conftest: Path, name: str) -> int:
    lines = conftest.read_text().splitlines()
    # (1-based, at the decorator: the line above the def)
    return next(i for i, text in enumerate(lines) if text.startswith(f"def {name}("))


@pytest.mark.parametrize("last", ["unmarked", "skipped", "failed"])
def test_a_wide_fixtures_leak_is_judged_when_it_ends_whatever_test_ends_its_scope(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, last: str) -> None:
    """A session fixture's server and a module fixture's engine, never stopped, end at the teardown of an
    unmarked test (the module's last one skipped, or the session's last one failing): each is its fixture's
    finding there, as it is when a marked test ends its scope; that test's own outcome is not changed."""
    pidfile = example("verdicts/fixture_ends")
    monkeypatch.setenv("LAST", last)
    report, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    result = run_inner(pytester, f"--gpuclean-report={report}", f"--junitxml={junit}")
    server, engine = read_pids(pidfile, 2)
    assert wait_dead([server, engine], timeout=2) == [], result.stdout.str()
    skipped = 2 if last == "skipped" else 0
    result.assert_outcomes(passed=5 - skipped - (last == "failed"), skipped=skipped,
                           failed=int(last == "failed"), errors=2)
    conftest = pytester.path / "conftest.py"
    where = {name: f"conftest.py:{_fixture_line(conftest, name)}" for name in ("server", "engine")}
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_unmarked_last*",
        f"gpuclean: fixture engine (module-scoped, {where['engine']}) leaked 1 process(es) (reaped), found "
        "at the teardown of test_a.py::test_unmarked_last",
        f"  pid {engine} ended by SIGTERM * (found as descendant, spawned by fixture engine "
        "(module-scoped)): held GPU 1 64 MiB*",
    ])
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_unmarked_very_last*",
        f"gpuclean: fixture server (session-scoped, {where['server']}) leaked 1 process(es) (reaped), found "
        "at the teardown of test_b.py::test_unmarked_very_last",
    ])
    summary = summary_of(result)
    assert "session end" not in "\n".join(summary), summary  # judged at the fixture's end, not swept
    assert summary[-1] == ("3 checked test(s), 0 with findings, 2 fixture(s) that leaked processes, 2 "
                           "process(es) reaped"), summary
    document = load(report)
    assert_report_consistent(document, summary)
    fixtures = {f["name"]: f for f in document["fixtures"]}  # type: ignore[attr-defined]
    assert {name: (f["scope"], f"{f['file']}:{f['line']}", f["reported_on"])
            for name, f in fixtures.items()} == {
        "engine": ("module", where["engine"], "test_a.py::test_unmarked_last"),
        "server": ("session", where["server"], "test_b.py::test_unmarked_very_last")}
    assert [(p["pid"], p["ended_by"]) for p in fixtures["engine"]["leaked"]] == [(engine, "SIGTERM")]
    assert [(p["pid"], p["ended_by"]) for p in fixtures["server"]["leaked"]] == [(server, "SIGTERM")]
    tests = {t["nodeid"]: t for t in document["tests"]}  # type: ignore[attr-defined]
    for nodeid in ("test_a.py::test_unmarked_last", "test_b.py::test_unmarked_very_last"):
        # Not checked, and nothing of its own: the fixture's finding, not the test's.
        assert (tests[nodeid]["outcome"], tests[nodeid]["findings"], tests[nodeid]["leaked"]) == (
            "unchecked", False, []), tests[nodeid]
    properties = {case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
                  for case in ET.parse(junit).getroot().iter("testcase")}
    assert properties["test_unmarked_last"]["gpuclean_fixture_leaks"] == (
        f"fixture engine (module-scoped, {where['engine']}) leaked 1 process(es)")


@pytest.mark.parametrize("last", ["unmarked", "skipped"])
def test_under_xdist_each_workers_wide_fixture_leak_reaches_the_controller(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, last: str) -> None:
    """The same under ``-n 2``: the worker that set the fixtures up judges them where they end (its last test
    of their scope, unmarked), and the controller's summary and report list both."""
    pidfile = example("verdicts/fixture_ends")
    monkeypatch.setenv("LAST", last)
    report = tmp_path / "report.json"
    result = run_inner(pytester, "-n", "2", "-p", "xdist", "--dist", "loadfile",
                       f"--gpuclean-report={report}")
    server, engine = read_pids(pidfile, 2)
    assert wait_dead([server, engine], timeout=2) == [], result.stdout.str()
    assert result.parseoutcomes()["errors"] in (1, 2)  # (both fixtures may end at one test's teardown)
    summary = summary_of(result)
    document = load(report)
    assert_report_consistent(document, summary)
    fixtures = {f["name"]: f for f in document["fixtures"]}  # type: ignore[attr-defined]
    assert set(fixtures) == {"engine", "server"}, document["fixtures"]  # type: ignore[index]
    assert fixtures["engine"]["reported_on"] == "test_a.py::test_unmarked_last"
    assert fixtures["server"]["reported_on"] in ("test_a.py::test_unmarked_last",
                                                 "test_b.py::test_unmarked_very_last")
    assert [p["pid"] for p in fixtures["engine"]["leaked"]] == [engine]
    assert [p["pid"] for p in fixtures["server"]["leaked"]] == [server]
    assert ", 2 fixture(s) that leaked processes, 2 process(es) reaped" in summary[-1], summary


# ---- --gpuclean-reap=off: the victims of a known leak ----------------------------------------------------

def test_with_reaping_off_a_known_leak_skips_its_victims_at_once_naming_the_leaker(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaping is off: a test's leak stays, known since its teardown. A later check that finds only that leak
    (the same processes) does not wait out its timeout: the test is skipped at once, naming the leaker, and
    only the leaker is counted with findings. Something new besides it (another test's leak) is waited for as
    usual, and a test that met it fails; from then on that leak is known too."""
    pidfile = example("verdicts/reap_off")
    report = tmp_path / "report.json"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")  # (annotations: the leakers', not the victims')
    timeout = 120  # (a victim that waited it out would stop the inner session's run)
    result = run_inner(pytester, "--gpuclean-reap=off", f"--gpuclean-timeout={timeout}",
                       f"--gpuclean-report={report}")
    first, second = read_pids(pidfile, 2)
    try:
        result.assert_outcomes(passed=2, skipped=3, errors=2)
        result.stdout.fnmatch_lines([
            "SKIPPED [[]1[]] test_inner.py:*: gpuclean: the GPUs hold what test_inner.py::test_1_leaks "
            f"leaked and reaping is off: pid {first} (GPU 0 512 MiB); not run (--gpuclean-reap=off*)",
        ])
        summary = summary_of(result)
        document = load(report)
        assert_report_consistent(document, summary)
        tests = {t["nodeid"].split("::")[1]: t for t in document["tests"]}  # type: ignore[attr-defined]
        assert sorted(name for name, t in tests.items() if t["findings"]) == [
            "test_1_leaks", "test_5_meets_a_new_leak_besides"]
        for name, leakers in (("test_2_victim", ["test_inner.py::test_1_leaks"]),
                              ("test_3_victim_too", ["test_inner.py::test_1_leaks"]),
                              ("test_6_meets_both_known", ["test_inner.py::test_1_leaks",
                                                           "test_inner.py::test_4_unmarked_leaks_too"])):
            victim = tests[name]
            assert (victim["outcome"], victim["findings"], victim["blocked_by"]) == (
                "not_clean", False, leakers), victim
            assert victim["before"]["waited_s"] < timeout / 4, victim["before"]  # not waited out
        assert tests["test_5_meets_a_new_leak_besides"]["outcome"] == "not_clean"
        assert tests["test_5_meets_a_new_leak_besides"]["blocked_by"] == []
        assert "5 checked test(s), 2 with findings, 0 process(es) reaped" in summary, summary
        assert any(line.startswith("test_inner.py::test_2_victim: noticed, not a finding: ")
                   for line in summary), summary
        annotations = [line for line in result.stdout.lines if line.startswith("::error ")]
        assert len(annotations) == 2, annotations
        assert "::test_1_leaks leaked 1 process(es)" in annotations[0]
        assert "GPUs not clean before test_inner.py::test_5_meets_a_new_leak_besides" in annotations[1]
    finally:
        kill_all([first, second])


def test_a_known_leak_is_alone_unless_something_new_holds_memory_beside_it() -> None:
    """What decides whether a check waits for GPUs that hold a known, unreaped leak: only new memory beside it
    and the excused (what their contexts cost unlisted allowed, up to a context's overhead each)."""
    gpu0, gpu1 = DeviceInfo(0, "GPU-0000", "H200"), DeviceInfo(1, "GPU-1111", "H200")
    leak, me = 4242, 10

    def snap(device: DeviceInfo, used_mib: float, *listed: tuple[int, float]) -> DeviceSnapshot:
        return DeviceSnapshot(device, int(used_mib * MIB), 80 * 1024 * MIB,
                              tuple(GpuProcess(pid, int(mib * MIB)) for pid, mib in listed))

    theirs = {me, leak}
    # The leak's 512 MiB and its context's few unlisted MiB: nothing new.
    assert not decisions.unexplained_beside([snap(gpu0, 515, (leak, 512)), snap(gpu1, 0)], theirs, 0)
    # 100 MiB unlisted beside it: more than a context costs.
    assert decisions.unexplained_beside([snap(gpu0, 612, (leak, 512)), snap(gpu1, 0)], theirs, 0)
    # Memory on another GPU that no process holds, or a process that is not the leak's.
    assert decisions.unexplained_beside([snap(gpu0, 512, (leak, 512)), snap(gpu1, 64)], theirs, 0)
    assert decisions.unexplained_beside([snap(gpu0, 576, (leak, 512), (77, 64)), snap(gpu1, 0)], theirs, 0)
    # Within the tolerance, nothing is new.
    assert not decisions.unexplained_beside([snap(gpu0, 512, (leak, 512)), snap(gpu1, 64)], theirs, 64 * MIB)


# ---- what a check excuses --------------------------------------------------------------------------------

def test_a_session_fixtures_gpu_memory_is_excused_out_loud_once(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session fixture holds 2 GiB on GPU 1 for the whole session: every check excuses it (the fixture's,
    not a test's leak), and the session says so once, naming the GPU, the memory, the fixture and why; and
    once what a count=2 test got beside it (exclusive against other tests and sessions, not against the
    session's own fixtures), which its clean_gpus devices show."""
    pidfile = example("verdicts/excused")
    seen, report = tmp_path / "seen.json", tmp_path / "report.json"
    monkeypatch.setenv("SEEN", str(seen))
    result = run_inner(pytester, f"--gpuclean-report={report}")
    result.assert_outcomes(passed=3)
    server = read_pids(pidfile)[0]
    line = _fixture_line(pytester.path / "conftest.py", "server")
    fixture = f"fixture server (session-scoped, conftest.py:{line})"
    excused = (f"gpuclean: excused: GPU 1 2048 MiB held by pid {server} of {fixture}, while the fixture is "
               "active: the fixture's own, not a test's leak")
    count = (f"gpuclean: test_inner.py::test_wants_both_gpus (count=2) got GPU 1 with 2048 MiB of {fixture} "
             "on it: count makes a test's GPUs exclusive against other tests and sessions, not against this "
             "session's own fixtures")
    summary = summary_of(result)
    assert summary.count(excused) == 1 and summary.count(count) == 1, summary
    assert summary[-1] == "3 checked test(s), 0 with findings, 0 process(es) reaped", summary
    document = load(report)
    assert_report_consistent(document, summary)
    notes = document["notes"]
    assert notes.count(excused) == 1 and notes.count(count) == 1, notes  # type: ignore[attr-defined]
    assert all(t["outcome"] == "clean" for t in document["tests"])  # type: ignore[attr-defined]
    # The count=2 test sees the memory in use on GPU 1.
    assert json.loads(seen.read_text()) == [[0, 0], [1, 2048 * MIB]]
