"""CUDA_VISIBLE_DEVICES mapping: device lists of indices, UUIDs, prefixes and MIG UUIDs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import run_inner

from pytest_gpuclean._model.records import MIB, DeviceInfo, Selection
from pytest_gpuclean._reading import procfs
from pytest_gpuclean._reading.backends import choose_devices, select_devices
from pytest_gpuclean._reading.devices import (
    BackendUnavailable,
    DeviceError,
    DeviceLost,
    DeviceSelectionError,
    SimulationError,
)
from pytest_gpuclean._reading.nvml import NvmlBackend, NvmlOpening
from pytest_gpuclean._reading.simulated import SimulatedBackend, simulated_uuid
from pytest_gpuclean._reading.simulated_layout import DEFAULT_TOTAL
from pytest_gpuclean._settings import parse_device_list, repeated_tokens
from pytest_gpuclean.simulate import allocate

GPU0 = DeviceInfo(0, "GPU-1a2b3c4d-0000-4000-8000-000000000000", "H200")
GPU1 = DeviceInfo(1, "GPU-1a2b9999-1111-4000-8000-000000000001", "H200")
GPU2 = DeviceInfo(2, "GPU-77777777-2222-4000-8000-000000000002", "H200")
MIG_A = DeviceInfo(3, "MIG-5e5e5e5e-aaaa-5000-8000-00000000000a", "A100", mig_index=0)
MIG_B = DeviceInfo(3, "MIG-6f6f6f6f-bbbb-5000-8000-00000000000b", "A100", mig_index=1)
ALL = (GPU0, GPU1, GPU2, MIG_A, MIG_B)


@pytest.mark.parametrize(("spec", "tokens"), [
    ("0,1", ["0", "1"]),
    (" 0 , 2 ", ["0", "2"]),
    ("", []),
    (",,1,", ["1"]),
    ("1,-1,0", ["1"]),  # CUDA stops at a negative index
    ("-1", []),
    ("GPU-1a2b3c4d,MIG-5e5e", ["GPU-1a2b3c4d", "MIG-5e5e"]),
])
def test_parse_device_list(spec: str, tokens: list[str]) -> None:
    assert parse_device_list(spec) == tokens


def test_cuda_ordinals_are_positions_among_the_devices() -> None:
    gpus = (GPU0, GPU1, GPU2)
    assert select_devices(gpus, "2,0", cuda_ordinals=True) == (GPU2, GPU0)
    assert select_devices(gpus, "1,1", cuda_ordinals=True) == (GPU1,)  # listed twice, one device


def test_an_explicit_list_naming_one_device_twice_is_an_error() -> None:
    # An index and the same GPU's UUID (prefix): only the devices can tell; CUDA_VISIBLE_DEVICES is the
    # environment's and keeps one device (above).
    with pytest.raises(DeviceSelectionError, match="^" + re.escape(
            f"'0' and 'GPU-1a2b3c' name the same device (GPU 0, {GPU0.uuid}); list each device once") + "$"):
        select_devices(ALL, "0,GPU-1a2b3c", cuda_ordinals=False)
    assert select_devices(ALL, "0,GPU-1a2b3c", cuda_ordinals=True) == (GPU0,)


@pytest.mark.parametrize(("tokens", "repeated"), [
    (["0", "1", "00"], ("0", "00")),
    (["GPU-1a2b", "1", "gpu-1A2B3C"], ("GPU-1a2b", "gpu-1A2B3C")),
    (["gpu-1a2b3c", "GPU-1A2B"], ("gpu-1a2b3c", "GPU-1A2B")),
    (["0", "GPU-1a2b3c"], None),  # an index and a UUID: the devices decide
    (["0", "1", "GPU-1a2b3c", "GPU-1a2b9", "MIG-5e"], None),
])
def test_repeated_tokens_need_no_devices(tokens: list[str], repeated: tuple[str, str] | None) -> None:
    assert repeated_tokens(tokens) == repeated


def test_cuda_ordinals_follow_cudas_own_order_when_given() -> None:
    # CUDA's "fastest first" order can differ from NVML's PCI order: ordinal 0 is then NVML's GPU 2.
    order = [GPU2.uuid, GPU0.uuid, GPU1.uuid]
    assert select_devices((GPU0, GPU1, GPU2), "0,2", cuda_ordinals=True, ordinal_uuids=order) == (GPU2, GPU1)
    with pytest.raises(DeviceSelectionError, match="device 3 does not exist"):
        select_devices((GPU0, GPU1, GPU2), "3", cuda_ordinals=True, ordinal_uuids=order)


def test_nvml_indices_never_pick_a_mig_instance() -> None:
    assert select_devices(ALL, "2,0", cuda_ordinals=False) == (GPU2, GPU0)
    # Index 3 is a GPU in MIG mode: it is only reachable through its MIG UUIDs.
    with pytest.raises(DeviceSelectionError, match="device 3 does not exist"):
        select_devices(ALL, "3", cuda_ordinals=False)


def test_full_uuids_any_case() -> None:
    assert select_devices(ALL, f"{GPU2.uuid},{GPU0.uuid.upper()}", cuda_ordinals=True) == (GPU2, GPU0)


def test_unique_uuid_prefixes() -> None:
    assert select_devices(ALL, "GPU-1a2b3c", cuda_ordinals=True) == (GPU0,)
    assert select_devices(ALL, "GPU-7", cuda_ordinals=True) == (GPU2,)
    assert select_devices(ALL, "gpu-1A2B9", cuda_ordinals=True) == (GPU1,)


def test_mig_uuids_and_prefixes() -> None:
    assert select_devices(ALL, f"{MIG_B.uuid}", cuda_ordinals=True) == (MIG_B,)
    assert select_devices(ALL, "MIG-5e,GPU-7", cuda_ordinals=True) == (MIG_A, GPU2)


def test_mixed_indices_and_uuids_keep_the_listed_order() -> None:
    spec = f"2,{GPU0.uuid[:12]},1"
    assert select_devices((GPU0, GPU1, GPU2), spec, cuda_ordinals=True) == (GPU2, GPU0, GPU1)


def test_ambiguous_prefix_is_an_error() -> None:
    with pytest.raises(DeviceSelectionError, match=r"UUID prefix 'GPU-1a2b' is ambiguous \(2 devices\)"):
        select_devices(ALL, "GPU-1a2b", cuda_ordinals=True)
    with pytest.raises(DeviceSelectionError, match="ambiguous"):
        select_devices(ALL, "MIG-", cuda_ordinals=True)


@pytest.mark.parametrize(("spec", "message"), [
    ("GPU-deadbeef", "no device has a UUID starting with 'GPU-deadbeef'"),
    ("5", "device 5 does not exist (5 device(s) found)"),
    ("GPU-1a2b3c4d-0000-4000-8000-000000000000-x",
     "no device has a UUID starting with 'GPU-1a2b3c4d-0000-4000-8000-000000000000-x'"),
    ("foo", "no device has a UUID starting with 'foo'"),
])
def test_unknown_device_is_an_error(spec: str, message: str) -> None:
    with pytest.raises(DeviceSelectionError, match="^" + re.escape(message) + "$"):
        select_devices(ALL, spec, cuda_ordinals=True)


def test_list_cut_at_negative_index_ignores_the_rest() -> None:
    # CUDA hides everything after -1, so a bogus entry there is not an error.
    assert select_devices((GPU0, GPU1), "1,-1,GPU-deadbeef", cuda_ordinals=True) == (GPU1,)


def test_simulated_devices_take_uuids_from_their_files(tmp_path: Path) -> None:
    for index in (0, 1):
        (tmp_path / str(index)).mkdir()
    named = "GPU-feedface-0000-4000-8000-000000000001"
    (tmp_path / "1" / "uuid").write_text(named + "\n")
    found = SimulatedBackend(tmp_path).devices()
    assert [d.uuid for d in found] == [simulated_uuid(tmp_path, 0), named]
    # The default UUID is stable for a directory, so concurrent sessions agree on lock names.
    assert simulated_uuid(tmp_path, 0) == simulated_uuid(str(tmp_path) + "/.", 0)
    assert simulated_uuid(tmp_path, 0) != simulated_uuid(tmp_path, 1)


@pytest.mark.parametrize(("name", "content", "shown"), [
    ("total", "abc", "'abc'"), ("context_overhead", "xyz\n", "'xyz'"), ("{pid}", "-512", "'-512'"),
    ("{pid}", "12.5", "'12.5'"), ("cuda/{pid}", "zero", "'zero'")])
def test_a_corrupt_simulated_file_is_refused_when_the_backend_opens(tmp_path: Path, name: str, content: str,
                                                                     shown: str) -> None:
    # {pid}: this process, alive and older than the file: a real driver would count it.
    path = tmp_path / "0" / name.format(pid=os.getpid())
    path.parent.mkdir(parents=True)
    path.write_text(content)
    message = (f"simulated device file {str(path)!r} holds {shown}, not a number of bytes (a whole number "
               ">= 0)")
    with pytest.raises(SimulationError, match="^" + re.escape(message) + "$") as error:
        SimulatedBackend(tmp_path)
    # A failed check's one line names the device first.
    assert error.value.describe() == f"GPU 0 ({simulated_uuid(tmp_path, 0)}): {message}"


def test_a_file_corrupted_later_fails_the_reading_that_meets_it(tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()
    backend = SimulatedBackend(tmp_path)
    (tmp_path / "0" / "total").write_text("")  # being written: the default, not an error
    assert backend.snapshot(backend.devices()[0]).total_bytes == DEFAULT_TOTAL
    (tmp_path / "0" / "total").write_text("1e9")
    with pytest.raises(SimulationError, match="holds '1e9', not a number of bytes"):
        backend.snapshot(backend.devices()[0])


def test_a_simulated_device_whose_folder_is_removed_is_lost_one_that_cannot_be_listed_is_an_error(
        tmp_path: Path) -> None:
    # What the simulated devices make of NVML's errors: GPU_IS_LOST is a folder removed; any other error,
    # a folder that cannot be read (here a file in its place: root reads any folder).
    for index in (0, 1):
        (tmp_path / str(index)).mkdir()
    backend = SimulatedBackend(tmp_path)
    gpu0, gpu1 = backend.devices()
    (tmp_path / "0").rmdir()
    lost = f"GPU 0 ({gpu0.uuid}) is lost: vanished ({tmp_path / '0'} is gone)"
    with pytest.raises(DeviceLost, match=re.escape(lost)):
        backend.snapshot(gpu0)
    (tmp_path / "1").rmdir()
    (tmp_path / "1").write_text("not a folder")
    unreadable = re.escape(f"simulated GPU 1 ({tmp_path / '1'}) unreadable: ")
    with pytest.raises(DeviceError, match=unreadable) as error:
        backend.snapshot(gpu1)
    assert not isinstance(error.value, DeviceLost)


@pytest.mark.parametrize(("code", "lost"), [("NVML_ERROR_GPU_IS_LOST", True), ("NVML_ERROR_UNKNOWN", False),
                                            ("NVML_ERROR_TIMEOUT", False)])
def test_nvml_gpu_is_lost_is_a_lost_device_other_errors_are_read_errors(
        monkeypatch: pytest.MonkeyPatch, code: str, lost: bool) -> None:
    # No driver here: pynvml's calls are replaced, its error classes are the real ones.
    pynvml = pytest.importorskip("pynvml")

    def fails(*args: Any, **kwargs: Any) -> None:
        raise pynvml.NVMLError(getattr(pynvml, code))

    def not_mig(handle: Any) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    for name, value in (("nvmlInit", lambda: None), ("nvmlDeviceGetCount", lambda: 1),
                        ("nvmlDeviceGetHandleByIndex", lambda i: f"handle {i}"),
                        ("nvmlDeviceGetName", lambda h: "NVIDIA H200"),
                        ("nvmlDeviceGetMinorNumber", lambda h: 0),
                        ("nvmlDeviceGetMigMode", not_mig), ("nvmlDeviceGetUUID", lambda h: GPU0.uuid),
                        ("nvmlDeviceGetMemoryInfo", fails)):
        monkeypatch.setattr(pynvml, name, value)
    backend = NvmlBackend(NvmlOpening(thread=False))
    [device] = backend.devices()
    message = f"GPU 0 ({GPU0.uuid}) is lost: NVML: GPU is lost" if lost else (
        f"NVML query of GPU 0 ({GPU0.uuid}) failed: ")
    with pytest.raises(DeviceError, match=re.escape(message)) as error:
        backend.snapshot(device)
    assert isinstance(error.value, DeviceLost) == lost


def test_an_idle_folder_read_by_its_ctime_still_sees_memory_come_and_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An idle simulated device whose folder has not changed for a while is read with a stat, not a
    # listdir (SimulatedBackend._settled, in the checks' ``readings``): a file added or removed must still
    # show at once, and a removed folder is a lost device.
    (tmp_path / "0").mkdir()
    backend = SimulatedBackend(tmp_path)
    devices = backend.devices()  # (one tuple: a test's devices are, from check to check)
    time.sleep(procfs.SETTLED_NS / 1e9 + 0.02)

    def used() -> int:
        [reading] = backend.readings(devices)
        return reading.used_bytes

    assert used() == 0  # (a listdir: the ctime is recorded)
    time.sleep(procfs.SETTLED_NS / 1e9 + 0.02)  # (and seen unchanged that long by the monotonic clock)
    assert used() == 0
    listed: list[str] = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: listed.append(str(path)) or real_listdir(path))
    first = backend.readings(devices)
    assert backend.readings(devices) is first  # unchanged: the last readings, the same tuple
    assert backend.readings((devices[0],)) == first  # (other devices' tuple: the same reading, one stat)
    assert listed == []  # the fast paths are taken
    held = allocate(str(tmp_path), 0, 64)  # this very process "allocates": it is alive
    assert used() == 64 * MIB
    held.unlink()
    assert used() == 0
    time.sleep(procfs.SETTLED_NS / 1e9 + 0.02)
    assert used() == 0 and used() == 0  # settled again, and its readings kept
    (tmp_path / "0").rmdir()
    with pytest.raises(DeviceLost, match="vanished"):
        used()


_REWRITER = """
import os, sys, time
path = os.path.join(sys.argv[1], str(os.getpid()))
with open(path + ".ready", "w"):
    pass
while True:  # as a shell's `echo N > file` does, in a loop: truncated, then written
    with open(path, "w") as f:
        f.write(sys.argv[2])
"""


def test_a_holder_rewriting_its_file_in_place_is_listed_in_every_reading(tmp_path: Path) -> None:
    # Before: a reading that met the file between its truncation and its write took the holder for gone,
    # and a check that read then said clean beside the held memory.
    (tmp_path / "0").mkdir()
    backend = SimulatedBackend(tmp_path)
    devices = backend.devices()
    holder = subprocess.Popen([sys.executable, "-c", _REWRITER, str(tmp_path / "0"), str(64 * MIB)])
    try:
        ready = tmp_path / "0" / f"{holder.pid}.ready"
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        ready.unlink()
        missed = 0
        for _ in range(3000):
            [reading] = backend.readings(devices)
            if holder.pid not in {p.pid for p in reading.processes}:
                missed += 1
        assert missed == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_wall_clock_stepped_forward_does_not_free_a_holders_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A file's time is the wall clock's, a process's start the boot clock's. Before: compared through the
    # offset between the two as it is now, a wall clock set forward (a VM resumed, NTP stepping) made a live
    # holder's file look older than the holder, taken for a dead process's, and its memory free.
    (tmp_path / "0").mkdir()
    backend = SimulatedBackend(tmp_path)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 30.0)  # the step, as this process sees it
    held = allocate(str(tmp_path), 0, 64)  # this very process: it started long before its file
    try:
        [reading] = backend.readings(backend.devices())
        assert reading.used_bytes == 64 * MIB
        # A file provably older than its process (a dead holder's, the pid reused) is still not credited.
        os.utime(held, (real() - 3600, real() - 3600))
        [reading] = backend.readings(backend.devices())
        assert reading.used_bytes == 0 and reading.processes == ()
    finally:
        held.unlink()


def test_a_reading_equal_to_the_last_one_is_that_object(tmp_path: Path) -> None:
    # The session keeps every test's record, and a record keeps its checks' readings: equal readings are
    # one object, whatever the device's state, so that clean tests add no readings of their own.
    (tmp_path / "0").mkdir()
    (tmp_path / "1").mkdir()
    backend = SimulatedBackend(tmp_path)
    held = allocate(str(tmp_path), 1, 64)
    first = backend.readings(backend.devices())
    second = backend.readings(backend.devices())
    assert [r.used_bytes for r in second] == [0, 64 * MIB]
    assert all(a is b for a, b in zip(first, second, strict=True))
    held.write_text(str(65 * MIB))
    third = backend.readings(backend.devices())
    assert third[0] is first[0] and third[1] is not first[1] and third[1].used_bytes == 65 * MIB
    held.unlink()


def test_nvml_readings_share_equal_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    used = [0]

    class Memory:
        total = 1000 * MIB

        @property
        def used(self) -> int:
            return used[0]

    def not_mig(handle: object) -> tuple[int, int]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    for name, value in (("nvmlInit", lambda: None), ("nvmlDeviceGetCount", lambda: 1),
                        ("nvmlDeviceGetHandleByIndex", lambda i: object()),
                        ("nvmlDeviceGetName", lambda h: "GPU"), ("nvmlDeviceGetMinorNumber", lambda h: 0),
                        ("nvmlDeviceGetMigMode", not_mig), ("nvmlDeviceGetUUID", lambda h: GPU0.uuid),
                        ("nvmlDeviceGetMemoryInfo", lambda h, version=None: Memory()),
                        ("nvmlDeviceGetComputeRunningProcesses", lambda h: []),
                        ("nvmlDeviceGetGraphicsRunningProcesses", lambda h: [])):
        monkeypatch.setattr(pynvml, name, value)
    backend = NvmlBackend(NvmlOpening(thread=False))
    devices = backend.devices()
    first, second = backend.readings(devices), backend.readings(devices)
    assert first[0] is second[0] and first[0].used_bytes == 0
    used[0] = 5 * MIB
    third = backend.readings(devices)
    assert third[0] is not first[0] and third[0].used_bytes == 5 * MIB
    assert backend.readings(devices)[0] is third[0]


@pytest.mark.parametrize("thread", [True, False])
def test_nvml_started_in_a_thread_reports_as_if_started_here(monkeypatch: pytest.MonkeyPatch,
                                                           thread: bool) -> None:
    # NvmlOpening runs nvmlInit in a thread of its own (the session's start imports its code meanwhile):
    # what goes wrong there reaches the session as it would have without the thread.
    pynvml = pytest.importorskip("pynvml")

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(BackendUnavailable, match="NVML init failed"):
        NvmlOpening(thread=thread).result()

    def broken() -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    with pytest.raises(RuntimeError, match="something else"):
        NvmlOpening(thread=thread).result()
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"handle {i}")
    assert NvmlOpening(thread=thread).result() == (pynvml, ["handle 0", "handle 1"])


class _Devices:
    kind = "simulated"

    def devices(self) -> tuple[DeviceInfo, ...]:
        return (GPU0, GPU1, GPU2)


def test_choose_devices_takes_an_explicit_list_else_cuda_visible_devices_else_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    backend: Any = _Devices()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert choose_devices(backend, None, "", option="--x") == Selection((GPU0, GPU1, GPU2), "all devices", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert choose_devices(backend, None, "", option="--x") == Selection(
        (GPU2, GPU0), "from CUDA_VISIBLE_DEVICES='2,0'", 3)
    # An explicit list uses NVML indices and wins over CUDA_VISIBLE_DEVICES.
    assert choose_devices(backend, "1", "from the command line", option="--x") == Selection(
        (GPU1,), "from the command line", 3)
    with pytest.raises(DeviceSelectionError, match=re.escape(
            "--x: device 5 does not exist (3 device(s) found) (from environment variable GPUCLEAN_DEVICES)")):
        choose_devices(backend, "5", "from environment variable GPUCLEAN_DEVICES", option="--x")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    with pytest.raises(DeviceSelectionError, match=re.escape(
            "--x: no device has a UUID starting with 'GPU-ffff' (from environment variable "
            "CUDA_VISIBLE_DEVICES='GPU-ffff'; pass --x to choose devices explicitly)")):
        choose_devices(backend, None, "", option="--x")


def test_an_empty_selection_says_why() -> None:
    assert Selection((), "all devices", 0).none_reason("nvml") == "the nvml backend has no devices"
    assert Selection((), "from CUDA_VISIBLE_DEVICES=''", 2).none_reason("simulated") == (
        "none of the 2 simulated device(s) is selected (from CUDA_VISIBLE_DEVICES='')")


# ---- end to end: what an inner session checks, from CUDA_VISIBLE_DEVICES --------------------------

SIM_UUIDS = ("GPU-0c0c0c0c-0000-4000-8000-000000000000", "GPU-1d1d1d1d-1111-4000-8000-000000000001")

@pytest.fixture
def named_sim(sim: Path) -> Path:
    for index, uuid in enumerate(SIM_UUIDS):
        (sim / str(index) / "uuid").write_text(uuid)
    return sim


def test_cuda_visible_devices_prefix_selects_one_device(pytester: pytest.Pytester, named_sim: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1d1d")
    pytester.copy_example("devices/show_devices")  # prints what it sees
    result = run_inner(pytester, "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "gpuclean: simulated devices*checking 1,*",
        f"gpuclean: GPU 1 Simulated GPU ({SIM_UUIDS[1]}): 0/81920 MiB used",
    ])
    out = result.stdout.str()
    assert f"SEEN [(1, '{SIM_UUIDS[1]}')]" in out
    assert f"VISIBLE {SIM_UUIDS[1]}\n" in out  # count=N hands the test full UUIDs, whatever the user wrote
    assert SIM_UUIDS[0] not in out


def test_cuda_visible_devices_indices_and_uuids(pytester: pytest.Pytester, named_sim: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"1,{SIM_UUIDS[0]}")
    pytester.copy_example("devices/show_devices")  # prints what it sees
    result = run_inner(pytester, "-s")
    result.assert_outcomes(passed=2)
    assert f"SEEN [(1, '{SIM_UUIDS[1]}'), (0, '{SIM_UUIDS[0]}')]" in result.stdout.str()


@pytest.mark.parametrize(("visible", "problem"), [
    ("GPU-ffff", "no device has a UUID starting with 'GPU-ffff'"),
    ("GPU-", "UUID prefix 'GPU-' is ambiguous (2 devices)"),
    ("2", "device 2 does not exist (2 device(s) found)"),
])
def test_unknown_cuda_visible_device_is_a_usage_error(pytester: pytest.Pytester, named_sim: Path,
                                                      monkeypatch: pytest.MonkeyPatch, visible: str,
                                                      problem: str) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    pytester.copy_example("devices/show_devices")  # prints what it sees
    result = run_inner(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *{problem}*CUDA_VISIBLE_DEVICES={visible!r}*"])


def test_cuda_device_minors_needs_uvm(monkeypatch: pytest.MonkeyPatch) -> None:
    # What /proc/<pid>/fd shows on a GPU machine (no /dev/nvidia* here): NVML alone opens nvidiactl and
    # the device files; CUDA adds nvidia-uvm. Only the latter counts as a process the driver charges.
    links = {"0": "/dev/null", "3": "/dev/nvidiactl", "4": "/dev/nvidia0", "5": "/dev/nvidia1",
             "6": "socket:[123]"}
    real_listdir, real_readlink = os.listdir, os.readlink
    monkeypatch.setattr(os, "listdir",
                        lambda path: list(links) if path == "/proc/1/fd" else real_listdir(path))
    monkeypatch.setattr(os, "readlink", lambda path: links[path.rsplit("/", 1)[1]]
                        if path.startswith("/proc/1/fd/") else real_readlink(path))
    assert procfs.cuda_device_minors(1) is None  # NVML only
    assert procfs.has_nvidia_device_open(1)
    links["7"] = "/dev/nvidia-uvm"
    assert procfs.cuda_device_minors(1) == frozenset({0, 1})
    for name in ("3", "4", "5", "7"):
        links[name] = "/dev/null"
    assert not procfs.has_nvidia_device_open(1)
