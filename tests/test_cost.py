"""What gpuclean costs, as facts a session can observe; the timings are in benchmarks/.

A session that checks no test must get nothing from gpuclean but its options' validation and the cookie:
no subreaper, no lock directory, no psutil, no NVML. The cheaper descendant walk must still find a child
started from any thread, and starting lazily must not turn what the session set-up started into leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import read_pids, run_inner, wait_dead

RECORD_STATE = '''
import json, os, sys

CTYPES_BEFORE = "ctypes" in sys.modules  # (another plugin's, e.g. pytest-isolate's pynvml)

def pytest_sessionfinish(session):
    modules = sorted(m for m in sys.modules if m.split(".")[0] in ("psutil", "pynvml")
                     or m.startswith("pytest_gpuclean."))
    ctypes_loaded = "ctypes" in sys.modules and not CTYPES_BEFORE  # before this probe loads it itself
    import ctypes
    subreaper = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(subreaper), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    with open(os.environ["STATE_FILE"], "w") as f:
        json.dump({"subreaper": subreaper.value,
                   "modules": modules,
                   "ctypes_loaded": ctypes_loaded,
                   "cookie": os.environ.get("GPUCLEAN_TEST"),
                   "forked": any(getattr(p, "__name__", None) in ("pytest_forked", "pytest_isolate.plugin")
                                 for p in session.config.pluginmanager.get_plugins()),
                   "plugins": sorted(name for name, _ in session.config.pluginmanager.list_name_plugin()
                                     if name and name.startswith("gpuclean-"))}, f)
'''

UNCHECKED = """
def test_plain():
    pass

def test_other():
    pass
"""


@pytest.mark.parametrize("args", [(), ("--co",)], ids=["run", "collect-only"])
def test_a_session_that_checks_nothing_does_nothing(sim: Path, pytester: pytest.Pytester,
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    args: tuple[str, ...]) -> None:
    pytester.makepyfile(test_inner=UNCHECKED + """
import os

def test_cookie():
    # What a test or fixture starts carries the session's cookie even while nothing is checked.
    assert os.environ["GPUCLEAN_TEST"].endswith(":session")
""")
    pytester.makeconftest(RECORD_STATE)
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    monkeypatch.delenv("GPUCLEAN_SIMULATE")  # were it to start, it would try NVML
    lock_dir = tmp_path / "locks"
    result = run_inner(pytester, *args)
    assert result.ret == pytest.ExitCode.OK
    if not args:
        result.assert_outcomes(passed=3)
    state = json.loads(state_file.read_text())
    assert state["subreaper"] == 0
    # No psutil, no NVML bindings, none of the checking code: only what validates the options and
    # exports the cookie.
    assert state["modules"] == ["pytest_gpuclean.core", "pytest_gpuclean.core.cookie",
                                "pytest_gpuclean.core.procfs", "pytest_gpuclean.core.settings",
                                "pytest_gpuclean.plugin", "pytest_gpuclean.session",
                                "pytest_gpuclean.session.names"]
    assert state["cookie"].endswith(":session")
    if not args:
        # Of the plugin's hooks, only one per test is left: the one that notices a test checked after all.
        assert "gpuclean-checker" not in state["plugins"]
        assert "gpuclean-checker-idle" in state["plugins"]
    assert not lock_dir.exists()
    assert "gpuclean" not in result.stdout.str().replace("plugins: gpuclean", "")


def test_a_session_that_checks_nothing_but_names_its_devices_only_reads_them(
        sim: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The explicit list is held against the devices (README): the backend is opened for that and closed;
    # nothing else of a started session comes with it.
    pytester.makepyfile(test_inner=UNCHECKED)
    pytester.makeconftest(RECORD_STATE)
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    result = run_inner(pytester, "--gpuclean-devices=1,0")
    result.assert_outcomes(passed=2)
    state = json.loads(state_file.read_text())
    assert state["subreaper"] == 0
    assert state["modules"] == ["pytest_gpuclean.core", "pytest_gpuclean.core.cookie",
                                "pytest_gpuclean.core.devices", "pytest_gpuclean.core.procfs",
                                "pytest_gpuclean.core.settings", "pytest_gpuclean.model",
                                "pytest_gpuclean.model.records", "pytest_gpuclean.plugin",
                                "pytest_gpuclean.session", "pytest_gpuclean.session.names"]
    assert "gpuclean-checker-idle" in state["plugins"]
    assert not (tmp_path / "locks").exists()


NO_TEMP_DIR = """
import sys, tempfile
# Every candidate of the temporary directory unusable (a full or read-only /tmp): only what needs it fails.
tempfile._candidate_tempdir_list = lambda: ["/nonexistent/gpuclean-test"]
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_a_session_that_checks_nothing_needs_no_temporary_directory(pytester: pytest.Pytester) -> None:
    # Finding the temporary directory writes a probe file there; only the default lock directory needs it.
    pytester.makepyfile(test_inner=UNCHECKED)
    script = pytester.makepyfile(run_without_tmp=NO_TEMP_DIR)
    result = pytester.run(sys.executable, str(script), "-p", "gpuclean", "-p", "no:cacheprovider",
                          "--capture=sys", "-q", "test_inner.py", timeout=120)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["2 passed*"])


def test_the_default_lock_directory_is_found_when_first_read() -> None:
    script = """
import os, tempfile
import pytest_gpuclean.plugin
from pytest_gpuclean.core import settings
resolved = settings.Settings()
assert tempfile.tempdir is None, "the temporary directory was looked up on import"
assert resolved.lock_dir == os.path.join(tempfile.gettempdir(), "gpuclean-locks")
assert settings.Settings(lock_dir="/x").lock_dir == "/x"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")})
    assert done.returncode == 0, done.stderr


def test_a_collected_checked_test_starts_the_session(inner: Callable[[str], Path], pytester: pytest.Pytester,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The counterpart: one marked test among unmarked ones starts everything, before the first test.
    inner(UNCHECKED + """
@pytest.mark.needs_clean_gpus
def test_checked():
    pass
""")
    pytester.makeconftest(RECORD_STATE)
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    result = run_inner(pytester)
    result.assert_outcomes(passed=3)
    state = json.loads(state_file.read_text())
    assert state["subreaper"] == 1
    assert "pytest_gpuclean.core.checker" in state["modules"]
    # The subreaper is set through _ctypes (processes._prctl says why): ctypes itself stays unloaded.
    assert not state["ctypes_loaded"]
    # The model is one module of records (cheap classes: no dataclass compiles methods at import) and its
    # decisions, loaded whole; nothing of Ray loads without --gpuclean-ray, and no plugin of its hooks.
    assert {m for m in state["modules"] if m.startswith("pytest_gpuclean.model")} == {
        "pytest_gpuclean.model", "pytest_gpuclean.model.decisions", "pytest_gpuclean.model.records",
        "pytest_gpuclean.model.text"}
    assert not [m for m in state["modules"] if m.startswith("pytest_gpuclean.ray")]
    assert "gpuclean-ray" not in state["plugins"]
    # Nor the report's and shipping code, without a report, JUnit XML or xdist; and the hooks that run
    # for every test report are those of the outputs asked for (none here) and of pytest-forked (absent).
    assert not ({"pytest_gpuclean.report.jsonreport", "pytest_gpuclean.report.serialize"}
                & set(state["modules"]))
    assert "gpuclean-checker-outputs" in state["plugins"]
    assert "gpuclean-checker-outputs-tests" not in state["plugins"]
    assert ("gpuclean-checker-forked" in state["plugins"]) == state["forked"]
    assert (tmp_path / "locks").is_dir()
    # The device lines come right after the collection, before any test.
    result.stdout.fnmatch_lines(["collected 3 items", "gpuclean: simulated devices*checking 2*",
                                 "gpuclean: GPU 0 *", "gpuclean: GPU 1 *", "test_inner.py ...*"])


def test_a_report_asked_for_starts_the_session(inner: Callable[[str], Path], pytester: pytest.Pytester,
                                              tmp_path: Path) -> None:
    # No checked test, but a report: the session is watched, and the report names what was left behind
    # (how the project's own CI checks that its tests leave nothing: .ci/test).
    pidfile = inner("""
def test_unmarked_leak():
    hold(mib=1)
    wait_holders(1)
""")
    report = tmp_path / "report.json"
    result = run_inner(pytester, f"--gpuclean-report={report}")
    result.assert_outcomes(passed=1)
    leaked = read_pids(pidfile)[0]
    document = json.loads(report.read_text())
    assert document["session"]["backend"] == "simulated"
    assert [r["process"]["pid"] for r in document["session_reaped"]] == [leaked]
    assert wait_dead([leaked], timeout=2) == []


def test_a_test_checked_after_the_collection_starts_the_session(inner: Callable[[str], Path],
                                                                pytester: pytest.Pytester) -> None:
    # The collection found nothing to check; a conftest marks one test while it is set up.
    pidfile = inner("""
def test_plain():
    pass

def test_late():
    hold(mib=2)
    wait_holders(1)

def test_plain_again():
    pass
""")
    pytester.makeconftest("""
import pytest

@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    if item.name == "test_late":
        item.add_marker(pytest.mark.needs_clean_gpus)
    return (yield)
""")
    result = run_inner(pytester, "--gpuclean-grace=2", "--gpuclean-settle=0")
    leaked = read_pids(pidfile)[0]
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_late _*",
                                 "gpuclean: test leaked 1 process(es) (reaped)"])
    assert f"pid {leaked} " in result.stdout.str()
    assert wait_dead([leaked], timeout=2) == []


def test_bad_lock_directory_fails_before_the_first_checked_test(
        inner: Callable[[str], Path], pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(not_a_dir / "locks"))
    pidfile = inner("""
def test_unmarked_first():
    hold(mib=1)

@pytest.mark.needs_clean_gpus
def test_checked():
    pass
""")
    result = run_inner(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --gpuclean-lock-dir: * (from environment variable GPUCLEAN_LOCK_DIR)"])
    assert not pidfile.exists()  # no test ran


THREAD_LEAK = """
import threading

STOP = threading.Event()
# No GPU memory: nothing but the walk of our descendants can find these two.
SLEEPER = (
    "import os, sys, time\\n"
    "os.fork()\\n"
    "with open(sys.argv[1], 'a') as f:\\n"
    "    f.write(f'{os.getpid()}\\\\n')\\n"
    "time.sleep(300)\\n")

# Threads as torch or OpenMP start them, from the start of the session.
for _ in range(64):
    threading.Thread(target=STOP.wait, daemon=True).start()

@pytest.mark.needs_clean_gpus
def test_before():
    pass

@pytest.mark.needs_clean_gpus
def test_thread_leaks():
    # A thread that starts a process (which forks a second) and lives on: the kernel lists a child under
    # the thread that forked it, not under the main thread.
    started = threading.Event()

    def spawn():
        subprocess.Popen([sys.executable, "-c", SLEEPER, PIDFILE])
        started.set()
        STOP.wait()

    threading.Thread(target=spawn, daemon=True).start()
    assert started.wait(30)
    wait_holders(2)

@pytest.mark.needs_clean_gpus
def test_after():
    STOP.set()
"""


def test_a_child_started_from_another_thread_is_found_and_reaped(inner: Callable[[str], Path],
                                                                pytester: pytest.Pytester) -> None:
    pidfile = inner(THREAD_LEAK)
    result = run_inner(pytester, "--gpuclean-grace=2", "--gpuclean-settle=0")
    leaked = read_pids(pidfile, 2)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_thread_leaks _*",
                                 "gpuclean: test leaked 2 process(es) (reaped)"])
    out = result.stdout.str()
    for pid in leaked:
        assert f"pid {pid} " in out
    assert wait_dead(leaked, timeout=2) == []


SET_UP_CONFTEST = '''
import os, subprocess, sys, time

SIM = os.environ["GPUCLEAN_SIMULATE"]
PIDFILE = os.environ["LEAK_PIDFILE"]

def _wait(n):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(PIDFILE) and len(open(PIDFILE).read().split()) >= n:
            return
        time.sleep(0.01)
    raise AssertionError("holder did not start")

def pytest_configure(config):
    # A daemon (double fork, setsid) started before gpuclean is a subreaper: it leaves the tree at once,
    # and only its cookie says that the session set-up started it. It holds GPU memory.
    subprocess.run([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir", SIM, "--mib", "32",
                    "--daemonize", "--pidfile", PIDFILE], check=True)
    _wait(1)
'''

SET_UP_TESTS = """
SERVER = hold(mib=8)  # started by the collection (module import): a child of pytest
wait_holders(2)

@pytest.fixture(scope="session")
def service():
    proc = hold(mib=4)
    wait_holders(3)
    yield proc
    proc.terminate()
    proc.wait(10)

def test_unchecked():
    pass

@pytest.mark.needs_clean_gpus
def test_checked(service):
    pass

@pytest.mark.needs_clean_gpus
def test_checked_again(service):
    pass
"""


def test_what_the_session_set_up_started_before_the_start_is_the_sessions(
        inner: Callable[[str], Path], pytester: pytest.Pytester) -> None:
    pidfile = inner(SET_UP_TESTS)
    pytester.makeconftest(SET_UP_CONFTEST)
    result = run_inner(pytester)
    daemon, server, service = read_pids(pidfile, 3)
    out = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=3)
    assert "leaked" not in out.replace("0 with findings", "")
    # Nobody stopped the daemon or the collection's server: reaped at the very end, as the session's.
    assert "gpuclean: reaped 2 process(es) of the session set-up (conftest, plugins) still alive after " \
           "pytest_unconfigure" in out
    assert f"pid {daemon} SIGTERM" in out and f"pid {server} SIGTERM" in out
    assert wait_dead([daemon, server, service]) == []


COUNT_READINGS = '''
import gc, json, os

def pytest_unconfigure(config):
    from pytest_gpuclean.model.records import DeviceSnapshot
    from pytest_gpuclean.plugin import DeviceState
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (DeviceSnapshot, DeviceState))]
    with open(os.environ["STATE_FILE"], "w") as f:
        json.dump({name: alive.count(name) for name in ("DeviceSnapshot", "DeviceState")}, f)
'''


def test_clean_tests_share_their_device_readings(inner: Callable[[str], Path], pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The session keeps every test's record to the end (for its report), and every full garbage collection
    # walks what it keeps, pytest's last ones included: readings equal to the device's previous one are
    # shared, and the clean_gpus fixture's value is built only for a test that asks for it.
    inner("pytestmark = pytest.mark.needs_clean_gpus\n"
          + "".join(f"\ndef test_{i}():\n    pass\n" for i in range(40))
          + "\ndef test_fixture(clean_gpus):\n"
            "    assert [d.used_bytes for d in clean_gpus.devices] == [0, 0]\n")
    pytester.makeconftest(COUNT_READINGS)
    state_file = tmp_path / "state.json"
    monkeypatch.setenv("STATE_FILE", str(state_file))
    run_inner(pytester).assert_outcomes(passed=41)
    alive = json.loads(state_file.read_text())
    # Two simulated devices: their readings (two before they were first shared, at most), not 41 x 2 x 2.
    assert alive["DeviceSnapshot"] <= 4, alive
    assert alive["DeviceState"] == 0, alive
