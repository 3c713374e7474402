"""Issue 37 ("a guest that changes nothing") on a real GPU: what the CPU suite shows with simulated devices,
with real CUDA processes and NVML open in the pytest process.

- a persistent server (``--gpuclean-persistent``) holding CUDA memory outlives two sessions, reused, never
  signalled, named once per session, its memory excused; undeclared, the third session reaps it as a dead
  session's debris (tests/test_compat.py ``test_a_persistent_server_outlives_each_session_and_is_reused``);
- helpers declared by glob (``--gpuclean-helpers``): one with NVML open and no GPU memory is left alone and
  named once; one holding CUDA memory is judged (``test_helpers_declared_by_their_command_line``,
  ``test_a_declared_helper_that_holds_gpu_memory_is_judged``);
- children forked in a checked test die of SIGTERM as POSIX says, with or without CUDA of their own
  (tests/test_guest.py ``test_forked_children_die_of_sigterm_as_posix_says``);
- a test whose setup reaps an earlier test's CUDA leak is a victim: noticed, not counted "with findings"
  (tests/test_outputs.py ``test_with_findings_counts_only_the_tests_at_fault_as_the_json_does``).

Each scenario runs inner pytest sessions (``-p gpuclean``, real NVML) in subprocesses; every process they
start records its pid in a folder that ``gpu_inner`` empties at the end, waiting until NVML shows the GPU
memory back. Run on one GPU: ``python3 -m pytest tests/gpu/test_gpu_guest.py -v -s -p no:cacheprovider``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_helpers import alive, used_mib
from helpers import summary_of

# What the inner sessions' processes do with the GPU (gpu_use.py, next to the inner tests): the only real-GPU
# code of the inner sources.
GPU_USE = '''
"""What the inner sessions' processes do with the real GPU."""
import os
import time

_kept = []


def use_cuda(mib):
    """Hold mib MiB of device memory in this process (its CUDA context and a tensor) until it exits."""
    import torch
    _kept.append(torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


def open_nvml():
    """Open NVML in this process: the driver's device files, no GPU memory."""
    import pynvml
    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetCount()


def used_mib():
    """Every GPU's memory in use (NVML v2)."""
    import pynvml
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    return sum(pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used for h in handles) / 2**20


def driver_files():
    """The NVIDIA device files this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return sorted(found)


def settle(before_mib, timeout=60):
    """Wait until the GPUs hold no more than before_mib again (the driver frees a dead process's memory a
    moment after it is collected)."""
    deadline = time.monotonic() + timeout
    while used_mib() > before_mib + 2:
        assert time.monotonic() < deadline, "GPU memory not released"
        time.sleep(0.1)
'''

# What every inner test module starts with: start(script, name, *args) runs a script next to it, which
# writes its pid to $GPU_GUEST_PIDS/<name>.pid once it holds what it holds.
PRELUDE = '''
import os, subprocess, sys, time
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PIDS = os.environ["GPU_GUEST_PIDS"]


def start(script, name, *args):
    pidfile = os.path.join(PIDS, name + ".pid")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), pidfile, *args])
    deadline = time.monotonic() + 120
    while not os.path.exists(pidfile):
        assert proc.poll() is None, script + " exited with " + str(proc.returncode)
        assert time.monotonic() < deadline, script + " did not start"
        time.sleep(0.05)
    return proc
'''

# Scripts the inner tests start: argv[1] is the pid file, written (atomically) once the process holds.
WRITE_PID = '''
def write_pid(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
'''

CUDA_HOLDER = '''
"""Holds argv[2] MiB of the GPU until it is killed."""
import os, sys, time
import gpu_use
''' + WRITE_PID + '''
gpu_use.use_cuda(int(sys.argv[2]))
write_pid(sys.argv[1])
time.sleep(3600)
'''

GPU_MONITOR = '''
"""A helper that watches the GPUs through NVML: the driver's files open, no GPU memory held."""
import os, sys, time
import gpu_use
''' + WRITE_PID + '''
gpu_use.open_nvml()
write_pid(sys.argv[1])
time.sleep(600)
'''

MODEL_SERVER = '''
"""model-server: double-forks, holds 512 MiB of the GPU, writes its pid, serves until killed."""
import os, sys, time

if os.fork() > 0:
    os._exit(0)
os.setsid()
if os.fork() > 0:
    os._exit(0)
import gpu_use
''' + WRITE_PID + '''
gpu_use.use_cuda(512)
write_pid(sys.argv[1])
while True:
    time.sleep(60)
'''

SERVER_CONFTEST = '''
import os, subprocess, sys, time
import pytest

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_server.py")


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture(scope="session")
def model_server():
    # A warm model server kept across runs: started once (double-forked, its own session), reused while it
    # lives. Its pid file is the fixture's own record.
    pidfile = os.path.join(os.environ["GPU_GUEST_PIDS"], "server.pid")
    if os.path.exists(pidfile):
        pid = int(open(pidfile).read())
        if _alive(pid):
            yield pid
            return
        os.remove(pidfile)
    log = pidfile + ".log"
    with open(log, "a") as out:
        subprocess.run([sys.executable, SERVER, pidfile], check=True, stdout=out, stderr=out)
    deadline = time.monotonic() + 120
    while not os.path.exists(pidfile):
        assert time.monotonic() < deadline, "the model server did not start: " + open(log).read()
        time.sleep(0.05)
    yield int(open(pidfile).read())
'''

PERSISTENT_INNER = '''
import os
import pytest


@pytest.mark.needs_clean_gpus
def test_asks_the_server(model_server, clean_gpus):
    # What the setup check read (before the session fixture ran): the GPU with the server on it, if it runs.
    used = sum(d.used_bytes for d in clean_gpus.devices) / 2**20
    with open(os.environ["SEEN"], "a") as f:
        f.write("%d %.0f\\n" % (model_server, used))
'''

HELPERS_INNER = PRELUDE + '''
_monitor = None


def monitor():
    # A helper started once, for the pytest process's life, by whichever test first needs it.
    global _monitor
    if _monitor is None:
        _monitor = start("gpu_monitor.py", "monitor", "gpuclean-guest-helper")
    return _monitor


@pytest.mark.needs_clean_gpus
def test_1_first_use_starts_it():
    assert monitor().poll() is None


@pytest.mark.needs_clean_gpus
def test_2_later_use_finds_it():
    assert monitor().poll() is None


@pytest.mark.needs_clean_gpus
def test_3_starts_a_helper_that_holds_gpu_memory():
    start("cuda_holder.py", "cuda_helper", "256", "gpuclean-guest-helper")


@pytest.mark.needs_clean_gpus
def test_4_the_first_helper_still_serves():
    assert monitor().poll() is None
'''

SIGTERM_INNER = '''
import ctypes, json, multiprocessing, os, select, signal, time
import pytest
import gpu_use


def sleeper(started, cuda):
    if cuda:
        gpu_use.use_cuda(128)
    started.set()
    time.sleep(120)


def sigtermed(fork, cuda):
    """A child made by fork (with CUDA memory of its own if cuda) sleeps in a try/finally and gets SIGTERM:
    [the signal that ended it, whether its finally block ran]."""
    r, w = os.pipe()
    pid = fork()
    if pid == 0:
        try:
            try:
                if cuda:
                    gpu_use.use_cuda(128)
                os.write(w, b"x")
                time.sleep(120)
            finally:
                os.write(w, b"finally")
        finally:
            os._exit(1)
    ready = select.select([r], [], [], 120)[0]
    first = os.read(r, 1) if ready else b""
    if first != b"x":
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child did not start: %r" % first)
    time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
    status = os.waitpid(pid, 0)[1]
    os.close(w)
    ran_finally = os.read(r, 16) == b"finally"
    os.close(r)
    return [os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, ran_finally]


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("cuda", [False, True], ids=["without_cuda", "with_cuda"])
def test_forked_sigterm(request, cuda):
    before = gpu_use.used_mib()
    handler = signal.getsignal(signal.SIGTERM)
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    process = ctx.Process(target=sleeper, args=(started, cuda))
    process.start()
    assert started.wait(120), "the multiprocessing child did not start"
    time.sleep(0.05)
    process.terminate()
    process.join(60)
    found = {"handler": getattr(handler, "__qualname__", repr(handler)),
             "driver_files": gpu_use.driver_files(),
             "mp_exitcode": process.exitcode,
             "fork": sigtermed(os.fork, cuda)}
    if not cuda:
        # A fork from C (ctypes.PyDLL: the GIL stays held, as in os.fork) runs no at-fork hook of Python.
        found["rawfork"] = sigtermed(ctypes.PyDLL(None).fork, False)
    with open(os.path.join(os.environ["SIGTERM_OUT"], request.node.callspec.id + ".json"), "w") as f:
        json.dump(found, f)
    gpu_use.settle(before)  # the teardown check then finds the GPU as the test found it
'''

VICTIM_INNER = PRELUDE + '''
def test_1_leaks_unchecked():
    start("cuda_holder.py", "leak_1", "256")  # never stopped; not checked: the next check finds it


@pytest.mark.needs_clean_gpus
def test_2_victim_reaps_it_before():
    pass


@pytest.mark.needs_clean_gpus
def test_3_leaks():
    start("cuda_holder.py", "leak_3", "256")
'''


@pytest.fixture
def gpu_inner(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Inner sessions on the real GPU; the folder where their processes write their pids. At the end, every
    one of them still alive is killed, and NVML must show the GPU memory back as it was before the test."""
    # Not importorskip: torch imported here would be dropped from sys.modules by the pytester fixture's
    # snapshot at this test's end (seen on an H200). The CUDA users are subprocesses.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (the inner sessions' CUDA processes)")
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    for name in ("PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("GPU_GUEST_PIDS", str(pids))
    pytester.makepyfile(gpu_use=GPU_USE, cuda_holder=CUDA_HOLDER)
    before = used_mib()
    print(f"GPU used before: {before:.0f} MiB")
    yield pids
    _leave_idle(pids, str(pytester.path), before)


def _leave_idle(pids: Path, inner_dir: str, before: float) -> None:
    started = [int(p.read_text()) for p in pids.glob("*.pid")]
    left = [pid for pid in started if alive(pid) and inner_dir in _cmdline(pid)]  # (never a reused pid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    _wait_dead(started, timeout=30)
    while (used := used_mib()) > before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"left alive and killed: {left}; GPU used after: {used:.0f} MiB")
    assert not [pid for pid in left if alive(pid)]
    assert used <= before + 2, f"GPU memory not back: {used:.0f} MiB used, {before:.0f} before"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-p", "no:randomly",
                                           "-rA", *args, timeout=300)
    print(result.stdout.str())
    print(result.stderr.str())
    print(f"inner session {' '.join(args)}: {time.monotonic() - started:.1f}s")
    return result


def _pid(pids: Path, name: str) -> int:
    return int((pids / f"{name}.pid").read_text())


def _wait_dead(pids: list[int], timeout: float = 30) -> list[int]:
    """Those of ``pids`` still alive after ``timeout``; the others collected if they were re-parented to this
    process (a subreaper)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return [p for p in pids if alive(p)]


def test_a_persistent_cuda_server_outlives_each_session_and_is_reused(
        gpu_inner: Path, pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A warm model server kept across runs, 512 MiB of real CUDA memory: named by --gpuclean-persistent, it is
    # no leak of the session fixture that started it and no dead session's debris in the next run; its memory
    # is excused in every check, and the next session's marked test sees it on the GPU (README, "persistent
    # processes"). Undeclared, the next session reaps it as a dead session's debris.
    seen = tmp_path / "seen.txt"
    monkeypatch.setenv("SEEN", str(seen))
    monkeypatch.setenv("GPUCLEAN_DEAD_SESSIONS", "on")  # (the default, said: the third run relies on it)
    pytester.makepyfile(conftest=SERVER_CONFTEST, model_server=MODEL_SERVER, test_inner=PERSISTENT_INNER)
    for run in (1, 2):
        result = _run(pytester, "--gpuclean-persistent=*model_server.py*")
        result.assert_outcomes(passed=1)
        assert summary_of(result)[-1] == "1 checked test(s), 0 with findings, 0 process(es) reaped"
        server = _pid(gpu_inner, "server")
        named = [line for line in result.outlines if f"pid {server} is persistent" in line]
        assert len(named) == 1, named  # once per session
        assert fnmatch.fnmatch(named[0], f"gpuclean: pid {server} is persistent (its command line matches "
                                          "--gpuclean-persistent*): left running past the session, never "
                                          "signalled, its GPU memory excused in every check: *")
        assert alive(server), f"run {run} ended the persistent server"
    runs = [line.split() for line in seen.read_text().splitlines()]
    server = int(runs[0][0])
    used = [float(r[1]) for r in runs]
    print(f"server pid per run {[r[0] for r in runs]}; used MiB at each setup check {used}; "
          f"GPU used now {used_mib():.0f} MiB")
    assert [int(r[0]) for r in runs] == [server, server]  # reused, not started again
    # The first setup check ran before the session fixture started the server; the second found it there.
    assert used[0] < 512 <= used[1]
    assert used_mib() >= 512

    # Undeclared: the debris of the session that started it, reaped by the first check; the server the
    # fixture starts again is the fixture's leak, reaped at the session's end.
    result = _run(pytester)
    result.assert_outcomes(passed=1, errors=1)
    assert _wait_dead([server]) == []
    result.stdout.fnmatch_lines(["gpuclean: fixture model_server (session-scoped, conftest.py:*) leaked 1 "
                                 "process(es) (reaped), found at the teardown of "
                                 "test_inner.py::test_asks_the_server"])
    result.stdout.fnmatch_lines([f"gpuclean: pid {server}: left by dead session *, spawned by fixture "
                                 "model_server (session-scoped): reaped (SIGTERM)"])
    # The dead session's fixture is no test of this session (no "unchecked test(s) that leaked").
    assert summary_of(result)[-1] == (
        "1 checked test(s), 0 with findings, 1 fixture(s) that leaked processes, 2 process(es) reaped")
    assert _wait_dead([_pid(gpu_inner, "server")]) == []


def test_declared_helpers_on_the_gpu(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    # A helper declared by its command line that has NVML open (the driver's files) but holds no GPU memory is
    # no leak of the test that started it: named once, still serving the later tests, ended at the session's
    # end. One that holds CUDA memory is judged like any process: its test's leak, reaped.
    pytester.makepyfile(gpu_monitor=GPU_MONITOR, test_inner=HELPERS_INNER)
    result = _run(pytester, "--gpuclean-helpers=*gpuclean-guest-helper*")
    result.assert_outcomes(passed=4, errors=1)
    monitor, holder = _pid(gpu_inner, "monitor"), _pid(gpu_inner, "cuda_helper")
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_3_starts_a_helper_that_holds_gpu_memory*"])
    result.stdout.fnmatch_lines([f"  pid {holder} ended by SIGTERM*: held GPU 0 *MiB*"])
    named = [line for line in result.outlines if "is a helper of the pytest process" in line]
    assert len(named) == 1, named  # the monitor, once; never the holder
    assert fnmatch.fnmatch(named[0], f"gpuclean: pid {monitor} is a helper of the pytest process (its "
                                     "command line matches --gpuclean-helpers, started during "
                                     "test_inner.py::test_1_first_use_starts_it): not a leak, left to end "
                                     "with the session: *")
    summary = summary_of(result)
    assert summary[-1] == "4 checked test(s), 1 with findings, 1 process(es) reaped"
    assert [line.split(": ", 1)[0] for line in summary if line.startswith("test_inner.py::")] == [
        "test_inner.py::test_3_starts_a_helper_that_holds_gpu_memory"]
    assert f"gpuclean: ended 1 helper process(es) of the pytest process at the session's end " \
           f"(--gpuclean-helpers; not leaks): pid {monitor} SIGTERM" in result.stdout.str()
    assert _wait_dead([monitor, holder]) == []


def test_forked_children_die_of_sigterm_with_nvml_open(
        gpu_inner: Path, pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checked test, NVML open in the pytest process and the plugin's SIGTERM handler installed there: the
    # children it forks (multiprocessing's fork context, os.fork, a fork from C) die of SIGTERM as POSIX says
    # (-15, no finally block, no KeyboardInterrupt), whether they hold CUDA memory of their own or nothing.
    out = tmp_path / "sigterm"
    out.mkdir()
    monkeypatch.setenv("SIGTERM_OUT", str(out))
    pytester.makepyfile(test_inner=SIGTERM_INNER)
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    assert "KeyboardInterrupt" not in result.stdout.str() + result.stderr.str()
    assert summary_of(result)[-1] == "2 checked test(s), 0 with findings, 0 process(es) reaped"
    without = json.loads((out / "without_cuda.json").read_text())
    with_cuda = json.loads((out / "with_cuda.json").read_text())
    print("without CUDA:", without, "\nwith CUDA:", with_cuda)
    for found in (without, with_cuda):
        # (what the children inherited: the plugin's handler, and the driver's files NVML keeps open)
        assert found["handler"] == "SigtermAsInterrupt._on_sigterm"
        assert any(path.startswith("/dev/nvidia") for path in found["driver_files"])
        assert found["mp_exitcode"] == -15
        assert found["fork"] == [15, False]  # [killed by, finally ran]
    assert without["rawfork"] == [15, False]


def test_the_victim_of_a_cuda_leak_is_not_a_finding(gpu_inner: Path, pytester: pytest.Pytester,
                                                    tmp_path: Path) -> None:
    # An unchecked test leaks a CUDA holder; the next (marked) test's setup reaps it: that test is clean,
    # noticed, not counted "with findings". A marked test that leaks is.
    report = tmp_path / "report.json"
    pytester.makepyfile(test_inner=VICTIM_INNER)
    result = _run(pytester, f"--gpuclean-report={report}")
    result.assert_outcomes(passed=3, errors=1)
    leak_1, leak_3 = _pid(gpu_inner, "leak_1"), _pid(gpu_inner, "leak_3")
    assert _wait_dead([leak_1, leak_3]) == []
    summary = summary_of(result)
    assert summary[-1] == ("2 checked test(s), 1 with findings, 1 unchecked test(s) that leaked processes, "
                           "2 process(es) reaped")
    victim = "test_inner.py::test_2_victim_reaps_it_before"
    assert [line for line in summary if line.startswith(victim + ":")] == [
        line for line in summary if fnmatch.fnmatch(
            line, f"{victim}: noticed, not a finding: setup: reaped 1 (pid {leak_1} SIGTERM)*")]
    assert any(line.startswith(victim + ":") for line in summary)
    at_fault = sorted(line.split(": ", 1)[0] for line in summary
                      if line.startswith("test_inner.py::") and "noticed, not a finding" not in line)
    assert at_fault == ["test_inner.py::test_1_leaks_unchecked", "test_inner.py::test_3_leaks"]
    document = json.loads(report.read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in document["tests"]}
    print(json.dumps(tests.get("test_2_victim_reaps_it_before"), indent=1)[:3000])
    assert tests["test_2_victim_reaps_it_before"]["outcome"] == "clean"
    assert not tests["test_2_victim_reaps_it_before"]["findings"]
    [reaped] = tests["test_2_victim_reaps_it_before"]["before"]["reaped"]
    assert reaped["process"]["pid"] == leak_1
    assert reaped["owner"] == {"kind": "test", "name": "test_inner.py::test_1_leaks_unchecked"}
    assert sum(d["mib"] for d in reaped["mib_per_device"]) >= 256  # real CUDA memory, seen as the leak's
    assert tests["test_1_leaks_unchecked"]["outcome"] == "leaked"
    assert tests["test_3_leaks"]["outcome"] == "leaked"
    assert document["summary"]["with_findings"] == 1
