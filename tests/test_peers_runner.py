"""benchmarks/peers/run_peers.py judges what a peer suite's pytest left behind: that judgement, which CI
fails on, must not depend on how fast a helper that ends with pytest happens to exit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
EXAMPLES = Path(__file__).resolve().parent / "examples"

# A stand-in for a way's pytest: it starts a helper that ends on its own 1 s after its parent is gone (as
# multiprocessing's resource tracker ends on EOF from the pytest process it served, and takes its time to
# exit on a loaded box) and a setsid daemon that never ends on its own; then it exits.
STAND_IN = r"""
import os, subprocess, sys
r, w = os.pipe()
helper = subprocess.Popen(
    [sys.executable, "-c", "import os, sys, time; os.read(int(sys.argv[1]), 1); time.sleep(1)", str(r)],
    pass_fds=(r,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(helper.pid, daemon.pid, flush=True)
os._exit(0)
"""

# The runner's side, as run_way calls it once the way's pytest has been reaped.
RUNNER = """
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import run_peers
assert run_peers.set_child_subreaper()
out = subprocess.run([sys.executable, "-c", sys.argv[2]], capture_output=True, text=True, check=True).stdout
helper, daemon = map(int, out.split())
print(json.dumps({"helper": helper, "daemon": daemon, "leftovers": run_peers.end_leftovers()}))
"""


def test_a_helper_ending_after_pytest_is_not_left_behind_and_a_daemon_is() -> None:
    done = subprocess.run([sys.executable, "-c", RUNNER, str(PEERS), STAND_IN],
                          capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(done.stdout)
    leftovers = result["leftovers"]
    assert [line.split()[1] for line in leftovers] == [str(result["daemon"])], leftovers
    assert "time.sleep(60)" in leftovers[0]


def _import_run_peers() -> Any:
    sys.path.insert(0, str(PEERS))
    try:
        import run_peers
    finally:
        sys.path.remove(str(PEERS))
    return run_peers


# ---- a recorded plugin-off run standing in for the off way (CI's peer stages) --------------------------


def _run_peers(tmp_path: Path, *args: str, probe: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUCLEAN_DEAD_SESSIONS="off", PEER_PROBE="1" if probe else "0")
    return subprocess.run([sys.executable, str(PEERS / "run_peers.py"), "vllm", "tests/test_peer.py",
                           "--vllm-dir", str(tmp_path / "suite"), "--no-iomp", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_recorded_off_run_stands_in_and_a_difference_is_still_rerun_both_ways(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "peers", tmp_path / "suite")
    reference = tmp_path / "reference"
    recorded = _run_peers(tmp_path, "--ways", "off", "--record-reference", str(reference))
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    (path,) = reference.iterdir()
    record = json.loads(path.read_text())
    assert record["targets"] == ["tests/test_peer.py"]
    assert sorted(record["off"]["outcomes"].values()) == ["passed", "passed", "skipped"]

    # The two ways under gpuclean run; the off way does not (no log, no JUnit of it in the work dir).
    work = tmp_path / "work"
    used = _run_peers(tmp_path, "--simulate", "--reference-dir", str(reference), "--keep-work", str(work))
    assert used.returncode == 0, used.stdout + used.stderr
    assert f"plugin-off outcomes: the reference {path}" in used.stdout
    assert "vllm: 2 passed, 0 failed" in used.stdout
    assert sorted(p.name for p in work.glob("*.xml")) == ["all.xml", "marked.xml"]

    # An outcome gpuclean changes is caught against the record: the test runs again alone, plugin off here
    # (it passes) and under gpuclean (it fails again), and the run fails naming it.
    changed = _run_peers(tmp_path, "--simulate", "--reference-dir", str(reference), probe=True)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    for way in ("marked", "all"):
        assert (f"FAIL {way}: tests.test_peer::test_fails_only_under_gpuclean: failed with gpuclean, passed "
                "without (reproduced alone, 3 of 3 time(s))") in changed.stdout

    # Another key (here another slice) has no record: the off way runs.
    other = _run_peers(tmp_path, "--simulate", "--shard", "2", "--reference-dir", str(reference),
                       "--ways", "off")
    assert other.returncode == 0, other.stdout + other.stderr
    assert f"plugin-off outcomes: no reference in {reference}" in other.stdout


# ---- any staged suite (`run_peers.py dir`), as benchmarks/peers/run_suites.sh runs third-party suites ----


def _run_dir(tmp_path: Path, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    suite = tmp_path / "suite"
    if not suite.exists():
        shutil.copytree(EXAMPLES / "peers_dir", suite)
    env = dict(os.environ, GPUCLEAN_DEAD_SESSIONS="off")
    return subprocess.run([sys.executable, str(PEERS / "run_peers.py"), "dir", "--suite-dir", str(suite),
                           "--name", "stand-in", "--libs", "pytest", "--ways", "off,all", "--simulate",
                           "--keep-work", str(work), "--out", str(work / "out.json"),
                           "--env", "PEER_CACHE={work}/cache-{tag}/peer", *extra,
                           "--", "tests", "--ignore=tests/test_ignored.py"],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_staged_suite_runs_both_ways_in_its_own_config_with_caches_of_its_own(tmp_path: Path) -> None:
    work = tmp_path / "work"
    done = _run_dir(tmp_path, work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stand-in: 1 passed, 0 failed" in done.stdout
    result = json.loads((work / "out.json").read_text())
    assert result["name"] == "stand-in" and result["libs"] == {"pytest": pytest.__version__}
    off, on = result["results"]["off"]["outcomes"], result["results"]["all"]["outcomes"]
    # Everything after `--` went to pytest (the ignored file did not run); the names with brackets and
    # slashes are JUnit's; each run had a cache of its own (the second way did not find the first's).
    assert off == on == {
        "tests.test_fixture_leak::test_uses_the_server": "passed",
        "tests.test_suite::test_passes": "passed",
        "tests.test_suite.TestNested::test_param[a/b]": "passed",
        "tests.test_suite.TestNested::test_param[c[d]]": "passed",
        "tests.test_suite::test_cache_is_this_runs_own": "passed",
        "tests.test_suite::test_leaks_a_sleeper": "passed",
        "tests.test_suite::test_sleeps_when_asked": "passed"}
    assert sorted(p.name for p in work.glob("cache-*")) == ["cache-all", "cache-off"]
    assert result["results"]["all"]["finding_records"] == [] and result["results"]["all"]["differences"] == []


def test_a_staged_suites_leaks_are_findings_with_their_processes_and_reruns_find_the_tests(
        tmp_path: Path) -> None:
    work = tmp_path / "work"
    done = _run_dir(tmp_path, work, "--env", "PEER_LEAK=1", "--reproduce", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((work / "out.json").read_text())
    on = result["results"]["all"]
    # The leaking test, and the one at whose teardown the leaking fixture ended, error under gpuclean, alone
    # too: their node ids were found from their JUnit keys although the suite's own `-vv` changes what
    # --collect-only prints.
    assert (work / "all-rerun.keep").read_text().split() == [
        "tests/test_fixture_leak.py::test_uses_the_server", "tests/test_suite.py::test_leaks_a_sleeper"]
    assert on["differences"] == [
        {"test": test, "off": "passed", "all": "error", "alone_off": "passed", "alone_all": "error",
         "alone": [["passed", "error"]], "rerun": True, "reproduced": True}
        for test in ("tests.test_fixture_leak::test_uses_the_server",
                     "tests.test_suite::test_leaks_a_sleeper")]
    assert ("all: tests.test_suite::test_leaks_a_sleeper: error with gpuclean, passed without (reproduced "
            "alone, 1 of 1 time(s))") in result["failures"]
    # Both findings, with their processes: the fixture's too (a report's `fixtures`, not a test's outcome).
    by_where = {f["where"]: f for f in on["finding_records"]}
    assert sorted(by_where) == ["fixture", "test"]
    (leaked,) = by_where["test"]["processes"]
    assert by_where["test"]["nodeid"] == "tests/test_suite.py::test_leaks_a_sleeper"
    assert leaked["found_by"] == "descendant" and leaked["ended_by"] == "SIGTERM"
    assert "time.sleep(60)" in leaked["cmdline"]
    assert by_where["fixture"]["outcome"] == ("fixture server (module-scoped, tests/test_fixture_leak.py:11) "
                                              "leaked")
    assert "time.sleep(61)" in by_where["fixture"]["processes"][0]["cmdline"]
    assert any("leaked pid" in text and "found by descendant" in text for text in on["findings"])

    # The one-file summary of run_suites.sh: the comparison, each difference, each finding.
    staged = tmp_path / "staged"
    (staged / "stand-in").mkdir(parents=True)
    (staged / "stand-in" / "SOURCE").write_text("suite=stand-in\nversion=1.0\ntag=v1.0\n")
    (work / "out.json").rename(tmp_path / "stand-in.json")
    summary = subprocess.run([sys.executable, str(PEERS / "suites_summary.py"), "--work", str(tmp_path),
                              "--staged", str(staged), "--out", str(tmp_path / "suites.json"), "stand-in"],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 1, summary.stdout + summary.stderr
    document = json.loads((tmp_path / "suites.json").read_text())
    assert document["totals"] == {"tests": 7, "identical": 5, "differences": 2, "findings": 2,
                                  "not_compared": 0, "timed_out": 0}
    (suite,) = document["suites"]
    assert suite["source"]["tag"] == "v1.0" and suite["ways"]["all"]["identical"] == 5
    assert ("stand-in: differs: tests.test_suite::test_leaks_a_sleeper: off passed, all error"
            in summary.stdout)


def test_a_difference_that_one_rerun_repeats_but_the_next_does_not_is_the_suites_noise(
        tmp_path: Path) -> None:
    """On a busy box a test that measures the whole machine can fail under gpuclean twice in a row
    (accelerate's free-RAM test did, in the way and its first rerun alone, while neighbours' tests freed
    memory): a difference fails the run only if it reproduces in every round alone (--reproduce 3)."""
    work = tmp_path / "work"
    done = _run_dir(tmp_path, work, "--env", "PEER_FLAKY={work}/flaky-count")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((work / "out.json").read_text())
    (difference,) = result["results"]["all"]["differences"]
    assert difference == {"test": "tests.test_suite::test_passes", "off": "passed", "all": "failed",
                          "alone_off": "passed", "alone_all": "failed",
                          "alone": [["passed", "failed"], ["passed", "passed"]], "rerun": True,
                          "reproduced": False}
    assert not (work / "all-rerun3.keep").exists()  # (it stopped at the round that did not reproduce)
    assert ("not reproduced (the peer suite's flakiness): tests.test_suite::test_passes: passed -> failed, "
            "alone passed -> failed, passed -> passed") in done.stdout


def test_a_difference_that_cannot_run_alone_is_no_flakiness(tmp_path: Path) -> None:
    """A rerun alone that gives no outcome at all (its collection broke) rules nothing out: the difference
    fails the run, rather than pass as 'not reproduced'."""
    work = tmp_path / "work"
    done = _run_dir(tmp_path, work, "--env", "PEER_FLAKY={work}/flaky-count", "--env", "PEER_NO_RERUN=1")
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((work / "out.json").read_text())
    (difference,) = result["results"]["all"]["differences"]
    assert difference["alone"] == [[None, None]] and not difference["reproduced"]
    assert result["failures"] == [
        "all: tests.test_suite::test_passes: failed with gpuclean, passed without; run again alone it gave "
        f"no outcome (see {work}/all-rerun*.log)"]
    assert "not reproduced" not in done.stdout


def _cut_short(tmp_path: Path, way: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], Any, Any]:
    """Run the stand-in suite (work folder tmp_path/work), which must fail with ``way`` timed out: the run's
    output, its --out document and that way's result."""
    done = _run_dir(tmp_path, tmp_path / "work", *extra)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((tmp_path / "work" / "out.json").read_text())
    res = result["results"][way]
    assert res["timed_out"].startswith("TIMED OUT after "), res
    return done, result, res


def test_a_budget_ends_each_way_as_a_time_out(tmp_path: Path) -> None:
    # A test that hangs (120 s) in every way: with --budget 40 the off way gets what is left (less 15 s for
    # the results) and is killed then; the failure is that time-out, with the test it was in, not "no
    # outcomes".
    done, result, off = _cut_short(tmp_path, "off", "--env", "PEER_SLOW=1", "--budget", "40")
    assert "(what --budget 40s left): killed, while tests/test_suite.py::test_sleeps_when_asked ran" in (
        off["timed_out"])
    assert result["failures"][0] == f"off: {off['timed_out']}; 6 test(s) ended"
    assert not any("no JUnit outcomes" in f or "ran other tests" in f for f in result["failures"])
    # The tests it ended before the hang are its outcomes (the progress file: no JUnit XML of a killed way).
    assert len(off["outcomes"]) == 6 and set(off["outcomes"].values()) == {"passed"}
    assert "stand-in: 0 passed, 1 failed (TIMED OUT: off, all)" in done.stdout


def test_a_way_that_hangs_is_a_time_out_and_only_what_both_ways_ended_is_compared(tmp_path: Path) -> None:
    """The gpuclean way hangs in its last test (the off way does not): it is killed when no test started or
    ended for --stall-timeout, the run fails on that time-out, named as one, and the six tests both ways ended
    are compared (identical), the seventh is 'not compared', never a difference."""
    work = tmp_path / "work"
    done, result, on = _cut_short(tmp_path, "all", "--env", "PEER_SLOW=gpuclean", "--stall-timeout", "15")
    assert ("no test started or ended for 15s (--stall-timeout): killed, while "
            "tests/test_suite.py::test_sleeps_when_asked ran") in on["timed_out"]
    assert result["results"]["off"]["timed_out"] is None
    assert len(result["results"]["off"]["outcomes"]) == 7
    assert on["not_compared"] == ["tests.test_suite::test_sleeps_when_asked"]
    assert on["differences"] == [] and on["differs"] == []
    assert result["failures"] == [f"all: {on['timed_out']}; 6 test(s) ended, 6 compared with off, 1 not"]
    assert "stand-in: 0 passed, 1 failed (TIMED OUT: all)" in done.stdout
    assert f"all: {on['timed_out']}" in done.stdout

    # run_suites.sh's summary says it as a time-out too.
    staged = tmp_path / "staged"
    (staged / "stand-in").mkdir(parents=True)
    (work / "out.json").rename(tmp_path / "stand-in.json")
    summary = subprocess.run([sys.executable, str(PEERS / "suites_summary.py"), "--work", str(tmp_path),
                              "--staged", str(staged), "--out", str(tmp_path / "suites.json"), "stand-in"],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 1, summary.stdout + summary.stderr
    assert f"stand-in: all {on['timed_out']}" in summary.stdout
    document = json.loads((tmp_path / "suites.json").read_text())
    assert document["totals"] == {"tests": 7, "identical": 6, "differences": 0, "findings": 0,
                                  "not_compared": 1, "timed_out": 1}
    row = next(line for line in summary.stdout.splitlines() if line.startswith("stand-in "))
    assert "TIMED OUT" in row, summary.stdout


def test_a_slow_way_that_keeps_ending_tests_is_not_cut_short(tmp_path: Path) -> None:
    """Each test takes 3 s (a slow box): the way takes longer in all than --stall-timeout, and is not killed,
    since a test starts or ends every 3 s. Time never fails a way that makes progress."""
    work = tmp_path / "work"
    done = _run_dir(tmp_path, work, "--env", "PEER_STEP_S=3", "--stall-timeout", "15", "--ways", "off")
    assert done.returncode == 0, done.stdout + done.stderr
    off = json.loads((work / "out.json").read_text())["results"]["off"]
    assert off["timed_out"] is None and off["wall_s"] > 15, off
    assert len(off["outcomes"]) == 7 and set(off["outcomes"].values()) == {"passed"}


def test_a_gpuclean_way_without_its_report_fails(tmp_path: Path) -> None:
    """A way under gpuclean whose report is missing (here written elsewhere) cannot vouch for no findings."""
    work = tmp_path / "work"
    elsewhere = tmp_path / "elsewhere.json"
    done = _run_dir(tmp_path, work, f"--gpuclean-args=--gpuclean-report={elsewhere}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert elsewhere.exists()
    result = json.loads((work / "out.json").read_text())
    assert len(result["failures"]) == 1
    assert result["failures"][0].startswith(f"all: gpuclean wrote no report ({work / 'all.json'})")


def test_a_suite_that_errors_without_the_plugin_fails_instead_of_comparing(tmp_path: Path) -> None:
    """Identical outcomes of a suite whose every test errors plain (joblib's conftest, under CI's
    OMP_NUM_THREADS) say nothing about the plugin: the run fails and says why."""
    work, reference = tmp_path / "work", tmp_path / "reference"
    done = _run_dir(tmp_path, work, "--env", "PEER_BROKEN=1", "--record-reference", str(reference))
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((work / "out.json").read_text())
    assert set(result["results"]["off"]["outcomes"].values()) == {"error"}
    assert not reference.exists() or list(reference.iterdir()) == []  # nor recorded as a reference
    assert result["failures"][0].startswith("the plugin-off run errored in 7 of its 7 tests: the suite does "
                                            "not run here"), result["failures"]


def test_the_comparison_holds_only_what_both_ways_ended_once_one_was_cut_short() -> None:
    run_peers = _import_run_peers()
    off = {"outcomes": {"a": "passed", "b": "passed", "c": "failed"}, "timed_out": None}
    cut = {"outcomes": {"a": "passed", "b": "failed"}, "timed_out": "TIMED OUT after 300s: ..."}
    assert run_peers.compared_tests(off, cut) == ({"a", "b"}, ["c"])
    assert run_peers.compared_tests(dict(cut, outcomes={"a": "passed"}), off) == ({"a"}, ["b", "c"])
    # Neither cut short: a test only one way ran is compared (and differs).
    whole = {"outcomes": {"a": "passed", "d": "passed"}, "timed_out": None}
    assert run_peers.compared_tests(off, whole) == ({"a", "b", "c", "d"}, [])
    # A recorded reference (no time-out key) stands in for off.
    assert run_peers.compared_tests({"outcomes": off["outcomes"]}, cut) == ({"a", "b"}, ["c"])


def test_a_ways_progress_gives_the_outcomes_its_junit_xml_gives(tmp_path: Path) -> None:
    """peers_select.py's progress file (what a killed way leaves) reads as JUnit XML does: errors at setup
    or teardown, failures, skips and passes, keyed as JUnit keys them."""
    run_peers = _import_run_peers()
    (tmp_path / "test_kinds.py").write_text(
        "import pytest\n"
        "@pytest.fixture\ndef broken_teardown():\n    yield\n    raise RuntimeError('teardown')\n"
        "@pytest.fixture\ndef broken_setup():\n    raise RuntimeError('setup')\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "def test_skips():\n    pytest.skip('no')\n"
        "@pytest.mark.xfail\ndef test_xfails():\n    assert False\n"
        "def test_setup_error(broken_setup):\n    pass\n"
        "def test_teardown_error(broken_teardown):\n    pass\n"
        "def test_fails_and_teardown_error(broken_teardown):\n    assert False\n"
        "class TestIn:\n    @pytest.mark.parametrize('v', ['a/b', 'c[d]'])\n"
        "    def test_param(self, v):\n        pass\n")
    path = os.pathsep.join(filter(None, [str(PEERS), os.environ.get("PYTHONPATH")]))
    progress = tmp_path / "progress"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "peers_select", "-p", "no:gpuclean",
                    "-p", "no:cacheprovider", "--junitxml", str(tmp_path / "out.xml"), "test_kinds.py"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": path, "PEERS_PROGRESS_FILE": str(progress)})
    outcomes, running = run_peers.read_progress(progress)
    junit = run_peers.junit_outcomes(tmp_path / "out.xml")
    assert outcomes == junit and running is None
    assert sorted(junit.values()) == ["error", "error", "error", "failed", "passed", "passed", "passed",
                                      "skipped", "skipped"]
    # A killed way's file ends in the test that had started: that is the one it was in.
    with progress.open("a") as f:
        f.write("start\ttest_kinds.py::test_hangs\n")
    assert run_peers.read_progress(progress) == (junit, "test_kinds.py::test_hangs")


def test_the_parts_of_a_shard_cover_a_suite_once(tmp_path: Path) -> None:
    """``PEERS_SHARD=K`` with ``PEERS_SHARD_PART`` 0..K-1 runs every test exactly once over the K runs: how a
    suite whose two ways do not fit one device call is compared whole (Lightning Fabric on the H200)."""
    (tmp_path / "test_many.py").write_text(
        "import pytest\n@pytest.mark.parametrize('i', range(60))\ndef test_x(i):\n    print('RAN', i)\n")
    path = os.pathsep.join(filter(None, [str(PEERS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PEERS_SHARD": "3"}
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "peers_select", "-p", "no:gpuclean",
                  "-p", "no:cacheprovider", "test_many.py"]
    ran: list[list[str]] = []
    for part in range(3):
        listing = tmp_path / f"part{part}.txt"
        proc = subprocess.run(pytest_cmd, cwd=tmp_path, capture_output=True, text=True,
                              env={**env, "PEERS_SHARD_PART": str(part), "PEERS_LIST_FILE": str(listing)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ran.append(re.findall(r"RAN (\d+)", proc.stdout))
        assert sorted(line.split("\t")[1] for line in listing.read_text().splitlines()) == sorted(
            f"test_many.py::test_x[{i}]" for i in ran[-1])
    assert all(ran), ran  # each part keeps some of 60
    assert sorted(int(i) for part in ran for i in part) == list(range(60))
    bad = subprocess.run(pytest_cmd, cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "PEERS_SHARD_PART": "3"})
    assert bad.returncode != 0
    assert "PEERS_SHARD_PART=3: not a part of PEERS_SHARD=3" in bad.stdout + bad.stderr


def test_a_tests_growth_in_the_report_is_a_finding_and_within_the_floor_a_note() -> None:
    """The comparison counts what gpuclean's summary counts. The report names a test's in-process growth only
    above the floor (``in_process_mib``, then ``findings`` true): one of its findings, a warning that fails
    nothing (Lightning, H200 run 72). Growth within the floor is in the session's notes alone."""
    run_peers = _import_run_peers()

    def test(nodeid: str, grew_mib: float | None) -> dict[str, object]:
        return {"nodeid": nodeid, "outcome": "clean", "findings": grew_mib is not None, "leaked": [],
                "found_later": [], "before": None, "after": None,
                "in_process_mib": [] if grew_mib is None else [{"device": "cuda:0", "mib": grew_mib}]}

    within = ("gpuclean: torch memory in the pytest process grew in 1 test(s), within 64 MiB per device, not "
              "findings (cuda:0 +1.0 MiB in all: caches torch fills once per process): t.py::cache (+1.0)")
    report = {"tests": [test("t.py::kept", 65.0), test("t.py::cache", None)], "fixtures": [],
              "session_reaped": [], "notes": [within], "summary": {"with_findings": 1}}
    assert run_peers.findings(report) == [
        "t.py::kept: torch memory grew in-process (a warning): cuda:0 65.0 MiB"]
    assert run_peers.report_notes(report)["notes"] == [within]
