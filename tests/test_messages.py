"""What the plugin says, where and when: its notes never become a test's failure nor land on another
test (under ``-W error``, ``filterwarnings = error`` or without pytest's warnings plugin), an interrupt
says what it waits for, and a traceback after SIGTERM points at the test, not at the plugin."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import (
    alive,
    children_sigint,
    clean_environment,
    marked_line,
    read_pids,
    run_inner,
    summary_of,
    wait_dead,
    wait_for_file,
)

PLUGIN_FILES = "pytest_gpuclean/"

WARNING_MODES = {
    "-W error": (("-W", "error"), ""),
    "filterwarnings = error": ((), "[pytest]\nfilterwarnings =\n    error\n"),
    "-p no:warnings": (("-p", "no:warnings"), ""),
    "default": ((), ""),
}
"""How a run treats warnings: each of the plugin's notes must read the same in all of them."""


def run_in_mode(pytester: pytest.Pytester, mode: str, *args: str) -> pytest.RunResult:
    """An inner session whose warnings are treated as ``mode`` says."""
    extra, ini = WARNING_MODES[mode]
    if ini:
        pytester.makeini(ini)
    return run_inner(pytester, *extra, *args)


def assert_no_plugin_traceback(result: pytest.RunResult) -> None:
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out
    assert "GpuCleanWarning" not in out
    assert PLUGIN_FILES not in out, out


def report(pytester: pytest.Pytester) -> dict[str, object]:
    document: dict[str, object] = json.loads((pytester.path / "report.json").read_text())
    return document


# ---- issue 44, item 4: notes, not warnings ----------------------------------------------------------------

@pytest.mark.parametrize("mode", WARNING_MODES)
def test_a_victims_reaping_of_an_earlier_leak_never_fails_the_victim(
        example: Callable[..., Path], pytester: pytest.Pytester, mode: str) -> None:
    # Before: under -W error the marked victim ERRORed with a GpuCleanWarning and a traceback into the plugin.
    pidfile = example("messages/victim")
    result = run_in_mode(pytester, mode, "--gpuclean-report=report.json")
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=2)
    assert_no_plugin_traceback(result)
    assert not alive(leaked)
    # Said where it belongs: the leaker's line in the summary and its record in the JSON report.
    assert (f"test_inner.py::test_1_unmarked_leaks: leaked 1 process(es) found by a later check (pid "
            f"{leaked} SIGTERM)") in summary_of(result)
    tests = {t["nodeid"].split("::")[1]: t for t in report(pytester)["tests"]}  # type: ignore[attr-defined]
    assert [r["process"]["pid"] for r in tests["test_1_unmarked_leaks"]["found_later"]] == [leaked]
    assert not tests["test_2_marked_victim"]["findings"]


@pytest.mark.parametrize("mode", WARNING_MODES)
def test_the_pytest_processs_cuda_context_is_a_note_naming_the_test_that_made_it(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path, mode: str) -> None:
    # Before: a GpuCleanWarning at the setup of the test after the one that allocated (in the warnings
    # summary, under that test), and under -W error that test's error.
    example("core/own_process_memory_is_not_a_leak")
    result = run_in_mode(pytester, mode, "--gpuclean-report=report.json")
    result.assert_outcomes(passed=2)
    assert_no_plugin_traceback(result)
    note = ("gpuclean: this pytest process (pid *) holds a CUDA context (GPU 0 300 MiB), first seen after "
            "test_inner.py::test_allocates_in_process; it is not counted as a leak")
    result.stdout.fnmatch_lines(["*= gpuclean =*", note])
    assert [line for line in result.outlines if "test_after" in line] == ["PASSED test_inner.py::test_after"]
    notes = report(pytester)["notes"]
    assert isinstance(notes, list) and len(notes) == 1
    assert "first seen after test_inner.py::test_allocates_in_process" in notes[0]


UNKNOWN = ("gpuclean: environment variable GPUCLEAN_TIMOUT is not gpuclean's: ignored (did you mean "
           "GPUCLEAN_TIMEOUT?)")


@pytest.mark.parametrize("mode", WARNING_MODES)
def test_an_unknown_variable_is_said_at_the_start_and_is_never_an_error(
        pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # Before: under -W error an INTERNALERROR, exit status 3, no test run.
    monkeypatch.setenv("GPUCLEAN_TIMOUT", "5")
    pytester.copy_example("test_marked.py")
    result = run_in_mode(pytester, mode, "--gpuclean-report=report.json")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=1)
    assert_no_plugin_traceback(result)
    result.stdout.fnmatch_lines([UNKNOWN, "collected 1 item", "*= gpuclean =*", UNKNOWN])
    assert report(pytester)["notes"] == [UNKNOWN]


def test_an_unknown_variable_is_said_in_a_quiet_session_that_checks_nothing(
        pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # -q shows no header: the summary says it, though nothing else of gpuclean's runs.
    monkeypatch.setenv("GPUCLEAN_TIMOUT", "5")
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = run_inner(pytester, "-q", "-W", "error")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*= gpuclean =*", UNKNOWN])
    assert result.stdout.str().count("GPUCLEAN_TIMOUT") == 1


@pytest.mark.parametrize("mode", WARNING_MODES)
def test_torch_memory_a_test_keeps_alive_warns_at_the_test_itself(
        example: Callable[..., Path], pytester: pytest.Pytester, mode: str) -> None:
    # The one GpuCleanWarning left: the test's own finding, at the test's own line, so that a filter (-W
    # error::...GpuCleanWarning) can make it that test's error, in one line. Before: at the plugin's own line,
    # and under -W error a traceback into the plugin.
    example("core/in_process_torch_memory_growth")
    result = run_in_mode(pytester, mode)
    out = result.stdout.str()
    assert "INTERNALERROR" not in out and PLUGIN_FILES not in out, out
    message = ("test_inner.py::test_keeps_tensors_alive: torch.cuda.memory_allocated grew during the test in "
               "the pytest process (cuda:0 +100.0 MiB, more than 64 MiB): tensors kept alive after the test")
    line = marked_line(pytester.path / "test_inner.py", "test_keeps_tensors_alive")
    if mode in ("-W error", "filterwarnings = error"):
        result.assert_outcomes(passed=5, errors=1)
        result.stdout.fnmatch_lines(["*ERROR at teardown of test_keeps_tensors_alive*",
                                     f"gpuclean: {message} (a GpuCleanWarning: the warning filters make it "
                                     "an error)"])
    elif mode == "default":
        result.assert_outcomes(passed=5, warnings=1)
        result.stdout.fnmatch_lines(["test_inner.py::test_keeps_tensors_alive",
                                     f"  *test_inner.py:{line}: GpuCleanWarning: {message}"])
    else:
        result.assert_outcomes(passed=5)


# ---- issue 44, items 11 and 12: what an interrupt says -----------------------------------------------------

def start_inner(pytester: pytest.Pytester, out: Path, *args: str) -> subprocess.Popen[bytes]:
    """An inner pytest to signal while it runs, its output in ``out`` (a file: a leak could hold a pipe open;
    and a file is block-buffered, so what shows there before the session ends was written at once)."""
    with open(out, "wb") as f, children_sigint():
        return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider",
                                 *args], cwd=pytester.path, stdout=f, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_says_at_once_what_the_sweep_waits_for(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, signum: int) -> None:
    # Before: with --gpuclean-grace=8, nothing for 9 s after Ctrl-C. A leak that survives SIGTERM (it notes
    # each in $LEAK_TERMED), a 60 s grace: while the sweep waits, the line is already there.
    pidfile, termed = example("faults/term_noting", "scripts/note_term.py"), tmp_path / "termed"
    monkeypatch.setenv("LEAK_TERMED", str(termed))
    out = tmp_path / "inner.out"
    proc = start_inner(pytester, out, "--gpuclean-all", "--gpuclean-grace=60")
    try:
        leaked = read_pids(pidfile, timeout=60)[0]
        time.sleep(0.3)
        proc.send_signal(signum)
        wait_for_file(termed, proc, timeout=30, output=out.read_text)  # the sweep is in its grace
        assert (f"gpuclean: interrupted: ending 1 process(es) the session left (pid {leaked}): SIGTERM now, "
                "SIGKILL after at most 60s; interrupt again (Ctrl-C or SIGTERM) to SIGKILL them now"
                ) in out.read_text().splitlines()
        assert proc.poll() is None and alive(leaked)
        proc.send_signal(signum)  # the second one ends the wait
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_dead([leaked], timeout=5) == [], out.read_text()


def test_the_traceback_after_sigterm_points_at_the_test(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    # Before: "core/acting/signals.py:72: KeyboardInterrupt: SIGTERM", the plugin's handler's line.
    pidfile = example("faults/sleeper")
    out = tmp_path / "inner.out"
    proc = start_inner(pytester, out, "--gpuclean-all", "-k", "test_leak_and_hang")
    try:
        leaked = read_pids(pidfile, timeout=60)[0]
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert wait_dead([leaked], timeout=5) == [], text
    line = next(i for i, code in enumerate((pytester.path / "test_inner.py").read_text().splitlines(), 1)
                if "time.sleep(120)" in code)
    assert f"{pytester.path / 'test_inner.py'}:{line}: KeyboardInterrupt: SIGTERM" in text.splitlines(), text
    assert PLUGIN_FILES not in text, text


# ---- issue 44, item 8: a simulate directory that holds no device ---------------------------------------

NO_DEVICE = ("{dir!r} holds no simulated device (DIR/<index>/); make them with 'python -m "
             "pytest_gpuclean.simulate init DIR'")


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("where", ["cli", "env", "ini"])
def test_a_simulate_directory_without_devices_is_a_usage_error(
        pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch, where: str,
        checked: bool) -> None:
    # Before: --gpuclean-simulate=tests (or ., or /etc) skipped every marked test, exit status 0, though
    # `simulate hold --dir` refuses the same directory.
    monkeypatch.delenv("GPUCLEAN_SIMULATE")
    (pytester.path / "docs").mkdir()
    pytester.copy_example("test_marked.py")
    args: list[str] = [] if checked else ["-m", "not needs_clean_gpus"]
    if where == "cli":
        args.append("--gpuclean-simulate=docs")
        source = "from the command line"
    elif where == "env":
        monkeypatch.setenv("GPUCLEAN_SIMULATE", "docs")
        source = "from environment variable GPUCLEAN_SIMULATE"
    else:
        pytester.makeini("[pytest]\ngpuclean_simulate = docs\n")
        source = f"from ini option gpuclean_simulate in {pytester.path / 'tox.ini'}"
    result = run_inner(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    why = NO_DEVICE.format(dir=str(pytester.path / "docs"))
    assert result.stderr.str().strip() == f"ERROR: --gpuclean-simulate: {why} ({source})"
    assert "test session starts" not in result.stdout.str()  # said before anything runs


@pytest.mark.parametrize("command", ["status", "check", "reap"])
def test_the_gpuclean_command_refuses_a_simulate_directory_without_devices(tmp_path: Path,
                                                                          command: str) -> None:
    # Before: `no devices to check` from check, an empty table from status.
    result = subprocess.run([sys.executable, "-m", "pytest_gpuclean", command, "--simulate", str(tmp_path)],
                            env=clean_environment(), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    why = NO_DEVICE.format(dir=str(tmp_path))
    assert result.stderr == f"gpuclean {command}: error: --simulate: {why} (from the command line)\n"


# ---- issue 44, item 9: no GPU on a CI runner -----------------------------------------------------------

CI_DEFAULT = ("--gpuclean-no-gpu=fail: the default where CI is set (CI={ci!r}); --gpuclean-no-gpu=skip to "
              "skip instead")


@pytest.mark.parametrize(("ci", "args", "action", "why"), [
    (None, (), "skip", ""),
    ("true", (), "fail", CI_DEFAULT),
    ("1", ("--gpuclean-no-gpu=skip",), "skip", "--gpuclean-no-gpu=skip, from the command line"),
    ("false", (), "skip", ""),
    ("", (), "skip", ""),
    (None, ("--gpuclean-no-gpu=fail",), "fail", "--gpuclean-no-gpu=fail, from the command line"),
], ids=["no-ci", "ci", "ci-chose-skip", "ci-false", "ci-empty", "chose-fail"])
def test_no_gpu_on_a_ci_runner_is_an_error_unless_skipping_was_chosen(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch,
        ci: str | None, args: tuple[str, ...], action: str, why: str) -> None:
    # Before: a runner whose job lost its GPUs (none selected here, as a container started without them)
    # skipped every marked test, and CI was green.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    example("core/no_devices_to_check_skips")  # a marked test and an unmarked one
    result = run_inner(pytester, *args)
    reason = "none of the 2 simulated device(s) is selected (from CUDA_VISIBLE_DEVICES='')"
    why = why.format(ci=ci)
    line = marked_line(pytester.path / "test_inner.py", "test_gpu")
    if action == "fail":
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines([
            f"gpuclean: no GPUs checked: {reason}; tests marked needs_clean_gpus will be errors ({why})",
            "*ERROR at setup of test_gpu*", f"gpuclean: no GPU to check: {reason} ({why})"])
    else:
        assert result.ret == pytest.ExitCode.OK
        result.assert_outcomes(passed=1, skipped=1)
        said = f" ({why})" if why else ""
        result.stdout.fnmatch_lines([
            f"gpuclean: no GPUs checked: {reason}; tests marked needs_clean_gpus will be skipped{said}",
            f"SKIPPED [[]1[]] test_inner.py:{line}: gpuclean: no GPU to check: {reason}{said}"])


def test_a_bad_no_gpu_value_is_a_usage_error(pytester: pytest.Pytester, sim: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCLEAN_NO_GPU", "maybe")
    pytester.copy_example("test_marked.py")
    result = run_inner(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.str().strip() == ("ERROR: --gpuclean-no-gpu: 'maybe' is not one of fail, skip (from "
                                           "environment variable GPUCLEAN_NO_GPU)")


# ---- issue 44, item 13: messages that misled, or came too late ------------------------------------------

def no_nvml_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML cannot load (on a GPU box, pointed at a library that is not there); skips where it still does."""
    monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent")
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return
    pytest.skip("a real NVIDIA driver is present")


@pytest.mark.parametrize(("name", "ini"), [
    ("pytest.ini", "[pytest]\ngpuclean_simulate = gpus\n"),
    ("pyproject.toml", '[tool.pytest.ini_options]\ngpuclean_simulate = "gpus"\n'),
    ("setup.cfg", "[tool:pytest]\ngpuclean_simulate = gpus\n"),
], ids=["pytest.ini", "pyproject.toml", "setup.cfg"])
def test_gpuclean_status_without_nvml_names_the_ini_files_simulated_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, ini: str) -> None:
    # Before: `NVML Shared Library Not Found`, no hint, in a project whose pytest runs on simulated devices.
    no_nvml_here(monkeypatch)
    (tmp_path / name).write_text(ini)
    (tmp_path / "tests").mkdir()
    from pytest_gpuclean.simulate import init

    init(str(tmp_path / "gpus"), 1, 1024)
    result = subprocess.run([sys.executable, "-m", "pytest_gpuclean", "status"], cwd=tmp_path / "tests",
                            env=clean_environment(LD_LIBRARY_PATH="/nonexistent"), capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("gpuclean status: error: NVML ")
    gpus = tmp_path / "gpus"
    assert result.stderr.endswith(
        f" (the gpuclean command reads no ini file: {tmp_path / name} sets gpuclean_simulate = gpus, for "
        f"pytest; give --simulate {gpus} or GPUCLEAN_SIMULATE={gpus} for those devices)\n"), result.stderr


@pytest.mark.parametrize(("command", "flag"), [
    ("check", "--grace (of gpuclean reap)"), ("status", "--grace (of gpuclean reap)"), ("reap", "--grace")])
def test_a_bad_variable_is_named_as_the_gpuclean_commands_flag(command: str, flag: str) -> None:
    # Before: `GPUCLEAN_GRACE=abc gpuclean check` named pytest's --gpuclean-grace.
    result = subprocess.run([sys.executable, "-m", "pytest_gpuclean", command],
                            env=clean_environment(GPUCLEAN_GRACE="abc"), capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"gpuclean {command}: error: {flag}: 'abc' is not a number of seconds (from "
                             "environment variable GPUCLEAN_GRACE)\n")


@pytest.mark.parametrize("args", [("-k", "nothing_matches"), (), ("--co",)],
                         ids=["deselected", "checked", "collect-only"])
def test_a_device_list_the_machine_lacks_is_said_before_the_session_not_after_its_summary(
        pytester: pytest.Pytester, sim: Path, args: tuple[str, ...]) -> None:
    # Before: `--gpuclean-devices=7 -k x` printed the error after the summary (`2 deselected in 0.02s`).
    pytester.copy_example("test_marked.py")
    result = run_inner(pytester, "--gpuclean-devices=7", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.str().strip() == ("ERROR: --gpuclean-devices: device 7 does not exist (2 device(s) "
                                           "found) (from the command line)")
    out = result.stdout.str()
    assert not re.search(r"^=+ .* in [\d.]+s =+$", out, re.M), out  # no summary line: before the session
    assert "collected" not in out and "deselected" not in out, out


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(name: str, language: str) -> str:
    found = re.search(rf"^<!-- {name} -->\n```{language}\n(.*?)^```$", README.read_text(encoding="utf-8"),
                      re.M | re.S)
    assert found, f"README.md lost its {name}"
    return found.group(1)


def test_the_readmes_strict_config_recipe_keeps_a_run_without_the_plugin_passing(
        pytester: pytest.Pytester, sim: Path) -> None:
    # Before: `-p no:gpuclean --strict-config` with gpuclean_* keys in the ini failed, and the README's
    # recipe covered only the marker.
    pytester.copy_example("settings/markers_with_the_plugin_off")
    ini = readme_block("strict-config-recipe: ini", "ini")
    assert "gpuclean_timeout" in ini and "gpuclean_ignore" in ini
    pytester.makeini(ini)
    off = ("-p", "no:gpuclean", "-p", "no:cacheprovider", "--strict-config", "--strict-markers")
    without = pytester.runpytest_subprocess(*off)
    assert without.ret != pytest.ExitCode.OK
    without.stderr.fnmatch_lines(["*Unknown config option: gpuclean_*"])
    pytester.makeconftest(readme_block("strict-config-recipe: conftest.py", "python"))
    pytester.runpytest_subprocess(*off, "-W", "error").assert_outcomes(passed=1)
    # The plugin on: its own declarations, untouched (gpuclean_ignore is still a list), and the test checked.
    result = run_inner(pytester, "--strict-config", "--strict-markers", "-W", "error",
                       "--gpuclean-report=report.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*1 checked test(s)*"])
    assert report(pytester)["session"]["settings"]["timeout"] == 120.0  # type: ignore[index]


def test_the_ini_file_is_the_one_pytest_would_take(tmp_path: Path) -> None:
    from pytest_gpuclean._cli import ini_value
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\ngpuclean_simulate = far\n")
    inner = tmp_path / "a"
    inner.mkdir()
    (inner / "tox.ini").write_text("[tox]\nenvlist = py\n")  # no [pytest]: not pytest's, passed over
    (inner / "pyproject.toml").write_text("[project]\nname = 'a'\n")  # no [tool.pytest...]: neither
    assert ini_value(inner, "gpuclean_simulate") == (tmp_path / "setup.cfg", "far")
    (inner / "pytest.ini").write_text("[pytest]\naddopts = -q\n")  # pytest's, without the key: it decides
    assert ini_value(inner, "gpuclean_simulate") is None
