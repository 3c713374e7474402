"""The signal gate on a real GPU: ``gpuclean reap --cookie`` run as root never reaches another user's CUDA
process, neither as a process the driver lists nor through the ``runuser`` that started it and carries the
job's cookie; with ``--all-users`` it ends both and the driver lets the memory go.

Skipped without NVML (tests/conftest.py), where this does not run as root, where a second unix user cannot be
made (``useradd``) or cannot run this interpreter with torch on the GPU. Outputs are printed (run with
``-s``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_helpers import TORCH_HOLDER, alive, first_whole_gpu

from pytest_gpuclean._model.records import DeviceInfo

VICTIM = "gpuclean-victim"
HOLD_MIB = 512


@pytest.fixture(scope="module")
def device() -> DeviceInfo:
    return first_whole_gpu()


@pytest.fixture(scope="module")
def victim() -> pwd.struct_passwd:
    """A second unix user that may run this interpreter with torch on the GPU (created where missing)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the other user's process is started through runuser")
    for tool in ("useradd", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} on this machine")
    with (Path(tempfile.gettempdir()) / "gpuclean-tests-victim-user.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            user = pwd.getpwnam(VICTIM)
        except KeyError:
            made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                                   VICTIM], capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"useradd {VICTIM} failed: {made.stderr.strip()}")
            user = pwd.getpwnam(VICTIM)
    probe = subprocess.run(["runuser", "-u", VICTIM, "--", sys.executable, "-c",
                            "import torch; assert torch.cuda.is_available()"], cwd="/", capture_output=True,
                           text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"user {VICTIM} cannot use torch on the GPU with {sys.executable}: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return user


def gpuclean(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True,
                            text=True, timeout=300, env=env)
    print(f"$ gpuclean {' '.join(args)}  -> exit {result.returncode}\n{result.stdout}{result.stderr}")
    return result


@pytest.fixture
def relayed_holder(device: DeviceInfo, victim: pwd.struct_passwd
                   ) -> Iterator[tuple[int, int, dict[str, str]]]:
    """``runuser`` (root's, carrying the job's cookie) and the other user's torch process it started, holding
    memory on ``device``: (runuser's pid, the holder's, the hook's environment); both killed afterwards."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPUCLEAN_") and k != "CUDA_VISIBLE_DEVICES"}
    folder = Path(tempfile.mkdtemp(prefix="gpuclean-victim-"))
    folder.chmod(0o777)
    ready = folder / "ready"
    relay = subprocess.Popen(["runuser", "-u", victim.pw_name, "--", sys.executable, "-c", TORCH_HOLDER,
                              str(HOLD_MIB), str(ready)], cwd="/", start_new_session=True,
                             env={**env, "CUDA_VISIBLE_DEVICES": device.uuid, "GPUCLEAN_TEST": "gpujob:job"})
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert relay.poll() is None, f"runuser exited with {relay.returncode}"
            assert time.monotonic() < deadline, "the other user's holder did not allocate in time"
            time.sleep(0.05)
        holder = next(int(pid) for pid in os.listdir("/proc") if pid.isdigit()
                      and _ppid(int(pid)) == relay.pid)
        yield relay.pid, holder, env
    finally:
        started = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == relay.pid]
        for pid in [relay.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        relay.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_reap_as_root_never_reaches_another_users_gpu_process(
        device: DeviceInfo, relayed_holder: tuple[int, int, dict[str, str]]) -> None:
    relay, holder, env = relayed_holder
    result = gpuclean("reap", "--cookie", "gpujob:", "--devices", device.uuid, "--grace", "2", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "gpuclean reap: nothing to end" in lines
    [relay_line] = [line for line in lines if line.startswith(f"  left alone: pid {relay} of user root ")]
    assert f"relayed to pid {holder} of user {VICTIM}" in relay_line
    # The holder: listed on the GPU by the driver, and carrying the cookie; another user's either way.
    assert f"  left alone: pid {holder} of user {VICTIM} " in result.stdout
    assert alive(relay) and alive(holder)
    status = gpuclean("status", "--devices", device.uuid, env=env)
    assert f" {holder} " in status.stdout  # still on the GPU

    # Root may opt in: both end, and the driver lets the memory go.
    result = gpuclean("reap", "--cookie", "gpujob:", "--all-users", "--devices", device.uuid, "--grace", "2",
                      env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    deadline = time.monotonic() + 30
    while (alive(relay) or alive(holder)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(relay) and not alive(holder)
    assert "the driver released their GPU memory" in result.stdout
