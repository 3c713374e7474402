"""The ``gpuclean`` command against a real GPU: status, the pre-job check on an idle GPU and with a torch
child holding ~1 GiB, and the post-job reap that ends that child.

Skipped without NVML (the tests/gpu hook in tests/conftest.py). Outputs are printed (run with ``-s``)
for docs/ci.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gpu_helpers import TORCH_HOLDER, first_whole_gpu

from pytest_gpuclean._model.records import DeviceInfo

HOLD_MIB = 1024


@pytest.fixture(scope="module")
def device() -> DeviceInfo:
    return first_whole_gpu()


@pytest.fixture
def hook_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment a runner hook would have: real NVML, no pinning, no gpuclean settings."""
    for name in list(os.environ):
        if name.startswith("GPUCLEAN_") or name in ("CUDA_VISIBLE_DEVICES", "PYTEST_XDIST_TESTRUNUID"):
            monkeypatch.delenv(name)
    return dict(os.environ)


def gpuclean(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True,
                            text=True, timeout=300, env=env)
    print(f"$ gpuclean {' '.join(args)}  -> exit {result.returncode}\n{result.stdout}{result.stderr}")
    return result


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def torch_holder(device: DeviceInfo, hook_env: dict[str, str], tmp_path: Path) -> Iterator[int]:
    """A child process holding ~1 GiB on ``device`` through torch; killed afterwards whatever happened."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", TORCH_HOLDER, str(HOLD_MIB), str(ready)],
                            env={**hook_env, "CUDA_VISIBLE_DEVICES": device.uuid})
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, f"the torch holder exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the torch holder did not allocate in time"
            time.sleep(0.05)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


def test_status_shows_the_gpu(device: DeviceInfo, hook_env: dict[str, str]) -> None:
    table = gpuclean("status", "--devices", device.uuid, env=hook_env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("gpuclean status: nvml devices, driver ")
    assert f"{device.label}" in table.stdout and device.uuid in table.stdout and device.name in table.stdout

    as_json = gpuclean("status", "--json", "--devices", device.uuid, env=hook_env)
    assert as_json.returncode == 0, as_json.stderr
    [entry] = json.loads(as_json.stdout)["devices"]
    assert (entry["index"], entry["uuid"], entry["name"]) == (device.index, device.uuid, device.name)
    assert entry["total_mib"] > 0 and 0 <= entry["used_mib"] <= entry["total_mib"]


def test_check_on_an_idle_gpu_is_0(device: DeviceInfo, hook_env: dict[str, str]) -> None:
    # The gate a job-started hook runs; waits out what earlier tests may still be releasing.
    result = gpuclean("check", "--devices", device.uuid, "--wait", "120", env=hook_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("gpuclean check: clean (1 device(s), tolerance 0 MiB, after ")
    assert f"  {device.label} {device.name} ({device.uuid}): " in result.stdout
    assert result.stderr == ""


def test_check_and_reap_a_torch_holder(device: DeviceInfo, hook_env: dict[str, str], torch_holder: int
                                       ) -> None:
    # (The holder was started by the fixture; first check that nothing else is on the GPU.)
    listed = gpuclean("status", "--json", "--devices", device.uuid, env=hook_env)
    [entry] = json.loads(listed.stdout)["devices"]
    others = [p["pid"] for p in entry["processes"] if p["pid"] != torch_holder]
    if others:
        pytest.skip(f"{device.label} is in use by other processes {others}: not an idle GPU")
    [mine] = [p for p in entry["processes"] if p["pid"] == torch_holder]
    # The driver's figure includes the CUDA context, so it is above what torch allocated.
    assert mine["used_mib"] is None or mine["used_mib"] >= HOLD_MIB

    busy = gpuclean("check", "--devices", device.uuid, env=hook_env)
    assert busy.returncode == 1, busy.stderr
    assert f"  pid {torch_holder} (user " in busy.stdout and f"is on {device.label} " in busy.stdout

    # A tolerance above what the holder uses: still not clean, and the output says why.
    tolerant = gpuclean("check", "--json", "--tolerance-mib", str(4 * HOLD_MIB), "--devices", device.uuid,
                        env=hook_env)
    assert tolerant.returncode == 1, tolerant.stderr
    verdict = json.loads(tolerant.stdout)
    assert (verdict["clean"], verdict["tolerance_mib"]) == (False, 4 * HOLD_MIB)
    assert [o["process"]["pid"] for o in verdict["offenders"]] == [torch_holder]
    assert verdict["notes"][0] == (f"1 process on {device.label}; processes fail the check whatever the "
                                   "tolerance")

    dry = gpuclean("reap", "--dry-run", "--devices", device.uuid, env=hook_env)
    assert dry.returncode == 0, dry.stderr
    assert "gpuclean reap: --dry-run: would end 1 process(es):" in dry.stdout
    assert f"  pid {torch_holder} (user " in dry.stdout and ", found as gpu): held " in dry.stdout
    assert not gone(torch_holder, 0.5)

    reaped = gpuclean("reap", "--devices", device.uuid, "--grace", "10", env=hook_env)
    assert reaped.returncode == 0, reaped.stderr
    assert "gpuclean reap: ended 1 process(es) (SIGTERM, SIGKILL after 10s):" in reaped.stdout
    assert f"  pid {torch_holder} ended by SIGTERM after " in reaped.stdout
    assert "gpuclean reap: the driver released their GPU memory " in reaped.stdout
    assert gone(torch_holder, 30)

    idle = gpuclean("check", "--devices", device.uuid, "--wait", "60", env=hook_env)
    assert idle.returncode == 0, idle.stdout + idle.stderr
    assert idle.stdout.startswith("gpuclean check: clean (1 device(s), tolerance 0 MiB")
