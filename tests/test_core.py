"""The clean-GPU gate: inner pytest sessions over simulated devices with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import alive, clean_environment, marked_line, run_inner, unprivileged, wait_dead

from pytest_gpuclean._reading.simulated import simulated_uuid
from pytest_gpuclean.report.terminal import LEAK_PREFIX, NOT_CLEAN_PREFIX
from pytest_gpuclean.simulate import init, init_cuda


def test_clean_session_passes_and_shows_devices(example: Callable[..., Path],
                                                pytester: pytest.Pytester) -> None:
    example("core/clean_session_passes_and_shows_devices")
    result = run_inner(pytester)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "gpuclean: simulated devices*checking 2*subreaper on",
        "gpuclean: GPU 0 Simulated GPU (GPU-*): 0/81920 MiB used",
        "gpuclean: GPU 1 Simulated GPU (GPU-*): 0/81920 MiB used",
        "*2 checked test(s), 0 with findings, 0 process(es) reaped*",
    ])


def test_marker_is_registered_with_its_arguments(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "gpuclean", "--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.needs_clean_gpus(tolerance_mib=None, timeout=None, count=None):*"])


def test_leak_is_a_teardown_error_of_the_leaking_test(example: Callable[..., Path],
                                                       pytester: pytest.Pytester) -> None:
    pidfile = example("core/leak_is_a_teardown_error")
    result = run_inner(pytester, "--gpuclean-grace=2")
    leaked = int(pidfile.read_text().split()[0])
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaks*",
        f"{LEAK_PREFIX} 1 process(es) (reaped)",
        f"  pid {leaked} ended by SIGTERM*(found as descendant, spawned by test_inner.py::test_leaks): "
        "held GPU 0 512 MiB*",
        "*ERROR test_inner.py::test_leaks - Failed: gpuclean: test leaked*",
    ])
    assert "test_next" not in "".join(line for line in result.stdout.lines if line.startswith("ERROR"))
    assert not alive(leaked)


def test_reap_off_reports_and_next_test_waits_for_the_leaker(example: Callable[..., Path],
                                                              pytester: pytest.Pytester) -> None:
    pidfile = example("core/reap_off_reports_and_next")
    result = run_inner(pytester, "--gpuclean-reap=off")
    leaked = int(pidfile.read_text().split()[0])
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaks*",
        f"{LEAK_PREFIX} 1 process(es) (reaping is off: reported only)",
        "outlived the test, then ended by themselves:",
        f"  leaked pid {leaked} (user *, found as descendant, spawned by test_inner.py::test_leaks): "
        "GPU 0 64 MiB; outlived its test, ended by itself within *s (reaping is off)",
    ])
    # Nobody killed it: it ended by itself after 1.5 s and test_next waited for that.
    assert "SIGTERM" not in result.stdout.str()


def test_foreign_holder_errors_in_setup_and_is_left_alive(example: Callable[..., Path],
                                                          pytester: pytest.Pytester,
                                                          outside_holder: Callable[..., int]) -> None:
    foreign = outside_holder(mib=256)
    example("core/foreign_holder_errors_in_setup")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_victim*",
        f"{NOT_CLEAN_PREFIX} before the test (waited 0.5s of a 0.5s timeout)",
        f"  foreign pid {foreign} (user *, found as gpu): GPU 0 256 MiB; not started by this session: "
        "waited for, never killed",
        "      cmd: *pytest_gpuclean.simulate hold*",
    ])
    assert alive(foreign)


def test_gpuclean_all_checks_unmarked_tests(example: Callable[..., Path], pytester: pytest.Pytester,
                                            outside_holder: Callable[..., int]) -> None:
    outside_holder(mib=10)
    example("core/gpuclean_all_checks_unmarked_tests")
    run_inner(pytester).assert_outcomes(passed=1)
    result = run_inner(pytester, "--gpuclean-all", "--gpuclean-timeout=0.2")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"{NOT_CLEAN_PREFIX} before the test*"])


def test_tolerance_counts_allowlisted_memory(example: Callable[..., Path], pytester: pytest.Pytester,
                                             outside_holder: Callable[..., int]) -> None:
    holder = outside_holder(mib=100)
    example("core/tolerance_counts_allowlisted_memory")
    ignore = "--gpuclean-ignore=*simulate hold*"
    # Allowlisted by command line, and its 100 MiB fit in the marker's 150 MiB.
    run_inner(pytester, ignore).assert_outcomes(passed=1)
    # The marker beats the command line (the most specific setting wins): its 50 MiB changes nothing.
    run_inner(pytester, ignore, "--gpuclean-tolerance-mib=50").assert_outcomes(passed=1)
    # Not allowlisted: the process itself is an offender, whatever the tolerance.
    result = run_inner(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"  foreign pid {holder} *"])


def test_own_process_memory_is_not_a_leak(example: Callable[..., Path], pytester: pytest.Pytester,
                                          sim: Path) -> None:
    # The H200 charged 9 MiB of a context to no process (benchmarks/GPU-RUNS.md): model that too.
    (sim / "0" / "context_overhead").write_text(str(9 * 1024 * 1024))
    example("core/own_process_memory_is_not_a_leak")
    result = run_inner(pytester)
    result.assert_outcomes(passed=2, warnings=0)
    result.stdout.fnmatch_lines([
        "gpuclean: this pytest process (pid *) holds a CUDA context (GPU 0 300 MiB), first seen after "
        "test_inner.py::test_allocates_in_process; it is not counted as a leak",
    ])


def test_own_cuda_without_a_context_is_not_a_leak(example: Callable[..., Path], pytester: pytest.Pytester,
                                                  sim: Path) -> None:
    # On the H200, torch.cuda.is_available() in the pytest process left 3 MiB per GPU charged to no
    # process for the rest of the session (benchmarks/GPU-RUNS.md): the driver's cost of CUDA without a
    # context.
    (sim / "0" / "context_overhead").write_text(str(3 * 1024 * 1024))
    example("core/own_cuda_without_a_context_is_not_a_leak")
    result = run_inner(pytester)
    result.assert_outcomes(passed=2, warnings=0)
    result.stdout.fnmatch_lines([
        "gpuclean: this pytest process (pid *) initialised CUDA without a context (GPU 0: a few MiB the "
        "driver charges to no process), first seen after test_inner.py::test_initialises_cuda; it is not "
        "counted as a leak",
    ])


def test_cuda_of_another_process_without_a_context_is_dirty(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path) -> None:
    # The same few unlisted MiB from a process that is not ours (here: started before the session) stay
    # dirty memory: only our own processes' driver overhead is excused.
    (sim / "0" / "context_overhead").write_text(str(3 * 1024 * 1024))
    other = subprocess.Popen(["sleep", "60"])
    try:
        init_cuda(str(sim), 0, other.pid)
        example("core/cuda_of_another_process_without")
        result = run_inner(pytester)
    finally:
        other.kill()
        other.wait()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["  memory: 3 MiB used on GPU 0 beyond the tolerance of 0 MiB, "
                                 "held by no process we can see"])


def test_memory_charged_to_no_process_is_dirty(example: Callable[..., Path], pytester: pytest.Pytester,
                                               sim: Path) -> None:
    # Overhead beyond what one context can explain is somebody else's memory (another container).
    (sim / "0" / "context_overhead").write_text(str(200 * 1024 * 1024))
    example("core/memory_charged_to_no_process_is_dirty")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(["  memory: 136 MiB used on GPU 0 beyond the tolerance of 0 MiB, "
                                 "held by no process we can see"])


def test_count_larger_than_devices_skips_with_reason(example: Callable[..., Path],
                                                     pytester: pytest.Pytester) -> None:
    example("core/count_larger_than_devices_skips")
    result = run_inner(pytester)
    result.assert_outcomes(skipped=1)
    # At the test's own line, as a skip marker's reason is, not in the plugin.
    line = marked_line(pytester.path / "test_inner.py", "test_three")
    result.stdout.fnmatch_lines([f"SKIPPED [[]1[]] test_inner.py:{line}: gpuclean: test needs 3 GPU(s), "
                                 "found 2"])


def test_no_driver_skips_marked_tests_or_errors_with_no_gpu_fail(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.delenv("CI", raising=False)  # outside CI: skipping is the default (test_messages.py: in CI)
    # No NVML library here; on a GPU box point it at a missing one so the test means the same.
    monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent")
    pytester.copy_example("core/no_driver")  # a marked test and an unmarked one
    try:
        import pynvml
        pynvml.nvmlInit()
        pytest.skip("a real NVIDIA driver is present")
    except Exception:
        pass
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["gpuclean: no GPUs checked: NVML init failed*; tests marked "
                                 "needs_clean_gpus will be skipped",
                                 "SKIPPED*gpuclean: no GPU to check: NVML init failed*"])
    result = run_inner(pytester, "--gpuclean-no-gpu=fail")
    result.assert_outcomes(passed=1, failed=0, errors=1)
    result.stdout.fnmatch_lines(["*gpuclean: no GPU to check: NVML init failed* (--gpuclean-no-gpu=fail, "
                                 "from the command line)"])


@pytest.mark.parametrize("visible", ["", "-1"])
def test_no_devices_to_check_skips_marked_tests_like_no_driver(
        example: Callable[..., Path], pytester: pytest.Pytester, sim: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, visible: str) -> None:
    # A marked test that checked zero devices would pass as "checked" while checking nothing. (A simulate
    # directory without devices is a usage error: tests/test_messages.py.)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("CI", raising=False)  # outside CI: skipping is the default (test_messages.py: in CI)
    reason = (f"none of the 2 simulated device(s) is selected (from CUDA_VISIBLE_DEVICES={visible!r})")
    example("core/no_devices_to_check_skips")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    line = marked_line(pytester.path / "test_inner.py", "test_gpu")
    result.stdout.fnmatch_lines([f"gpuclean: no GPUs checked: {reason}; tests marked needs_clean_gpus will "
                                 "be skipped",
                                 f"SKIPPED [[]1[]] test_inner.py:{line}: gpuclean: no GPU to check: "
                                 f"{reason}"])
    result = run_inner(pytester, "--gpuclean-no-gpu=fail")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"gpuclean: no GPU to check: {reason} (--gpuclean-no-gpu=fail, from the "
                                 "command line)"])


@pytest.mark.parametrize(("args", "env", "ini", "message"), [
    (["--gpuclean-timeout=-1"], {}, "",
     "ERROR: --gpuclean-timeout: '-1' is not a number of seconds >= 0 (from the command line)"),
    ([], {"GPUCLEAN_TOLERANCE_MIB": "lots"}, "",
     "ERROR: --gpuclean-tolerance-mib: 'lots' is not a whole number (from environment variable "
     "GPUCLEAN_TOLERANCE_MIB)"),
    ([], {}, "gpuclean_scope = planet",
     "ERROR: --gpuclean-scope: 'planet' is not one of session, host (from ini option gpuclean_scope in "
     "*tox.ini)"),
    (["--gpuclean-simulate=/nonexistent/sim"], {}, "",
     "ERROR: --gpuclean-simulate: '/nonexistent/sim' is not an existing directory (from the command line)"),
    (["--gpuclean-devices=7"], {}, "",
     "ERROR: --gpuclean-devices: device 7 does not exist (2 device(s) found) (from the command line)"),
    ([], {"CUDA_VISIBLE_DEVICES": "GPU-nope"}, "",
     "ERROR: --gpuclean-devices: no device has a UUID starting with 'GPU-nope' (from environment variable "
     "CUDA_VISIBLE_DEVICES='GPU-nope'*"),
    (["--gpuclean-grace=soon"], {}, "",
     "ERROR: --gpuclean-grace: 'soon' is not a number of seconds (from the command line)"),
    (["--gpuclean-devices="], {}, "",
     "ERROR: --gpuclean-devices: '' names no device (from the command line)"),
    ([], {}, "gpuclean_devices = ,",
     "ERROR: --gpuclean-devices: ',' names no device (from ini option gpuclean_devices in *tox.ini)"),
    ([], {"SIM_FILE": "0/total=abc"}, "",
     "ERROR: --gpuclean-simulate: simulated device file '*/sim/0/total' holds 'abc', not a number of bytes "
     "(a whole number >= 0) (from environment variable GPUCLEAN_SIMULATE)"),
    ([], {"SIM_FILE": "1/context_overhead=xyz"}, "",
     "ERROR: --gpuclean-simulate: simulated device file '*/sim/1/context_overhead' holds 'xyz', not a number "
     "of bytes (a whole number >= 0) (from environment variable GPUCLEAN_SIMULATE)"),
    ([], {"SIM_FILE": "0/{pid}=-512"}, "",
     "ERROR: --gpuclean-simulate: simulated device file '*/sim/0/*' holds '-512', not a number of bytes "
     "(a whole number >= 0) (from environment variable GPUCLEAN_SIMULATE)"),
])
def test_bad_option_values_are_usage_errors_naming_their_source(
        example: Callable[..., Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        outside_holder: Callable[..., int], args: list[str], env: dict[str, str], ini: str,
        message: str) -> None:
    bystander = outside_holder(mib=1)
    example("core/bad_option_values_are_usage")
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    for name, value in env.items():
        if name == "SIM_FILE":  # a corrupt file; {pid} is a live process older than the file
            where, content = value.split("=", 1)
            (Path(os.environ["GPUCLEAN_SIMULATE"]) / where.format(pid=bystander)).write_text(content)
            continue
        monkeypatch.setenv(name, value)
    result = run_inner(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert alive(bystander)  # no stray kill on the way out


@pytest.mark.parametrize(("args", "env", "closed", "why", "source"), [
    (["--gpuclean-simulate=sim"], {}, "directory", "simulated device directory '{sim}' cannot be read: "
     "Permission denied", "from the command line"),
    ([], {"GPUCLEAN_SIMULATE": "{sim}"}, "device", "simulated GPU 1 ({sim}/1) unreadable: [Errno 13] "
     "Permission denied: '{sim}/1'", "from environment variable GPUCLEAN_SIMULATE"),
    # A session that checks no test opens the devices to hold an explicit device list against them.
    (["--gpuclean-simulate=sim", "--gpuclean-devices=0", "-m", "not needs_clean_gpus"], {}, "directory",
     "simulated device directory '{sim}' cannot be read: Permission denied", "from the command line"),
], ids=["cli-directory", "env-device", "unchecked-directory"])
def test_a_simulated_directory_the_user_may_not_read_is_a_usage_error(
        public_tmp: Path, args: list[str], env: dict[str, str], closed: str, why: str, source: str) -> None:
    # As an unprivileged user: another user's directory (mode 700: it may look at it, not list it), or a
    # device folder of mode 000, was an INTERNALERROR (a DeviceError, or a PermissionError).
    sim = public_tmp / "sim"
    init(str(sim), 2, 1024)
    (sim / "1").chmod(0)
    if closed == "directory":
        sim.chmod(0o700)
    (public_tmp / "test_a.py").write_text("import pytest\n\n\n@pytest.mark.needs_clean_gpus\n"
                                          "def test_a():\n    pass\n")
    command = unprivileged([sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider",
                            *args, "test_a.py"])
    environment = clean_environment(GPUCLEAN_LOCK_DIR=str(public_tmp / "locks"),
                                    **{name: value.format(sim=sim) for name, value in env.items()})
    result = subprocess.run(command, cwd=public_tmp, env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr
    assert result.stderr.strip() == f"ERROR: --gpuclean-simulate: {why.format(sim=sim)} ({source})"


@pytest.mark.parametrize(("args", "env", "ini", "message"), [
    (["--gpuclean-devices=99"], {}, "",
     "ERROR: --gpuclean-devices: device 99 does not exist (2 device(s) found) (from the command line)"),
    (["--co"], {"GPUCLEAN_DEVICES": "GPU-nope"}, "",
     "ERROR: --gpuclean-devices: no device has a UUID starting with 'GPU-nope' (from environment variable "
     "GPUCLEAN_DEVICES)"),
    ([], {"GPUCLEAN_DEVICES": "0,0"}, "",
     "ERROR: --gpuclean-devices: '0,0' lists '0' twice (from environment variable GPUCLEAN_DEVICES)"),
    ([], {}, "gpuclean_devices = 1,{uuid1}",
     "ERROR: --gpuclean-devices: '1' and 'GPU-*' name the same device (GPU 1, GPU-*); list each device "
     "once (from ini option gpuclean_devices in *tox.ini)"),
])
def test_a_bad_device_list_stops_a_session_that_checks_nothing(
        pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
        env: dict[str, str], ini: str, message: str) -> None:
    # README: a bad value stops pytest at start-up, whether or not a selected test is checked.
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    if ini:
        pytester.makeini(f"[pytest]\n{ini.format(uuid1=simulated_uuid(sim, 1))}\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = run_inner(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    result.stdout.no_fnmatch_line("*passed*")


def test_a_good_device_list_in_a_session_that_checks_nothing_starts_nothing(
        pytester: pytest.Pytester, sim: Path) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = run_inner(pytester, f"--gpuclean-devices=1,{simulated_uuid(sim, 0)}")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("gpuclean:*")  # checked, but not started: no header


def test_path_options_expand_a_tilde(pytester: pytest.Pytester, sim: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The command line, the environment and the ini file alike: no shell expands ``~`` after ``=``.
    home = tmp_path / "home"
    home.mkdir()
    sim.rename(home / "sim")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", "~/locks")
    monkeypatch.delenv("GPUCLEAN_SIMULATE")
    pytester.makeini("[pytest]\ngpuclean_report = ~/reports/gpuclean.json\n")
    pytester.copy_example("test_marked.py")
    result = run_inner(pytester, "--gpuclean-simulate=~/sim")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpuclean: simulated devices *checking 2*"])
    assert (home / "reports" / "gpuclean.json").is_file()
    assert any((home / "locks").iterdir())
    assert not (pytester.path / "~").exists()


@pytest.mark.parametrize("xdist", [(), ("-n", "1")], ids=["plain", "xdist"])
def test_the_device_header_comes_after_pytests_own(pytester: pytest.Pytester, sim: Path,
                                                   xdist: tuple[str, ...]) -> None:
    pytester.copy_example("test_marked.py")
    result = run_inner(pytester, *xdist)
    result.assert_outcomes(passed=1)
    lines = result.stdout.lines
    rootdir = next(i for i, line in enumerate(lines) if line.startswith("rootdir: "))
    plugins = next(i for i, line in enumerate(lines) if line.startswith("plugins: "))
    header = [i for i, line in enumerate(lines) if line.startswith("gpuclean: simulated devices")]
    assert len(header) == 1
    assert rootdir < plugins < header[0], "\n".join(lines)


def test_bad_marker_argument_errors_that_test(example: Callable[..., Path],
                                              pytester: pytest.Pytester) -> None:
    example("core/bad_marker_argument_errors_that_test")
    result = run_inner(pytester)
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines_random([
        "*gpuclean: needs_clean_gpus(tolerance_mib=-5) on test_inner.py::test_bad: '-5' is negative*"
        "(from the needs_clean_gpus marker)",
        "*gpuclean: needs_clean_gpus got unknown argument(s) timeuot on test_inner.py::test_typo*",
        "gpuclean: needs_clean_gpus(2) on test_inner.py::test_positional: positional arguments are not "
        "accepted; use keyword arguments: tolerance_mib=..., timeout=..., count=... (from the "
        "needs_clean_gpus marker)",
    ])


def test_disabled_with_no_gpuclean(example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    pidfile = example("core/disabled_with_no_gpuclean")
    result = pytester.runpytest_subprocess("-p", "no:gpuclean", "-p", "no:cacheprovider",
                                           "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=1)
    assert not [line for line in result.stdout.lines if line.startswith("gpuclean")]
    leaked = int(pidfile.read_text().split()[0])
    assert alive(leaked)  # nobody reaped it: the plugin really was off (the autouse fixture kills it)


def test_host_scope_flags_stray_python_and_respects_allowlist(
        example: Callable[..., Path], pytester: pytest.Pytester, tmp_path: Path) -> None:
    marker = f"gpuclean-host-scope-{os.getpid()}-{time.monotonic_ns()}"
    stray = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"])
    try:
        example("core/host_scope_flags_stray_python")
        result = run_inner(pytester, "--gpuclean-scope=host")
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines([
            f"  host pid {stray.pid} (user *, found as host): no GPU memory; Python process of this user "
            "(host scope): never killed",
        ])
        # Other Python processes of this user may run beside us; ours must no longer be named.
        result = run_inner(pytester, "--gpuclean-scope=host", f"--gpuclean-ignore=*{marker}*")
        assert f"host pid {stray.pid} " not in result.stdout.str()
        # The default scope ignores unrelated processes entirely.
        run_inner(pytester).assert_outcomes(passed=1)
        assert stray.poll() is None
    finally:
        stray.kill()
        stray.wait()


def test_leaks_wait_for_nothing_and_reports_are_fast_to_read(
        example: Callable[..., Path], pytester: pytest.Pytester) -> None:
    # A leak is reported with its figures in the terminal summary section.
    pidfile = example("core/leaks_wait_for_nothing_and")
    result = run_inner(pytester)
    leaked = int(pidfile.read_text().split()[0])
    result.stdout.fnmatch_lines([
        "*= gpuclean =*",
        f"test_inner.py::test_leaks: teardown: reaped 1 (pid {leaked} SIGTERM)*",
        "1 checked test(s), 1 with findings, 1 process(es) reaped",
    ])
    assert wait_dead([leaked]) == []


def test_dash_p_gpuclean_loads_it_without_autoload(example: Callable[..., Path], pytester: pytest.Pytester,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # `-p gpuclean` names the entry point, so it works where plugin autoloading is switched off.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    example("core/dash_p_gpuclean_loads_it")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpuclean: simulated devices*", "*1 checked test(s)*"])


def test_in_process_torch_memory_growth_is_reported(example: Callable[..., Path],
                                                    pytester: pytest.Pytester) -> None:
    # The CPU box has no CUDA: a minimal stand-in for torch.cuda's two counters drives the same plugin
    # code that reads the real ones on a GPU (tests/gpu covers the real torch). Growth beyond 64 MiB (or the
    # test's tolerance) is a finding; within it, caches torch fills once per process: one session note.
    # Before (issue 37): 0.004 MiB and 33 MiB read as findings, "torch memory grew in-process: cuda:0 0 MiB".
    example("core/in_process_torch_memory_growth")
    result = run_inner(pytester, "--gpuclean-report=report.json")
    result.assert_outcomes(passed=5, warnings=1)
    result.stdout.fnmatch_lines([
        "*test_inner.py:*: GpuCleanWarning: test_inner.py::test_keeps_tensors_alive: "
        "torch.cuda.memory_allocated grew during the test in the pytest process (cuda:0 +100.0 MiB, more "
        "than 64 MiB)*",
        "test_inner.py::test_keeps_tensors_alive: torch memory grew in-process: cuda:0 100 MiB",
        "gpuclean: torch memory in the pytest process grew in 3 test(s), within * MiB per device, not "
        "findings (cuda:0 +133.0 MiB in all: caches torch fills once per process): "
        "test_inner.py::test_fills_a_workspace (+33.0), test_inner.py::test_makes_a_constant (+0.0), "
        "test_inner.py::test_within_its_tolerance (+100.0)",
        "5 checked test(s), 1 with findings, 0 process(es) reaped",
    ])
    out = result.stdout.str()
    for name in ("test_frees_what_it_allocates", "test_fills_a_workspace", "test_makes_a_constant",
                 "test_within_its_tolerance"):
        assert f"test_inner.py::{name}:" not in out
    document = json.loads((pytester.path / "report.json").read_text())
    assert [(t["nodeid"].split("::")[1], t["in_process_mib"], t["findings"]) for t in document["tests"]
            if t["in_process_mib"] or t["findings"]] == [
        ("test_keeps_tensors_alive", [{"device": "cuda:0", "mib": 100.0}], True)]


def test_ignore_from_the_ini_file(example: Callable[..., Path], pytester: pytest.Pytester,
                                  outside_holder: Callable[..., int]) -> None:
    # gpuclean_ignore is a list of globs, one per line, like other pytest line lists.
    holder = outside_holder(mib=10)
    pytester.makeini("[pytest]\ngpuclean_ignore =\n    *no-such-command*\n    *simulate hold*\n"
                     "gpuclean_tolerance_mib = 20\n")
    example("core/ignore_from_the_ini_file")
    run_inner(pytester).assert_outcomes(passed=1)
    assert alive(holder)
