"""``python -m pytest_gpuclean.simulate init DIR``: simulated devices in one command (README's first
section), read by the same backend as the plugin's ``--gpuclean-simulate``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_pids

from pytest_gpuclean._reading.simulated import SimulatedBackend
from pytest_gpuclean._reading.simulated_layout import DEFAULT_TOTAL
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
    assert (tmp_path / "sim" / "0" / "total").read_text() == str(DEFAULT_TOTAL)


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


def simulate(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {name: value for name, value in os.environ.items() if name != "GPUCLEAN_SIMULATE"}
    return subprocess.run([sys.executable, "-m", "pytest_gpuclean.simulate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env={**environment, **(env or {})})


HOLD_PROG = "python -m pytest_gpuclean.simulate hold"


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--dir", "sim", "--mib", "-3"], {}, "--mib: '-3' is not a number of MiB >= 0"),
    (["--dir", "sim", "--mib", "inf"], {}, "--mib: 'inf' is not a number of MiB >= 0"),
    (["--dir", "sim", "--device", "5", "--mib", "1"], {},
     "--device: '5' is not a device of 'sim' (it has 0, 1)"),
    (["--dir", "sim", "--device", "-1", "--mib", "1"], {}, "--device: '-1' is not a whole number >= 0"),
    (["--dir", "typo", "--mib", "1"], {},
     "--dir: 'typo' is not a directory of simulated devices: it does not exist (from the command line); make "
     "one with 'python -m pytest_gpuclean.simulate init DIR'"),
    # Where not even root can make it (as /nonexistent for another user): was a traceback from mkdir.
    (["--dir", "/proc/nonexistent", "--mib", "1"], {},
     "--dir: '/proc/nonexistent' is not a directory of simulated devices: it does not exist (from the "
     "command line); make one with 'python -m pytest_gpuclean.simulate init DIR'"),
    (["--dir", "empty", "--mib", "1"], {},
     "--dir: 'empty' holds no simulated device (DIR/<index>/); make them with 'python -m "
     "pytest_gpuclean.simulate init DIR' (from the command line)"),
    (["--mib", "1"], {"GPUCLEAN_SIMULATE": "typo"},
     "--dir: 'typo' is not a directory of simulated devices: it does not exist (from environment variable "
     "GPUCLEAN_SIMULATE); make one with 'python -m pytest_gpuclean.simulate init DIR'"),
    (["--mib", "1"], {}, "--dir is required (or set GPUCLEAN_SIMULATE)"),
    (["--dir", "sim", "--mib", "1", "--seconds", "-1"], {},
     "--seconds: '-1' is not a number of seconds >= 0"),
])
def test_hold_refuses_what_would_make_a_wrong_tree_in_one_line(tmp_path: Path, args: list[str],
                                                               env: dict[str, str], message: str) -> None:
    # Each of these held memory anyway (a negative size that fails the next check, a third GPU, a new tree
    # for a typo) or ended in a traceback.
    assert init(tmp_path, "sim", "--devices", "2").returncode == 0
    (tmp_path / "empty").mkdir()
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    # (--seconds 0 first: what is wrongly accepted holds for no time; a later --seconds replaces it.)
    result = simulate(tmp_path, "hold", "--seconds", "0", *args, env=env)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"{HOLD_PROG}: error: {message}\n")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing made


@pytest.mark.parametrize(("command", "args"), [("xid", ["--code", "31"]), ("state", ["--lost", "gone"])])
def test_xid_and_state_refuse_a_device_or_tree_that_is_not_there(tmp_path: Path, command: str,
                                                                  args: list[str]) -> None:
    assert init(tmp_path, "sim", "--devices", "2").returncode == 0
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    prog = f"python -m pytest_gpuclean.simulate {command}"
    result = simulate(tmp_path, command, "--dir", "sim", "--device", "9", *args)
    assert (result.returncode, result.stderr) == (2, f"{prog}: error: --device: '9' is not a device of 'sim' "
                                                     "(it has 0, 1)\n")
    result = simulate(tmp_path, command, "--dir", "typo", *args)
    assert (result.returncode, result.stderr) == (
        2, f"{prog}: error: --dir: 'typo' is not a directory of simulated devices: it does not exist (from "
           "the command line); make one with 'python -m pytest_gpuclean.simulate init DIR'\n")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_hold_xid_and_state_take_the_plugins_variable_for_the_directory(tmp_path: Path) -> None:
    # README's first minute exports GPUCLEAN_SIMULATE: the simulator reads it as the plugin does.
    assert init(tmp_path, "sim", "--devices", "2").returncode == 0
    env = {"GPUCLEAN_SIMULATE": str(tmp_path / "sim")}
    pidfile = tmp_path / "pids"
    holder = subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--device", "1",
                               "--mib", "64", "--pidfile", str(pidfile)], env={**os.environ, **env})
    try:
        pid = int(read_pids(pidfile)[0])
        backend = SimulatedBackend(tmp_path / "sim")
        assert [p.pid for p in backend.snapshot(backend.devices()[1]).processes] == [pid]
    finally:
        holder.kill()
        holder.wait()
    assert simulate(tmp_path, "xid", "--device", "1", "--code", "31", env=env).returncode == 0
    assert (tmp_path / "sim" / "xid").read_text() == "1 31\n"
    assert simulate(tmp_path, "state", "--device", "0", "--lost", "gone", env=env).returncode == 0
    assert (tmp_path / "sim" / "0" / "lost").read_text() == "gone"
    help_text = simulate(tmp_path, "hold", "--help").stdout
    assert "default: $GPUCLEAN_SIMULATE" in " ".join(help_text.split())
