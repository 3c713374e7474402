"""The plugin against a real GPU: NVML v2 memory, per-process attribution, reaping CUDA holders.

Each scenario runs an inner pytest session (``-p gpuclean``, real NVML) in a subprocess, so leaks and
kills stay there; figures are printed so benchmarks/GPU-RUNS.md can quote them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

import pytest

from pytest_gpuclean._model.records import MIB
from pytest_gpuclean._reading.nvml import NvmlBackend

# A CUDA holder: allocates MIB of device memory, then records its pid (so the test knows it holds).
HOLDER = r'''
import os, signal, sys, time
import torch
mib, pidfile, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "daemon":
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
block = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
with open(pidfile, "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(3600)
'''

# What the inner tests start with; HOLDER_SOURCE becomes HOLDER as a Python string literal.
PRELUDE = '''
import os, subprocess, sys, time
import pytest
HOLDER = HOLDER_SOURCE
PIDFILE = os.environ["LEAK_PIDFILE"]

def hold(mib, mode="plain"):
    subprocess.Popen([sys.executable, "-c", HOLDER, str(mib), PIDFILE, mode])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(PIDFILE) and open(PIDFILE).read().strip():
            return int(open(PIDFILE).read().split()[0])
        time.sleep(0.05)
    raise AssertionError("CUDA holder did not start")
'''.replace("HOLDER_SOURCE", repr(HOLDER))


@pytest.fixture
def gpu_inner(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    pidfile = tmp_path / "holder.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))
    return pidfile


def _run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner=PRELUDE + body)
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", *args,
                                           timeout=300)
    print(result.stdout.str())
    return result


def test_idle_gpu_is_clean_in_v2_memory() -> None:
    backend = NvmlBackend()
    try:
        for device in backend.devices():
            snap = backend.snapshot(device)
            import pynvml

            handle = pynvml.nvmlDeviceGetHandleByUUID(device.uuid)
            v1_used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            print(f"{device.label} {device.name}: v2 used {snap.used_bytes / MIB:.0f} MiB, "
                  f"v1 used {v1_used / MIB:.0f} MiB, processes {snap.processes}")
            assert snap.processes == (), "GPU not idle: another process holds it"
            assert snap.used_bytes == 0  # v1 would say ~600 MiB (reserved) on an idle H200
    finally:
        backend.close()


def test_idle_gpu_passes_the_gate(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    result = _run(pytester, """
@pytest.mark.needs_clean_gpus
def test_idle(clean_gpus):
    assert clean_gpus.devices and all(d.used_bytes == 0 for d in clean_gpus.devices)
""")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpuclean: nvml devices (driver *), checking *",
                                 "gpuclean: GPU 0 NVIDIA *: 0/* MiB used"])


def test_torch_child_is_attributed_reaped_and_release_timed(gpu_inner: Path,
                                                             pytester: pytest.Pytester) -> None:
    result = _run(pytester, """
@pytest.mark.needs_clean_gpus
def test_leaks():
    hold(1024)

@pytest.mark.needs_clean_gpus
def test_next():
    pass
""")
    pid = int(gpu_inner.read_text().split()[0])
    result.assert_outcomes(passed=2, errors=1)
    line = next(x for x in result.stdout.lines if x.startswith(f"  pid {pid} ended by SIGTERM"))
    held = float(re.search(r"held GPU 0 (\d+) MiB", line).group(1))  # type: ignore[union-attr]
    assert 1024 <= held < 1024 + 1024  # the tensor plus its CUDA context
    assert "the driver released it" in line


def test_sigterm_ignoring_4gib_holder_needs_sigkill(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    report = gpu_inner.parent / "report.json"
    result = _run(pytester, """
@pytest.mark.needs_clean_gpus
def test_leaks():
    hold(4096, "ignore-term")
""", "--gpuclean-grace=1", f"--gpuclean-report={report}")
    pid = int(gpu_inner.read_text().split()[0])
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"  pid {pid} ended by SIGKILL after 1.*s (found as descendant*): "
                                 "held GPU 0 4*MiB; the driver released it *s after the SIGKILL"])
    if report.exists():  # the JSON report carries the release time too
        print(json.dumps(json.loads(report.read_text()), indent=1)[:4000])


def test_double_forked_cuda_daemon_is_adopted_and_reaped(gpu_inner: Path,
                                                          pytester: pytest.Pytester) -> None:
    result = _run(pytester, """
@pytest.mark.needs_clean_gpus
def test_leaks():
    hold(512, "daemon")
""")
    pid = int(gpu_inner.read_text().split()[0])
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"  pid {pid} ended by SIGTERM*(found as adopted*): held GPU 0 *MiB*"])


def test_own_cuda_context_is_not_a_leak(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    result = _run(pytester, """
import torch

@pytest.mark.needs_clean_gpus
def test_uses_cuda_in_process():
    x = torch.ones(256 * 1024 * 1024 // 4, device="cuda")
    assert float(x.sum()) == 256 * 1024 * 1024 // 4

@pytest.mark.needs_clean_gpus
def test_after():
    pass
""")
    # A note naming the test after which it was first seen (not a warning filed under test_after).
    result.assert_outcomes(passed=2, warnings=0)
    result.stdout.fnmatch_lines(["gpuclean: this pytest process (pid *) holds a CUDA context (GPU 0 * MiB), "
                                 "first seen after test_inner.py::test_uses_cuda_in_process; it is not "
                                 "counted as a leak"])


def test_own_cuda_without_a_context_is_not_a_leak(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    # What once broke the example suite on a GPU: a library asked torch whether CUDA is
    # there, in the pytest process. That initialises CUDA without a context, and the driver then counts a
    # few MiB per GPU as used, listed under no process, until the process exits.
    result = _run(pytester, """
import pynvml
import torch

def used_mib():
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    return [pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used >> 20 for h in handles]

@pytest.mark.needs_clean_gpus
def test_asks_torch_about_cuda():
    before = used_mib()
    assert torch.cuda.is_available()
    print("v2 used MiB per GPU before", before, "after torch.cuda.is_available()", used_mib())

@pytest.mark.needs_clean_gpus
def test_after():
    pass
""")
    result.assert_outcomes(passed=2, warnings=0)
    result.stdout.fnmatch_lines(["gpuclean: this pytest process (pid *) initialised CUDA without a context "
                                 "(GPU 0*), first seen after test_inner.py::test_asks_torch_about_cuda; it "
                                 "is not counted as a leak"])


def test_count_one_sets_cuda_visible_devices_to_the_uuid(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    backend = NvmlBackend()
    uuids = [d.uuid for d in backend.devices()]
    backend.close()
    result = _run(pytester, """
@pytest.mark.needs_clean_gpus(count=1)
def test_one_gpu(clean_gpus):
    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    assert visible == clean_gpus.devices[0].uuid
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count(), "
                          "torch.cuda.get_device_properties(0).uuid)"], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    print("CUDA_VISIBLE_DEVICES", visible, "torch sees", out)
    assert out[0] == "1"
    assert visible.lower().endswith(out[1].lower())
""")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["CUDA_VISIBLE_DEVICES GPU-* torch sees *"])
    assert any(u in result.stdout.str() for u in uuids)


def test_torch_compile_keeps_its_worker_pool(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    # Issue 37: torch.compile's worker pool (Triton kernels are compiled in it) serves the pytest process for
    # its whole life; it must be neither reaped nor blamed, and a later compile must find it working.
    result = _run(pytester, """
import torch
from torch._inductor.async_compile import AsyncCompile

@pytest.mark.needs_clean_gpus
def test_first_compile():
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.randn(4096, device="cuda")
    assert torch.allclose(f(x), torch.sin(x) * 2 + 1)
    pool = AsyncCompile.process_pool()
    print("compile pool", type(pool).__name__, getattr(getattr(pool, "process", None), "pid", None))

@pytest.mark.needs_clean_gpus
def test_second_compile():
    f = torch.compile(lambda x: torch.cos(x) - x)
    x = torch.randn(4096, device="cuda")
    assert torch.allclose(f(x), torch.cos(x) - x)
    assert AsyncCompile.process_pool().submit(os.getpid).result(timeout=120) != os.getpid()
""")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*gpuclean: pid * is a helper of the pytest process (torch._inductor*",
                                 "2 checked test(s), 0 with findings, 0 process(es) reaped"])


def test_torch_caches_are_not_findings_kept_tensors_are(gpu_inner: Path, pytester: pytest.Pytester) -> None:
    # A first matmul fills a cuBLAS (and cuBLASLt) workspace that torch keeps for the process's life: growth
    # of torch.cuda.memory_allocated that no test can act on, within the 64 MiB floor. A tensor kept alive
    # beyond it is a finding.
    result = _run(pytester, """
import torch

KEPT = []

@pytest.mark.needs_clean_gpus
def test_warm():
    torch.ones(1, device="cuda")

@pytest.mark.needs_clean_gpus
def test_first_matmul():
    before = torch.cuda.memory_allocated()
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    print("first matmul: memory_allocated grew by", (torch.cuda.memory_allocated() - before) / 2**20, "MiB")

@pytest.mark.needs_clean_gpus
def test_keeps_a_tensor():
    KEPT.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
""")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "first matmul: memory_allocated grew by * MiB",
        "test_inner.py::test_keeps_a_tensor: torch memory grew in-process: cuda:0 256 MiB",
        "3 checked test(s), 1 with findings, 0 process(es) reaped",
    ])
    assert "test_inner.py::test_first_matmul:" not in result.stdout.str()


def test_with_reaping_off_the_victims_of_a_known_cuda_leak_are_skipped_at_once(
        gpu_inner: Path, pytester: pytest.Pytester) -> None:
    # A CUDA holder leaked with reaping off stays, its context's unlisted overhead with it: the later tests
    # whose check finds only it are skipped at once, naming the leaker, not after a 120 s timeout each.
    report = gpu_inner.parent / "report.json"
    try:
        result = _run(pytester, """
@pytest.mark.needs_clean_gpus(timeout=2)
def test_leaks():
    hold(1024)

@pytest.mark.needs_clean_gpus
def test_victim():
    pass

@pytest.mark.needs_clean_gpus
def test_victim_too():
    pass
""", "--gpuclean-reap=off", "--gpuclean-timeout=120", f"--gpuclean-report={report}")
        pid = int(gpu_inner.read_text().split()[0])
        result.assert_outcomes(passed=1, skipped=2, errors=1)
        result.stdout.fnmatch_lines([
            "SKIPPED [[]1[]] test_inner.py:*: gpuclean: the GPUs hold what test_inner.py::test_leaks leaked "
            f"and reaping is off: pid {pid} (GPU 0 * MiB); not run (--gpuclean-reap=off, from the command "
            "line)",
            "3 checked test(s), 1 with findings, 0 process(es) reaped",
        ])
        tests = {t["nodeid"]: t for t in json.loads(report.read_text())["tests"]}
        for name in ("test_victim", "test_victim_too"):
            victim = tests[f"test_inner.py::{name}"]
            print(name, "check before took", victim["before"]["waited_s"], "s")
            assert victim["blocked_by"] == ["test_inner.py::test_leaks"] and not victim["findings"]
            assert victim["before"]["waited_s"] < 30
    finally:
        for pid_text in gpu_inner.read_text().split() if gpu_inner.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_text), signal.SIGKILL)


def test_a_session_fixtures_cuda_memory_is_excused_out_loud(gpu_inner: Path,
                                                            pytester: pytest.Pytester) -> None:
    # A session fixture's CUDA server on GPU 0: every check excuses it, and the session says so once, with
    # the fixture's definition; a count=1 test on that GPU is told what count promises beside it.
    result = _run(pytester, """
@pytest.fixture(scope="session")
def server():
    pid = hold(1024)
    yield pid
    os.kill(pid, 15)

@pytest.mark.needs_clean_gpus
def test_uses(server):
    pass

@pytest.mark.needs_clean_gpus(count=1)
def test_count(server, clean_gpus):
    print("clean_gpus used MiB", [d.used_bytes / 2**20 for d in clean_gpus.devices])
""", "--gpuclean-devices=0")
    pid = int(gpu_inner.read_text().split()[0])
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        f"gpuclean: excused: GPU 0 * MiB held by pid {pid} of fixture server (session-scoped, "
        "test_inner.py:*), while the fixture is active: the fixture's own, not a test's leak",
        "gpuclean: test_inner.py::test_count (count=1) got GPU 0 with * MiB of fixture server "
        "(session-scoped, test_inner.py:*) on it: count makes a test's GPUs exclusive against other tests "
        "and sessions, not against this session's own fixtures",
        "2 checked test(s), 0 with findings, 0 process(es) reaped",
    ])
