"""The ``gpuclean`` command: status, check and reap as runner hooks, against simulated devices
with real holder processes, run as a subprocess the way a runner hook runs it."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import alive, clean_environment, read_pids, unprivileged, wait_dead

from pytest_gpuclean import _cli, simulate
from pytest_gpuclean._model.records import MIB, DeviceInfo, DeviceSnapshot, GpuProcess
from pytest_gpuclean._reading import procfs
from pytest_gpuclean._reading.simulated import simulated_uuid
from pytest_gpuclean._version import __version__

HOLD = [sys.executable, "-m", "pytest_gpuclean.simulate", "hold"]
ME = pwd.getpwuid(os.getuid()).pw_name


def gpuclean(*args: str, env: dict[str, str] | None = None, timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    """Run the command as a runner hook would: a separate process, output captured."""
    return subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in list(os.environ):
        if name.startswith("GPUCLEAN_") and name != "GPUCLEAN_TEST":
            monkeypatch.delenv(name)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start processes for a test and make sure every one of them is gone afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        return proc  # type: ignore[no-any-return]

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture
def holder(sim: Path, tmp_path: Path, spawn: Callable[..., subprocess.Popen[bytes]]
           ) -> Callable[..., int]:
    """Start a simulated GPU holder (a real process); returns its pid once it holds memory."""
    counter = iter(range(1000))

    def start(*extra: str, device: int = 0, mib: float = 256, env: dict[str, str] | None = None) -> int:
        pidfile = tmp_path / f"holder-{next(counter)}.pid"
        spawn([*HOLD, "--dir", str(sim), "--device", str(device), "--mib", str(mib), "--pidfile",
               str(pidfile), *extra], env=env)
        return read_pids(pidfile)[0]

    return start


# ---- status ------------------------------------------------------------------------------------------

def test_status_table_shows_each_gpu_and_its_processes(sim: Path, holder: Callable[..., int]) -> None:
    on_0 = holder(device=0, mib=256)
    on_1 = holder(device=1, mib=512)
    result = gpuclean("status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "gpuclean status: simulated devices, driver simulated; 2 of 2 device(s) (all devices)"
    gpu0 = next(i for i, line in enumerate(lines) if line.startswith("GPU 0 "))
    gpu1 = next(i for i, line in enumerate(lines) if line.startswith("GPU 1 "))
    assert simulated_uuid(sim, 0) in lines[gpu0] and "256 / 81920 MiB used  1 process(es)" in lines[gpu0]
    assert simulated_uuid(sim, 1) in lines[gpu1] and "512 / 81920 MiB used  1 process(es)" in lines[gpu1]
    row0 = lines[gpu0 + 2].split()
    assert row0[:3] == [str(on_0), ME, "256"]
    assert "pytest_gpuclean.simulate hold" in lines[gpu0 + 2] and "--device 0" in lines[gpu0 + 2]
    assert lines[gpu1 + 2].split()[:3] == [str(on_1), ME, "512"]


def test_status_json_is_machine_readable(sim: Path, holder: Callable[..., int]) -> None:
    pid = holder(device=1, mib=300)
    result = gpuclean("status", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["backend"] == "simulated" and document["device_source"] == "all devices"
    gpu0, gpu1 = document["devices"]
    assert (gpu0["index"], gpu0["uuid"], gpu0["used_bytes"], gpu0["processes"]) == (
        0, simulated_uuid(sim, 0), 0, [])
    assert gpu1["total_mib"] == 81920 and gpu1["used_mib"] == 300
    [proc] = gpu1["processes"]
    assert (proc["pid"], proc["user"], proc["uid"], proc["used_mib"]) == (pid, ME, os.getuid(), 300)
    assert "pytest_gpuclean.simulate hold" in proc["cmdline"]


def test_cuda_visible_devices_limits_the_default_devices(sim: Path, holder: Callable[..., int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A runner pinned to GPU 1 (CUDA_VISIBLE_DEVICES in its environment) must not judge GPU 0.
    holder(device=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    result = gpuclean("status")
    assert "1 of 2 device(s) (from CUDA_VISIBLE_DEVICES='1')" in result.stdout
    assert not any(line.startswith("GPU 0") for line in result.stdout.splitlines())
    assert gpuclean("check").returncode == 0
    assert gpuclean("check", "--devices", "0").returncode == 1


# ---- check -------------------------------------------------------------------------------------------

def test_check_is_0_when_clean_and_1_with_a_process_on_a_gpu(sim: Path, holder: Callable[..., int]) -> None:
    clean = gpuclean("check")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.startswith("gpuclean check: clean (2 device(s), tolerance 0 MiB)")

    pid = holder(device=1, mib=64)
    dirty = gpuclean("check")
    assert dirty.returncode == 1
    heading, offender, hint = dirty.stdout.splitlines()[:3]
    assert heading == "gpuclean check: NOT clean (tolerance 0 MiB):"
    assert offender.startswith(f"  pid {pid} (user {ME}, sleeping) is on GPU 1 64 MiB: {' '.join(HOLD)} "
                               f"--dir {sim} --device 1 --mib 64")
    assert hint == f"  `gpuclean reap` would end the processes of this user: pid(s) {pid}"
    # Tolerance is for memory nobody accounts for; a process on the device is never "within tolerance",
    # and the output says so rather than leave "NOT clean (tolerance 1024 MiB)" unexplained.
    tolerant = gpuclean("check", "--tolerance-mib", "1024")
    assert tolerant.returncode == 1
    assert tolerant.stdout.splitlines()[:2] == [
        "gpuclean check: NOT clean (tolerance 1024 MiB):",
        "  1 process on GPU 1; processes fail the check whatever the tolerance"]
    assert "whatever the tolerance" not in dirty.stdout  # tolerance 0: nothing to explain
    assert gpuclean("check", "--devices", "0").returncode == 0
    assert gpuclean("check", "--devices", simulated_uuid(sim, 0)[:12]).returncode == 0


def test_check_json_gives_the_verdict_in_the_status_document(sim: Path, holder: Callable[..., int]) -> None:
    clean = gpuclean("check", "--json")
    assert clean.returncode == 0, clean.stderr
    document = json.loads(clean.stdout)
    status = json.loads(gpuclean("status", "--json").stdout)
    assert {k: v for k, v in document.items() if k in status} == status  # the same document, extended
    assert (document["clean"], document["tolerance_mib"], document["offenders"], document["notes"]) == (
        True, 0, [], [])

    pid = holder(device=1, mib=64)
    dirty = gpuclean("check", "--json", "--tolerance-mib", "512")
    assert dirty.returncode == 1, dirty.stderr
    document = json.loads(dirty.stdout)
    assert document["clean"] is False and document["tolerance_mib"] == 512
    [offender] = document["offenders"]
    assert (offender["reason"], offender["found_by"], offender["process"]["pid"], offender["process"]["user"],
            offender["mib_per_device"]) == ("foreign", "gpu", pid, ME, [{"device": "GPU 1", "mib": 64.0}])
    assert document["notes"] == ["1 process on GPU 1; processes fail the check whatever the tolerance"]
    [listed] = document["devices"][1]["processes"]
    assert (listed["pid"], listed["user"], listed["used_mib"]) == (pid, ME, 64)


@pytest.mark.parametrize(("name", "content"), [
    ("0/total", "abc"), ("1/context_overhead", "xyz"), ("0/{pid}", "lots"), ("1/{pid}", "-536870912")])
@pytest.mark.parametrize("command", ["status", "check", "reap"])
def test_a_corrupt_simulated_device_file_is_an_error_naming_it(sim: Path, name: str, content: str,
                                                               command: str) -> None:
    # {pid}: this process, alive and older than the file, so the simulated driver would count it.
    path = sim / name.format(pid=os.getpid())
    path.write_text(content + "\n")
    result = gpuclean(command)
    assert result.returncode == 2, result.stdout + result.stderr  # 1 would say "not clean"
    assert result.stderr == (f"gpuclean {command}: error: --simulate: simulated device file {str(path)!r} "
                             f"holds {content!r}, not a number of bytes (a whole number >= 0) (from "
                             "environment variable GPUCLEAN_SIMULATE)\n")
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["status", "check", "reap"])
@pytest.mark.parametrize("closed", ["directory", "device"])
def test_a_simulated_directory_the_user_may_not_read_is_one_line(public_tmp: Path, command: str,
                                                                 closed: str) -> None:
    # As an unprivileged user: the devices' directory (another user's, mode 700: it may look at it but not
    # list it) was a traceback; a device folder of mode 000 was one line from check but not from status.
    sim = public_tmp / "sim"
    simulate.init(str(sim), 2, 1024)
    (sim / "1").chmod(0)
    if closed == "directory":
        sim.chmod(0o700)
    result = subprocess.run(unprivileged([sys.executable, "-m", "pytest_gpuclean", command, "--simulate",
                                          str(sim)]),
                            cwd=public_tmp, env=clean_environment(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    why = (f"simulated device directory '{sim}' cannot be read: Permission denied" if closed == "directory"
           else f"simulated GPU 1 ({sim}/1) unreadable: [Errno 13] Permission denied: '{sim}/1'")
    assert result.stderr == f"gpuclean {command}: error: --simulate: {why} (from the command line)\n"
    assert result.stdout == ""


def test_check_waits_for_the_gpus_to_become_clean(sim: Path, holder: Callable[..., int]) -> None:
    holder("--seconds", "1", device=0)
    result = gpuclean("check", "--wait", "60")
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("gpuclean check: clean (2 device(s), tolerance 0 MiB, after ")

    stays = holder(device=0)
    result = gpuclean("check", "--wait", "0.3")
    assert result.returncode == 1
    assert result.stdout.startswith("gpuclean check: NOT clean after waiting ")
    assert f"pid {stays} " in result.stdout


@pytest.mark.parametrize(("args", "env", "named"), [
    (["check", "--tolerance-mib", "lots"], {},
     "gpuclean check: error: --tolerance-mib: 'lots' is not a whole number (from the command line)"),
    (["check", "--wait", "-1"], {}, "argument --wait: '-1' is not a number of seconds >= 0"),
    (["check", "--simulate", "/nonexistent/gpus"], {},
     "--simulate: '/nonexistent/gpus' is not an existing directory (from the command line)"),
    (["check", "--devices", "7"], {},
     "--devices: device 7 does not exist (2 device(s) found) (from the command line)"),
    (["status", "--devices", "GPU-ffff"], {}, "--devices: no device has a UUID starting with 'GPU-ffff'"),
    (["status", "--devices", ""], {},
     "gpuclean status: error: --devices: '' names no device (from the command line)"),
    (["check", "--devices", " , "], {}, "--devices: ' , ' names no device (from the command line)"),
    (["reap", "--grace", "soon"], {}, "--grace: 'soon' is not a number of seconds (from the command line)"),
    (["reap", "--cookie", ""], {}, "--cookie: the value is empty"),
    (["check"], {"GPUCLEAN_TOLERANCE_MIB": "-5"},
     "--tolerance-mib: '-5' is negative; expected a whole number >= 0 (from environment variable "
     "GPUCLEAN_TOLERANCE_MIB)"),
    (["reap"], {"GPUCLEAN_GRACE": "inf"},
     "--grace: 'inf' is not a number of seconds >= 0 (from environment variable GPUCLEAN_GRACE)"),
    (["status"], {"GPUCLEAN_SIMULATE": "/nonexistent/gpus"},
     "--simulate: '/nonexistent/gpus' is not an existing directory (from environment variable "
     "GPUCLEAN_SIMULATE)"),
    (["check"], {"CUDA_VISIBLE_DEVICES": "3"}, "(from environment variable CUDA_VISIBLE_DEVICES='3'"),
    (["frobnicate"], {}, "argument COMMAND: invalid choice: 'frobnicate'"),
])
def test_usage_errors_exit_2_and_name_the_option(sim: Path, args: list[str], env: dict[str, str],
                                                  named: str) -> None:
    result = gpuclean(*args, env={**os.environ, **env})
    assert result.returncode == 2
    assert named in result.stderr
    assert result.stdout == ""


def test_no_devices_to_check_is_an_error(sim: Path) -> None:
    result = gpuclean("check", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert "gpuclean check: error: no devices to check" in result.stderr


def test_driver_failure_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine: nothing fails")
    except pynvml.NVMLError:
        pass
    for command in ("status", "check", "reap"):
        result = gpuclean(command)
        assert result.returncode == 2
        assert result.stderr.startswith(f"gpuclean {command}: error: NVML init failed")


# ---- reap --------------------------------------------------------------------------------------------

def test_reap_ends_this_users_gpu_processes_and_cookie_carriers_only(
        sim: Path, holder: Callable[..., int], spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    stubborn = holder("--ignore-sigterm", device=0, mib=128)
    on_other_device = holder(device=1)
    ours = spawn(["sleep", "600"], env={**os.environ, "GPUCLEAN_TEST": "job-42:step-3"})
    not_ours = spawn(["sleep", "600"], env={**os.environ, "GPUCLEAN_TEST": "job-421:step-1"})
    no_cookie = spawn(["sleep", "600"])
    result = gpuclean("reap", "--devices", "0", "--cookie", "job-42:", "--grace", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"  pid {stubborn} ended by SIGKILL after " in out
    assert "(found as gpu): held GPU 0 128 MiB; the driver released it " in out
    assert f"  pid {ours.pid} ended by SIGTERM after " in out
    assert "(found as cookie): held no GPU memory" in out
    assert "gpuclean reap: the driver released their GPU memory " in out
    assert "  now: GPU 0 Simulated GPU" in out and "0/81920 MiB used" in out
    assert wait_dead([stubborn, ours.pid]) == []
    assert alive(on_other_device) and alive(not_ours.pid) and alive(no_cookie.pid)


def test_on_real_gpus_reap_targets_only_processes_with_a_gpu_device_open(
        spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    # In a container the driver can list a host pid that names an unrelated local process.
    innocent = spawn(["sleep", "600"])
    device = DeviceInfo(index=0, uuid="GPU-test", name="test GPU")
    snaps = [DeviceSnapshot(device, 1024 * MIB, 80 * 1024 * MIB, (GpuProcess(innocent.pid, 1024 * MIB),))]
    assert not procfs.has_nvidia_device_open(innocent.pid)
    targets, left_alone = _cli.plan_reap(snaps, my_uid=os.getuid(), never_touch=set(), all_users=False,
                                        cookie=None, require_device_file=True)
    assert targets == {}
    [why] = left_alone
    # (Right after exec the command line may still read as '[sleep]'.)
    assert why.startswith(f"pid {innocent.pid} (listed on GPU 0) is ") and "sleep" in why
    assert why.endswith("here, which has no /dev/nvidia* open: not the driver's process (another PID "
                        "namespace?)")
    # Simulated devices have no device files: there the driver's list is the truth.
    targets, _ = _cli.plan_reap(snaps, my_uid=os.getuid(), never_touch=set(), all_users=False, cookie=None)
    assert list(targets) == [innocent.pid] and targets[innocent.pid].found_by == "gpu"


def test_reap_dry_run_ends_nothing(sim: Path, holder: Callable[..., int]) -> None:
    pids = [holder(device=0, mib=100), holder(device=1, mib=200)]
    result = gpuclean("reap", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "gpuclean reap: --dry-run: would end 2 process(es):" in result.stdout
    assert f"  pid {pids[0]} (user {ME}, found as gpu): held GPU 0 100 MiB" in result.stdout
    assert f"  pid {pids[1]} (user {ME}, found as gpu): held GPU 1 200 MiB" in result.stdout
    assert all(alive(p) for p in pids)
    assert gpuclean("check").returncode == 1


def test_reap_json_accounts_for_what_it_ended(
        sim: Path, holder: Callable[..., int], spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    # A runner's job-completed hook reads what the reap ended, as it reads check --json.
    stubborn = holder("--ignore-sigterm", device=0, mib=128)
    ours = spawn(["sleep", "600"], env={**os.environ, "GPUCLEAN_TEST": "job-42:step-3"})
    result = gpuclean("reap", "--json", "--cookie", "job-42:", "--grace", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)  # the document alone: no text around it
    status = json.loads(gpuclean("status", "--json").stdout)
    assert {k: document[k] for k in status} == status  # the devices as they are now: clean
    assert (document["cookie"], document["dry_run"], document["survived"]) == ("job-42:", False, [])
    assert [(t["process"]["pid"], t["found_by"]) for t in document["targets"]] == sorted(
        [(stubborn, "gpu"), (ours.pid, "cookie")])
    ended = {r["process"]["pid"]: r for r in document["reaped"]}
    assert (ended[stubborn]["ended_by"], ended[ours.pid]["ended_by"]) == ("SIGKILL", "SIGTERM")
    assert ended[stubborn]["mib_per_device"] == [{"device": "GPU 0", "mib": 128.0}]
    assert ended[stubborn]["release_s"] is not None and document["release_s"] is not None
    assert wait_dead([stubborn, ours.pid]) == []


def test_reap_json_dry_run_lists_what_it_would_end(sim: Path, holder: Callable[..., int]) -> None:
    pid = holder(device=1, mib=200)
    result = gpuclean("reap", "--json", "--dry-run")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["dry_run"] is True and document["reaped"] == [] and document["release_s"] is None
    [target] = document["targets"]
    assert (target["process"]["pid"], target["process"]["user"], target["found_by"],
            target["mib_per_device"]) == (pid, ME, "gpu", [{"device": "GPU 1", "mib": 200.0}])
    assert [p["pid"] for p in document["devices"][1]["processes"]] == [pid]  # as read: still there
    assert alive(pid)
    nothing = json.loads(gpuclean("reap", "--json", "--devices", "0").stdout)
    assert (nothing["targets"], nothing["reaped"], nothing["left_alone"]) == ([], [], [])


@pytest.mark.parametrize("as_json", [False, True])
def test_reap_with_a_lost_gpu_ends_what_is_provably_the_jobs_and_says_which_gpu(
        sim: Path, holder: Callable[..., int], spawn: Callable[..., subprocess.Popen[bytes]],
        as_json: bool) -> None:
    # The post-job hook on a runner whose GPU 0 fell off the bus: the job's processes carry its cookie (one
    # holds GPU 0, one GPU 1, one no GPU), and this user has a process on GPU 1 without it. Ownership needs
    # no reading of GPU 0: all four are ended. It used to print "GPU 0 ... is lost", exit 2, and end none.
    job = {**os.environ, "GPUCLEAN_TEST": "job42:step"}
    on_lost = holder(device=0, mib=64, env=job)
    on_other = holder(device=1, mib=128, env=job)
    mine = holder(device=1, mib=32)
    sleeper = spawn(["sleep", "600"], env=job).pid
    simulate.set_state(str(sim), 0, "lost", "fell off the bus")
    result = gpuclean("reap", "--cookie", "job42:", "--grace", "1", *(["--json"] if as_json else []))
    assert result.returncode == 3, result.stdout + result.stderr  # a GPU could not be read: see the lines
    assert wait_dead([on_lost, on_other, mine, sleeper]) == []
    gpu0 = DeviceInfo(0, simulated_uuid(sim, 0), "Simulated GPU")
    if as_json:
        document = json.loads(result.stdout)
        assert document["unreadable"] == [{"device": "GPU 0", "uuid": gpu0.uuid, "lost": True,
                                           "error": "lost: fell off the bus"}]
        ended = sorted((r["process"]["pid"], r["found_by"], r["ended_by"]) for r in document["reaped"])
        assert ended == sorted([(on_lost, "cookie", "SIGTERM"), (on_other, "gpu", "SIGTERM"),
                                (mine, "gpu", "SIGTERM"), (sleeper, "cookie", "SIGTERM")])
        assert [d["index"] for d in document["devices"]] == [1]  # as read: GPU 1 alone
        assert [h["lost"] for h in document["health"]] == [True, False]
        return
    lines = result.stdout.splitlines()
    assert "gpuclean reap: ended 4 process(es) (SIGTERM, SIGKILL after 1s):" in lines
    assert f"  pid {on_lost} ended by SIGTERM" in result.stdout
    assert lines[-2:] == [
        f"gpuclean reap: could not read GPU 0 ({gpu0.uuid}): lost: fell off the bus",
        "gpuclean reap: a process on GPU 0 was ended only if it carries the cookie 'job42:'; a GPU that "
        "cannot be read is no GPU for the next job: exit 3, take this runner out of service (gpuclean never "
        "resets a GPU)"]
    assert result.stderr == ""


def test_reap_json_is_refused_with_ray_rather_than_answered_in_text(sim: Path) -> None:
    result = gpuclean("reap", "--json", "--ray", "127.0.0.1:1")
    assert result.returncode == _cli.EXIT_ERROR
    assert result.stderr == ("gpuclean reap: error: --json is not available with --ray 127.0.0.1:1 (from the "
                             "command line) yet; use the text output\n")
    assert result.stdout == ""


def test_reap_with_nothing_to_do(sim: Path) -> None:
    result = gpuclean("reap")
    assert result.returncode == 0
    assert result.stdout.splitlines()[-1] == "gpuclean reap: nothing to end"


def test_reap_never_ends_itself_or_its_ancestors(sim: Path) -> None:
    # The hook's own shell carries the job's cookie (it was started inside the job): it must survive.
    script = f"{sys.executable} -m pytest_gpuclean reap --cookie job-7 --grace 1; echo \"shell survived $?\""
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "GPUCLEAN_TEST": "job-7:hook"})
    assert "shell survived 0" in result.stdout, result.stdout + result.stderr
    assert "carries the cookie, but is gpuclean itself or one of its ancestors" in result.stdout
    assert "nothing to end" in result.stdout


@pytest.fixture
def other_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    name = "gpuclean-other"
    try:
        return pwd.getpwnam(name)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("no useradd to create a second user")
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        return pwd.getpwnam(name)


def test_reap_never_ends_another_users_process(sim: Path, holder: Callable[..., int],
                                               spawn: Callable[..., subprocess.Popen[bytes]],
                                               other_user: pwd.struct_passwd) -> None:
    mine = holder(device=0)
    # The other user only needs to exist as a process; its allocation is recorded on its behalf.
    theirs = spawn(["sleep", "600"], user=other_user.pw_uid, group=other_user.pw_gid, cwd="/",
                   env={**os.environ, "GPUCLEAN_TEST": "job-42:other"})
    simulate.allocate(str(sim), 0, 64, pid=theirs.pid)
    result = gpuclean("reap", "--cookie", "job-42", "--grace", "1")
    assert result.returncode == 0, result.stderr
    assert (f"  left alone: pid {theirs.pid} of user {other_user.pw_name} (sleep 600): another user's "
            "process (only root, with --all-users, ends those)") in result.stdout
    assert wait_dead([mine]) == []
    assert alive(theirs.pid)
    assert f"pid {theirs.pid} 64 MiB" in result.stdout  # still listed on the device afterwards

    # Root may opt in, explicitly.
    result = gpuclean("reap", "--all-users", "--grace", "1")
    assert result.returncode == 0, result.stderr
    assert f"  pid {theirs.pid} ended by SIGTERM" in result.stdout
    assert wait_dead([theirs.pid]) == []


def test_all_users_is_refused_to_non_root(sim: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # In-process, so it runs as "non-root" here too; the command line would exit with this status.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _cli.main(["reap", "--all-users", "--simulate", str(sim)]) == 2
    assert capsys.readouterr().err == ("gpuclean reap: error: --all-users: only root may end other users' "
                                       "processes\n")


def test_console_script_is_the_same_command(sim: Path) -> None:
    script = Path(sys.executable).with_name("gpuclean")
    if not script.exists():
        pytest.skip("the gpuclean script is not installed next to this interpreter")
    result = subprocess.run([str(script), "check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert result.stdout.startswith("gpuclean check: clean")
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == f"gpuclean {__version__}"
