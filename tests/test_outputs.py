"""CI outputs: the JSON report against its schema (also merged under xdist), JUnit properties,
GitHub annotations and the job summary; inner pytest sessions over simulated devices."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from helpers import (
    alive,
    assert_report_consistent,
    clean_environment,
    isolate_inner_sessions,
    read_pids,
    run_inner,
    summary_of,
    unprivileged,
    wait_dead,
)

from pytest_gpuclean._reading.simulated import simulated_uuid
from pytest_gpuclean.report import ci, jsonreport


@pytest.fixture(autouse=True)
def _isolated_inner_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_inner_sessions(monkeypatch)


def validate(document: Any) -> None:
    """Validate against the shipped schema, date-time formats included."""
    validator = jsonschema.Draft202012Validator(jsonreport.load_schema(),
                                                format_checker=jsonschema.FormatChecker())
    validator.validate(document)


def first_line(path: Path, function: str) -> int:
    """1-based line where pytest says ``function`` starts: its first decorator, else its ``def``."""
    lines = path.read_text().splitlines()
    index = next(i for i, text in enumerate(lines) if text.startswith(f"def {function}("))
    while index > 0 and lines[index - 1].startswith("@"):
        index -= 1
    return index + 1


def by_nodeid(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["nodeid"]: t for t in document["tests"]}


# ---- JSON report -------------------------------------------------------------------------------------

def test_with_findings_counts_only_the_tests_at_fault_as_the_json_does(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # Issue 37: a test whose setup reaped an earlier test's leak was counted "with findings" beside the
    # tests that leaked, while its JSON outcome said clean. It is a victim: noticed, not counted.
    example("outputs/victims")
    result = run_inner(pytester, "--gpuclean-report=report.json")
    result.assert_outcomes(passed=5, errors=2)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    by_test = {t["nodeid"].split("::")[1]: t for t in document["tests"]}
    at_fault = sorted(name for name, t in by_test.items() if t["findings"])
    assert at_fault == ["test_1_unchecked_leaks", "test_3_leaks", "test_5_leaks_too"]
    assert by_test["test_2_victim_reaps_it_before"]["outcome"] == "clean"
    assert by_test["test_2_victim_reaps_it_before"]["before"]["reaped"]  # it reaped the leak, for the leaker
    # The count is of every test at fault (the unchecked leaker too, also named in a part of its own), and
    # the JSON says the same.
    assert document["summary"]["with_findings"] == 3
    assert_report_consistent(document, summary_of(result))
    out = result.stdout.str()
    assert "4 checked test(s), 3 with findings, 1 unchecked test(s) that leaked processes" in out
    result.stdout.fnmatch_lines(["test_inner.py::test_2_victim_reaps_it_before: noticed, not a finding: "
                                 "setup: reaped 1 *"])


def test_report_has_a_record_per_checked_test_and_matches_its_schema(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path) -> None:
    pidfile = example("outputs/leaks_and_clean")
    (pytester.path / "out").mkdir()
    result = run_inner(pytester, "--gpuclean-report=out/report.json", "--gpuclean-grace=2")
    result.assert_outcomes(passed=3, errors=1)
    leaked_pid = int(pidfile.read_text().split()[-1])
    document = json.loads((pytester.path / "out" / "report.json").read_text())
    validate(document)
    assert os.listdir(pytester.path / "out") == ["report.json"]  # the temp file was renamed, not left

    assert document["schema_version"] == 1
    session = document["session"]
    assert (session["backend"], session["driver"]) == ("simulated", "simulated")
    assert session["xdist_workers"] is None
    assert [d["uuid"] for d in session["devices"]] == [simulated_uuid(sim, 0), simulated_uuid(sim, 1)]
    assert session["exitstatus"] == 1 and session["settings"]["grace"] == 2
    assert document["versions"]["pytest_gpuclean"] == "0.1.0"
    assert document["summary"] == {"tests": 2, "checked": 2, "with_findings": 1, "clean": 1, "leaked": 1,
                                   "not_clean": 0,
                                   "gpu_fault": 0, "reaped": 1, "lock_timeouts": 0, "fixture_leaks": 0,
                                   "device_errors": 0,
                                   "dirty_from_outside": 0}

    tests = by_nodeid(document)
    assert set(tests) == {"test_inner.py::test_leaks", "test_inner.py::test_clean"}
    leaks = tests["test_inner.py::test_leaks"]
    assert (leaks["outcome"], leaks["file"]) == ("leaked", "test_inner.py")
    assert leaks["line"] == first_line(pytester.path / "test_inner.py", "test_leaks")
    assert leaks["before"]["clean"] and leaks["after"]["clean"]  # reaping made it clean again
    [reaped] = leaks["after"]["reaped"]
    assert reaped["process"]["pid"] == leaked_pid and reaped["ended_by"] == "SIGTERM"
    assert reaped["owner"] == {"kind": "test", "name": "test_inner.py::test_leaks"}
    assert reaped["mib_per_device"] == [{"device": "GPU 0", "mib": 64.0}]
    assert [(p["pid"], p["found"], p["ended_by"]) for p in leaks["leaked"]] == [
        (leaked_pid, "teardown", "SIGTERM")]
    assert leaks["before"]["devices"][0]["used_bytes"] == 0
    assert leaks["after"]["devices"][0]["used_bytes"] == 0
    clean = tests["test_inner.py::test_clean"]
    assert clean["outcome"] == "clean" and clean["leaked"] == [] and clean["after"]["reaped"] == []
    assert not alive(leaked_pid)
    assert "::error" not in result.stdout.str()  # not on GitHub: no workflow commands


def test_report_records_gpus_that_were_not_clean(example: Callable[..., Path], pytester: pytest.Pytester,
                                                 outside_holder: Callable[..., int]) -> None:
    foreign = outside_holder(device=1, mib=32)
    example("outputs/report_records_gpus_that_were_not_clean")
    result = run_inner(pytester, "--gpuclean-report=report.json")
    result.assert_outcomes(errors=1)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    [test] = document["tests"]
    assert test["outcome"] == "not_clean" and test["after"] is None
    [offender] = test["before"]["offenders"]
    assert (offender["reason"], offender["process"]["pid"]) == ("foreign", foreign)
    assert offender["mib_per_device"] == [{"device": "GPU 1", "mib": 32.0}]
    assert test["before"]["devices"][1]["processes"] == [
        {"pid": foreign, "used_bytes": 32 * 1024 * 1024, "used_mib": 32.0}]
    assert alive(foreign)  # another session's process: waited for, never killed


def test_report_with_reaping_off_shows_a_leak_that_ended_by_itself(example: Callable[..., Path],
                                                                   pytester: pytest.Pytester) -> None:
    pidfile = example("outputs/report_with_reaping_off_shows")
    result = run_inner(pytester, "--gpuclean-reap=off", "--gpuclean-report=report.json")
    result.assert_outcomes(passed=1, errors=1)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    [test] = document["tests"]
    pid = int(pidfile.read_text().split()[0])
    assert test["outcome"] == "leaked" and test["after"]["reaped"] == []
    assert [o["process"]["pid"] for o in test["after"]["lingered"]] == [pid]
    assert [(p["pid"], p["ended_by"]) for p in test["leaked"]] == [(pid, "exited by itself")]
    assert document["summary"]["leaked"] == 1 and document["summary"]["reaped"] == 0


def test_report_under_xdist_is_merged_from_the_workers(example: Callable[..., Path],
                                                       pytester: pytest.Pytester) -> None:
    example("outputs/report_under_xdist_is_merged")
    result = run_inner(pytester, "-n", "2", "--gpuclean-report=report.json", "--junitxml=junit.xml",
                       "--gpuclean-grace=2")
    result.assert_outcomes(passed=8, errors=4)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    assert_report_consistent(document, summary_of(result))
    assert document["session"]["xdist_workers"] == 2
    tests = by_nodeid(document)
    assert set(tests) == {f"test_inner.py::test_{name}[{n}]" for name in ("leaks", "clean") for n in range(4)}
    leaked = {p["pid"] for t in tests.values() for p in t["leaked"]}
    assert leaked == {int(p) for p in (pytester.path / "spawned.pids").read_text().split()}
    assert len(leaked) == 4
    assert document["summary"]["leaked"] == 4 and document["summary"]["clean"] == 4
    # JUnit properties travel from the workers' reports to the controller's junitxml.
    properties = junit_properties(pytester.path / "junit.xml")
    assert {properties[f"test_leaks[{n}]"]["gpuclean_outcome"] for n in range(4)} == {"leaked"}
    assert {int(properties[f"test_leaks[{n}]"]["gpuclean_reaped_pids"]) for n in range(4)} == leaked


def test_a_report_that_cannot_be_written_fails_the_run(example: Callable[..., Path],
                                                       pytester: pytest.Pytester) -> None:
    example("outputs/a_report_that_cannot_be")
    (pytester.path / "out").mkdir()
    result = run_inner(pytester, "--gpuclean-report=out/report.json")
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR
    result.stdout.fnmatch_lines(["gpuclean: could not write the report */out/report.json: *"])


def test_the_last_sweep_of_the_session_set_up_is_in_the_report_and_on_its_own_line(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("outputs/leaks_and_clean")
    pytester.copy_example("outputs/conftest_sleeper")
    result = run_inner(pytester, "--gpuclean-report=report.json", "--gpuclean-grace=2")
    result.assert_outcomes(passed=3, errors=1)
    sleeper, leak = read_pids(pidfile, 2)
    assert not alive(sleeper)
    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    reaped = {r["process"]["pid"]: r for r in document["session_reaped"]}
    assert set(reaped) == {sleeper}
    assert reaped[sleeper]["owner"]["kind"] == "session"
    assert reaped[sleeper]["ended_by"] == "SIGTERM"
    assert reaped[sleeper]["process"]["cmdline"] == "sleep 600"
    assert document["summary"]["reaped"] == 2  # the test's leak and the sleeper
    assert [p["pid"] for t in document["tests"] for p in t["leaked"]] == [leak]
    # Through the terminal reporter, on a line of its own after the summary; not glued to stderr.
    lines = result.stdout.lines
    last = [i for i, line in enumerate(lines) if "of the session set-up" in line]
    assert len(last) == 1
    assert lines[last[0]].startswith("gpuclean: reaped 1 process(es) of the session set-up (conftest, "
                                     f"plugins) still alive after pytest_unconfigure: pid {sleeper} SIGTERM")
    assert last[0] > next(i for i, line in enumerate(lines) if "1 error" in line)
    assert "session set-up" not in result.stderr.str()


def test_the_report_directory_is_made_as_junitxml_makes_its_own(example: Callable[..., Path],
                                                                 pytester: pytest.Pytester) -> None:
    # The CI command docs/ci.md gives, on a fresh checkout that has no reports/ directory.
    example("outputs/leaks_and_clean")
    result = run_inner(pytester, "--gpuclean-report=reports/gpu/gpuclean.json",
                       "--junitxml=reports/junit.xml", "--gpuclean-grace=2")
    result.assert_outcomes(passed=3, errors=1)
    document = json.loads((pytester.path / "reports" / "gpu" / "gpuclean.json").read_text())
    validate(document)
    assert document["summary"]["leaked"] == 1
    assert (pytester.path / "reports" / "junit.xml").is_file()


LONG_NAME = "x" * 300  # over NAME_MAX: its mkdir fails after reports/ was made


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--gpuclean-report=."], {},
     "ERROR: --gpuclean-report: '.' is a directory; give a file path (from the command line)"),
    (["--gpuclean-report=afile/sub/report.json"], {},
     "ERROR: --gpuclean-report: cannot create directory '*/afile/sub': '*/afile' is not a directory "
     "(from the command line)"),
    ([], {"GPUCLEAN_REPORT": f"reports/{LONG_NAME}/r.json"},
     "ERROR: --gpuclean-report: cannot create directory '*/reports/xxx*': File name too long (from "
     "environment variable GPUCLEAN_REPORT)"),
    # The report's own name too long: the first look at the path fails (was an INTERNALERROR).
    ([f"--gpuclean-report={LONG_NAME}.json"], {},
     "ERROR: --gpuclean-report: cannot use '*/xxx*.json': File name too long (from the command line)"),
])
def test_a_bad_report_path_is_a_usage_error_at_startup(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        args: list[str], env: dict[str, str], message: str) -> None:
    example("outputs/leaks_and_clean")
    (pytester.path / "afile").write_text("")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = run_inner(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert (pytester.path / "afile").read_text() == ""
    assert not (pytester.path / "reports").exists()  # what it made before the failure is gone again
    assert not (pytester.path / "leak.pids").exists()  # no test ran


@pytest.mark.parametrize(("args", "env", "ini", "path", "source"), [
    (["--gpuclean-report=closed/r.json"], {}, "", "closed/r.json", "from the command line"),
    ([], {"GPUCLEAN_REPORT": "closed/r.json"}, "", "closed/r.json",
     "from environment variable GPUCLEAN_REPORT"),
    ([], {}, "[pytest]\ngpuclean_report = closed/r.json\n", "closed/r.json",
     "from ini option gpuclean_report in */pytest.ini"),
    (["--gpuclean-report=closed/sub/r.json"], {}, "", "closed/sub/r.json", "from the command line"),
], ids=["cli", "env", "ini", "cli-below"])
def test_a_report_path_the_user_may_not_reach_is_a_usage_error(
        public_tmp: Path, args: list[str], env: dict[str, str], ini: str, path: str, source: str) -> None:
    # As an unprivileged user, a report under a directory it may not search (another user's home): the
    # first look at the path is refused (EACCES), which was an INTERNALERROR of 30 lines.
    closed = public_tmp / "closed"
    closed.mkdir()
    closed.chmod(0)
    (public_tmp / "test_a.py").write_text("def test_a():\n    pass\n")
    if ini:
        (public_tmp / "pytest.ini").write_text(ini)
    command = unprivileged([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider",
                            *args])
    result = subprocess.run(command, cwd=public_tmp, env=clean_environment(**env), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr
    wanted = f"ERROR: --gpuclean-report: cannot use '{public_tmp / path}': Permission denied ({source})"
    assert fnmatch.fnmatch(result.stderr.strip(), wanted), result.stderr


# ---- JUnit -------------------------------------------------------------------------------------------

def junit_properties(path: Path) -> dict[str, dict[str, str]]:
    """testcase name -> its properties."""
    tree = ET.parse(path)
    return {case.get("name", ""): {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
            for case in tree.iter("testcase")}


def test_junitxml_carries_gpuclean_properties(example: Callable[..., Path],
                                              pytester: pytest.Pytester) -> None:
    pidfile = example("outputs/leaks_and_clean")
    result = run_inner(pytester, "--junitxml=junit.xml", "--gpuclean-grace=2")
    result.assert_outcomes(passed=3, errors=1)
    properties = junit_properties(pytester.path / "junit.xml")
    leaks = properties["test_leaks"]
    assert (leaks["gpuclean_outcome"], leaks["gpuclean_leaked"]) == ("leaked", "1")
    assert leaks["gpuclean_reaped_pids"] == pidfile.read_text().split()[0]
    for name in ("gpuclean_release_s", "gpuclean_before_s", "gpuclean_after_s", "gpuclean_lock_wait_s"):
        assert float(leaks[name]) >= 0
    clean = properties["test_clean"]
    assert (clean["gpuclean_outcome"], clean["gpuclean_leaked"], clean["gpuclean_reaped_pids"],
            clean["gpuclean_release_s"]) == ("clean", "0", "", "")
    assert properties["test_unchecked"] == {}



def test_without_junitxml_no_properties_are_built(example: Callable[..., Path],
                                                  pytester: pytest.Pytester) -> None:
    # They are for junitxml alone: a run without it must not pay for them on every checked test.
    example("outputs/leaks_and_clean")
    pytester.copy_example("outputs/print_props")  # a conftest that prints each test's user properties
    result = run_inner(pytester, "-s", "--gpuclean-grace=2")
    result.assert_outcomes(passed=3, errors=1)
    props = [line[line.index("PROPS"):] for line in result.outlines if "PROPS" in line]
    assert sorted(props) == ["PROPS test_clean []", "PROPS test_leaks []", "PROPS test_unchecked []"]

# ---- GitHub ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "data", "prop"), [
    ("50% done", "50%25 done", "50%25 done"),
    ("a\r\nb", "a%0D%0Ab", "a%0D%0Ab"),
    ("file: a,b", "file: a,b", "file%3A a%2Cb"),
    ("%0A", "%250A", "%250A"),  # an escape sequence in the input is not an escape
])
def test_workflow_command_escaping(text: str, data: str, prop: str) -> None:
    assert ci.escape_data(text) == data
    assert ci.escape_property(text) == prop


def test_workflow_command_shape() -> None:
    line = ci.workflow_command("error", "two\nlines: 100%", [("file", "a,b.py"), ("title", "GPU leak")])
    assert line == "::error file=a%2Cb.py,title=GPU leak::two%0Alines: 100%25"


def test_github_annotations_and_job_summary(example: Callable[..., Path], pytester: pytest.Pytester,
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("GITHUB_WORKSPACE", str(pytester.path.parent))
    pidfile = example("outputs/github_annotations_and_job_summary")
    result = run_inner(pytester, "--gpuclean-grace=2")
    result.assert_outcomes(passed=2, errors=1)
    pid = int(pidfile.read_text().split()[0])
    line = first_line(pytester.path / "test_inner.py", "test_weird")
    annotations = [text for text in result.stdout.lines if text.startswith("::")]
    assert len(annotations) == 1
    [annotation] = annotations
    # The path is relative to GITHUB_WORKSPACE; pytest shows the newline of the id as "\n".
    workspace_path = f"{pytester.path.name}/test_inner.py"
    assert annotation.startswith(
        f"::error file={workspace_path},line={line},title=GPU leak::"
        f"test_inner.py::test_weird[50%25:a\\nb,c] leaked 1 process(es)%0Apid {pid} ended by SIGTERM")
    message = annotation.split("::", 2)[2]
    assert re.search(r"%(?!25|0A|0D)", message) is None  # every % is escaped
    assert "\r" not in annotation

    text = summary.read_text()
    assert text.startswith("earlier step\n### gpuclean: 2 checked test(s), 1 leaked, 0 met GPUs that were "
                           "not clean, 1 process(es) reaped\n")
    assert "| Test | Verdict | Processes | Driver release | Before check | After check |" in text
    assert f"| `test_inner.py::test_weird[50%:a\\nb,c]` | leaked | pid {pid} SIGTERM |" in text
    assert "test_clean" not in text


def test_github_hears_of_the_last_sweep_of_the_session_set_up(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    summary = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    pidfile = example("outputs/github_hears_of_the_last")
    pytester.copy_example("outputs/conftest_sleeper")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1)
    [sleeper] = read_pids(pidfile)
    annotations = [text for text in result.stdout.lines if text.startswith("::")]
    assert annotations == [f"::error title=GPU leak::gpuclean reaped 1 leftover process(es) at session end%0A"
                           f"pid {sleeper} ended by SIGTERM: (session pytest session (conftest, plugins, "
                           "collection)) sleep 600"]
    assert summary.read_text().endswith(
        f"\nReaped after pytest_unconfigure (the session set-up's): pid {sleeper} SIGTERM\n")


def test_github_annotation_for_gpus_that_were_not_clean(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        outside_holder: Callable[..., int]) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    foreign = outside_holder(device=0, mib=8)
    example("outputs/github_annotation_for_gpus_that")
    result = run_inner(pytester)
    result.assert_outcomes(errors=1)
    annotations = [text for text in result.stdout.lines if text.startswith("::")]
    assert len(annotations) == 1
    line = first_line(pytester.path / "test_inner.py", "test_meets_a_busy_gpu")
    assert annotations[0].startswith(
        f"::error file=test_inner.py,line={line},title=GPU not clean::GPUs not clean before "
        "test_inner.py::test_meets_a_busy_gpu (waited ")
    assert f"%0Aforeign pid {foreign} (user " in annotations[0]


# ---- a fixture wider than a test leaks ---------------------------------------------------------------

@pytest.mark.parametrize("reap", ["on", "off"])
def test_a_session_fixture_leak_is_the_fixtures_not_the_last_tests(
        pytester: pytest.Pytester, sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        reap: str) -> None:
    # pytest tears a session fixture down at the teardown of the session's last test (test_d, which does
    # not use it): the finding is the fixture's in the headline, the summary, the JSON report, the JUnit
    # properties and the GitHub annotation (at the fixture's definition), never test_d's leak.
    pidfile = tmp_path / "leak.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    pytester.copy_example("prelude.py")
    pytester.copy_example("outputs/engine")  # conftest.py (the engine fixture), test_1.py, test_2.py
    line = first_line(pytester.path / "conftest.py", "engine")
    # (dead-sessions off: what other sessions of this user on the machine left is not this test's matter)
    result = run_inner(pytester, "--gpuclean-report=report.json", "--junitxml=junit.xml",
                       f"--gpuclean-reap={reap}", "--gpuclean-timeout=0.5", "--gpuclean-grace=2",
                       "--gpuclean-dead-sessions=off")
    server = read_pids(pytester.path / "server.pid")[0]
    workers = sorted(set(read_pids(pidfile, 3)) - {server})
    result.assert_outcomes(passed=4, errors=1)
    fixture = f"fixture engine (session-scoped, conftest.py:{line})"
    state = "reaped" if reap == "on" else "reaping is off: reported only"
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_d*",
        f"gpuclean: {fixture} leaked 2 process(es) ({state}), found at the teardown of test_2.py::test_d",
    ])
    if reap == "on":
        result.stdout.fnmatch_lines([
            "*= gpuclean =*",
            f"{fixture}, found at the teardown of test_2.py::test_d: leaked 2 process(es) (pid * SIGTERM, "
            "pid * SIGTERM)",
            "4 checked test(s), 0 with findings, 1 fixture(s) that leaked processes, 2 process(es) reaped",
        ])
        assert wait_dead(workers, timeout=2) == []
    # No line blames test_d: neither the headline nor test_d's own line in the summary.
    assert "test leaked" not in result.stdout.str()
    assert not [text for text in result.stdout.lines if text.startswith("test_2.py::test_d:")]

    document = json.loads((pytester.path / "report.json").read_text())
    validate(document)
    assert_report_consistent(document, summary_of(result) if reap == "on" else None)
    assert {t["nodeid"]: t["outcome"] for t in document["tests"]} == {
        f"test_{f}.py::test_{t}": "clean" for f, t in (("1", "a"), ("1", "b"), ("2", "c"), ("2", "d"))}
    test_d = by_nodeid(document)["test_2.py::test_d"]
    assert test_d["leaked"] == [] and test_d["after"]["reaped"] == [] and test_d["after"]["offenders"] == []
    [leak] = document["fixtures"]
    assert {k: leak[k] for k in ("name", "scope", "file", "line", "reported_on")} == {
        "name": "engine", "scope": "session", "file": "conftest.py", "line": line,
        "reported_on": "test_2.py::test_d"}
    ended = "SIGTERM" if reap == "on" else None
    assert sorted((p["pid"], p["ended_by"], p["owner"]["kind"]) for p in leak["leaked"]) == [
        (pid, ended, "fixture") for pid in workers]
    assert sorted(r["process"]["pid"] for r in leak["reaped"]) == (workers if reap == "on" else [])
    summary = document["summary"]
    assert (summary["leaked"], summary["fixture_leaks"], summary["clean"]) == (0, 1, 4)
    assert summary["reaped"] == (2 if reap == "on" else 0)

    properties = junit_properties(pytester.path / "junit.xml")["test_d"]
    assert (properties["gpuclean_outcome"], properties["gpuclean_leaked"]) == ("clean", "0")
    assert properties["gpuclean_fixture_leaks"] == f"{fixture} leaked 2 process(es)"

    annotations = [text for text in result.stdout.lines if text.startswith("::")]
    assert len(annotations) == 1, annotations
    assert annotations[0].startswith(
        f"::error file=conftest.py,line={line},title=GPU leak::{fixture} leaked 2 process(es), found at "
        "the teardown of test_2.py::test_d%0Apid ")
    assert not alive(server)
