"""``python -m pytest_gpuclean.simulate init DIR``: simulated devices in one command (README's first
section), read by the same backend as the plugin's ``--gpuclean-simulate``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuclean.core.devices import DEFAULT_SIM_TOTAL, SimulatedBackend
from pytest_gpuclean.simulate import MIB, allocate

PROG = "python -m pytest_gpuclean.simulate init"


def init(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpuclean.simulate", "init", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_init_makes_devices_the_backend_reads(tmp_path: Path) -> None:
    result = init(tmp_path, "sim", "--devices", "2", "--total-mib", "1024")
    root = tmp_path / "sim"
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (f"2 simulated GPU(s) of 1024 MiB in {root}; use them with "
                             f"--gpuclean-simulate={root} or GPUCLEAN_SIMULATE={root}\n")
    backend = SimulatedBackend(root)
    assert [d.index for d in backend.devices()] == [0, 1]
    assert [(s.used_bytes, s.total_bytes) for s in map(backend.snapshot, backend.devices())] == [
        (0, 1024 * MIB)] * 2


def test_init_by_default_makes_one_device_of_the_backends_default_size(tmp_path: Path) -> None:
    assert init(tmp_path, "sim").returncode == 0
    assert sorted(p.name for p in (tmp_path / "sim").iterdir()) == ["0"]
    assert (tmp_path / "sim" / "0" / "total").read_text() == str(DEFAULT_SIM_TOTAL)


def test_init_again_keeps_what_the_devices_hold(tmp_path: Path) -> None:
    root = tmp_path / "sim"
    assert init(tmp_path, "sim", "--devices", "1").returncode == 0
    allocate(str(root), 0, 64)  # this process, alive: the backend counts it
    again = init(tmp_path, "sim", "--devices", "2", "--total-mib", "2048")
    assert (again.returncode, again.stderr) == (0, "")
    backend = SimulatedBackend(root)
    first, second = map(backend.snapshot, backend.devices())
    assert (first.used_bytes, first.total_bytes, [p.pid for p in first.processes]) == (
        64 * MIB, 2048 * MIB, [os.getpid()])
    assert (second.used_bytes, second.total_bytes) == (0, 2048 * MIB)


@pytest.mark.parametrize(("entries", "message"), [
    (["notes.txt"], "'sim' holds 'notes.txt', which is not a simulated device folder (DIR/<index>/); give a "
                    "new or empty directory"),
    (["0/", "1/", "2/"], "'sim' already holds device 2; --devices 2 would leave it there (give a new "
                         "directory, or remove it)"),
    (["7"], "'sim' holds '7', which is not a simulated device folder (DIR/<index>/); give a new or empty "
            "directory"),
    ([""], "'sim' exists and is not a directory"),
])
def test_init_refuses_a_directory_that_holds_something_else(tmp_path: Path, entries: list[str],
                                                           message: str) -> None:
    root = tmp_path / "sim"
    if entries == [""]:
        root.write_text("x")  # DIR itself is a file
    for entry in filter(None, entries):
        path = root / entry
        path.parent.mkdir(parents=True, exist_ok=True)
        if entry.endswith("/"):
            path.mkdir()
        else:
            path.write_text("x")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    result = init(tmp_path, "sim", "--devices", "2")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"{PROG}: error: {message}\n")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing made


@pytest.mark.parametrize(("option", "value"), [
    ("--devices", "0"), ("--devices", "-1"), ("--total-mib", "abc"), ("--total-mib", "1.5")])
def test_init_refuses_a_bad_count_naming_the_option(tmp_path: Path, option: str, value: str) -> None:
    result = init(tmp_path, "sim", option, value)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"{PROG}: error: argument {option}: {value!r} is not a whole " \
                                              "number >= 1"
    assert not (tmp_path / "sim").exists()
