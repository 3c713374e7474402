"""Simulated GPUs: ``python -m pytest_gpuclean.simulate init DIR --devices N`` makes the devices,
``python -m pytest_gpuclean.simulate hold --dir DIR --device N --mib M`` holds memory on one,
``... xid --dir DIR --device N --code 31`` raises an Xid event there and ``... state --dir DIR --device N
--remap-pending 1`` (and the other health states: ``--help``) sets its health (docs/ci.md).

A holder "allocates" by writing ``DIR/<device>/<pid>`` and keeps the memory until it dies, like a CUDA
process: tests use it to make realistic leakers (children, SIGTERM-ignoring processes, setsid daemons).
Commands refuse a directory ``init`` did not make, so a typo never makes a new tree or GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

# The layout only: a holder starts in every leak test, so it loads nothing else of the plugin.
from pytest_gpuclean._reading import simulated_layout as layout

MIB = 1024 * 1024
_DEFAULT_TOTAL_MIB = layout.DEFAULT_TOTAL // MIB


def allocate(root: str, device: int, mib: float, pid: int | None = None) -> Path:
    """Record ``mib`` MiB on simulated ``device`` for ``pid`` (default: this process)."""
    folder = Path(root) / str(device)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(pid or os.getpid())
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(str(int(mib * MIB)))
    os.replace(tmp, path)  # a reader never sees a half-written count
    return path


def init_cuda(root: str, device: int, pid: int | None = None) -> Path:
    """Mark ``pid`` (default: this process) as having initialised CUDA on simulated ``device`` without a
    context: it costs ``context_overhead``, listed under no process, as ``torch.cuda.is_available()`` does."""
    folder = Path(root) / str(device) / layout.CUDA
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(pid or os.getpid())
    path.write_text("0")
    return path


def xid(root: str, device: int, code: int) -> Path:
    """Append Xid ``code`` of simulated ``device`` to ``DIR/xid``: an event for a session watching it."""
    path = Path(root) / layout.XID
    # One write of a whole line with O_APPEND: a reader never sees half of it.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, layout.xid_line(device, code).encode())
    finally:
        os.close(fd)
    return path


def set_state(root: str, device: int, name: str, value: str | None) -> None:
    """Write health file ``name`` of simulated ``device`` (``None`` removes it)."""
    if name not in layout.HEALTH_FILES:
        raise ValueError(f"{name!r} is not a health file ({', '.join(layout.HEALTH_FILES)})")
    folder = Path(root) / str(device)
    if value is None:
        (folder / name).unlink(missing_ok=True)
        return
    tmp = folder / f".{name}.tmp"
    tmp.write_text(value)
    os.replace(tmp, folder / name)


_SIMULATE_VAR = "GPUCLEAN_SIMULATE"
"""The default of ``--dir``, so a shell set up for the plugin needs no ``--dir``."""


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _number(parser: argparse.ArgumentParser, option: str, text: str | None, what: str, *,
            whole: bool = False) -> float:
    """``text`` as a number >= 0 (a whole one with ``whole``); one line and exit 2 otherwise."""
    try:
        value = float(int(text)) if whole and text is not None else float(text or "")
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        _refuse(parser, f"{option}: {text!r} is not {what} >= 0")
    return value


def _device_folder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path:
    """The folder of ``--device`` in ``--dir``, which ``init`` must have made: a typo in either must not
    make a new tree or device, nor end in a traceback."""
    if args.dir is not None:
        given, source = args.dir, "from the command line"
    else:
        given, source = os.environ.get(_SIMULATE_VAR, ""), f"from environment variable {_SIMULATE_VAR}"
        if not given:
            _refuse(parser, f"--dir is required (or set {_SIMULATE_VAR})")
    root = Path(os.path.expanduser(given))
    index = int(_number(parser, "--device", args.device, "a whole number", whole=True))
    try:
        if not root.is_dir():
            _refuse(parser, f"--dir: {given!r} is not a directory of simulated devices: "
                            f"{'not a directory' if root.exists() else 'it does not exist'} ({source}); "
                            "make one with 'python -m pytest_gpuclean.simulate init DIR'")
        devices = layout.device_indices(root)
    except OSError as exc:
        _refuse(parser, f"--dir: {given!r} cannot be read: {exc.strerror or exc} ({source})")
    if not devices:
        _refuse(parser, f"--dir: {layout.no_device(given)} ({source})")
    if index not in devices:
        _refuse(parser, f"--device: {args.device!r} is not a device of {given!r} (it has "
                        f"{', '.join(map(str, devices))})")
    return root / str(index)


def _state(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    folder = _device_folder(args, parser)
    args.dir, args.device = str(folder.parent), int(folder.name)
    if args.clear:
        for name in layout.HEALTH_FILES:
            (folder / name).unlink(missing_ok=True)
    given = {"remap_pending": args.remap_pending, "remap_failed": "1" if args.remap_failed else None,
             "ecc_uncorrected": args.ecc_uncorrected, "compute_mode": args.compute_mode,
             "mig_mode": args.mig_mode, "persistence": args.persistence, "clocks_event_reasons": args.clocks,
             "lost": args.lost, "probe_fails": args.probe_fails,
             "probe_hangs": "1" if args.probe_hangs else None}
    for name, value in given.items():
        if value is not None:
            set_state(args.dir, args.device, name, str(value))


def _check_hold(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse a bad ``hold`` before it forks or holds anything."""
    folder = _device_folder(args, parser)
    args.dir, args.device = str(folder.parent), int(folder.name)
    args.mib = _number(parser, "--mib", args.mib, "a number of MiB")
    args.children = int(_number(parser, "--children", args.children, "a whole number", whole=True))
    if args.seconds is not None:
        args.seconds = _number(parser, "--seconds", args.seconds, "a number of seconds")
    elif args.busy:
        parser.error("--busy needs --seconds (how long it works before it exits)")


def _hold(args: argparse.Namespace) -> None:
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(args.children):
        if os.fork() == 0:
            args.children = 0
            break
    allocate(args.dir, args.device, args.mib)
    if args.pidfile:
        with open(args.pidfile, "a") as f:
            f.write(f"{os.getpid()}\n")
    if args.seconds is not None:
        if args.busy:  # on its way out: working (cleaning up, finishing a shutdown) until it exits
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                pass
        else:
            time.sleep(args.seconds)
        return
    while True:
        time.sleep(3600)


def init(root: str, count: int, total_mib: int) -> list[Path]:
    """Make simulated devices ``0..count-1`` of ``total_mib`` MiB in ``root``; returns their folders.

    Idempotent: devices already there keep what they hold; only their capacity is set. Raises
    ``ValueError`` (naming the entry) if ``root`` holds anything but device folders, or devices beyond
    ``count``: the plugin would then find other devices than the ones asked for.
    """
    base = Path(root)
    if base.exists() and not base.is_dir():
        raise ValueError(f"{root!r} exists and is not a directory")
    if base.is_dir():
        for entry in sorted(base.iterdir()):
            if entry.name == layout.XID and entry.is_file():
                continue  # the devices' Xid events
            if not (entry.name.isdigit() and entry.is_dir()):
                raise ValueError(f"{root!r} holds {entry.name!r}, which is not a simulated device folder "
                                 "(DIR/<index>/); give a new or empty directory")
            if int(entry.name) >= count:
                raise ValueError(f"{root!r} already holds device {entry.name}; --devices {count} would leave "
                                 "it there (give a new directory, or remove it)")
    folders = []
    for index in range(count):
        folder = base / str(index)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{layout.TOTAL}.tmp"
        tmp.write_text(str(total_mib * MIB))
        os.replace(tmp, folder / layout.TOTAL)  # a running session reads it at any time
        folders.append(folder)
    return folders


def _init(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        init(args.dir, args.devices, args.total_mib)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    where = os.path.abspath(args.dir)
    print(f"{args.devices} simulated GPU(s) of {args.total_mib} MiB in {where}; use them with "
          f"--gpuclean-simulate={where} or GPUCLEAN_SIMULATE={where}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _daemonize() -> None:
    # The classic double fork: the first child starts a new session and exits, so the holder is an
    # orphan in another session; without a subreaper it would be re-parented to PID 1.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_gpuclean.simulate")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("init", help="make simulated devices DIR/0, DIR/1, ... (idempotent)")
    make.add_argument("dir", metavar="DIR", help="directory of the devices, created if missing")
    make.add_argument("--devices", type=_positive, default=1, metavar="N", help="how many (default 1)")
    make.add_argument("--total-mib", type=_positive, default=_DEFAULT_TOTAL_MIB, metavar="MIB",
                      help=f"capacity of each (default {_DEFAULT_TOTAL_MIB}, an 80 GB GPU)")
    # Numbers are checked after parsing, so a bad one is one line, as a bad --dir or --device is.
    tree = argparse.ArgumentParser(add_help=False)
    tree.add_argument("--dir", metavar="DIR",
                      help=f"the simulated devices, as 'init' made them (default: ${_SIMULATE_VAR}, the "
                           "plugin's variable)")
    tree.add_argument("--device", metavar="N", default="0", help="the device's index (default 0)")
    hold = commands.add_parser("hold", parents=[tree], help="hold simulated GPU memory until killed")
    hold.add_argument("--mib", metavar="MIB", required=True, help="how much (MiB, >= 0)")
    hold.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM (needs SIGKILL)")
    hold.add_argument("--daemonize", action="store_true", help="double-fork and setsid before holding")
    hold.add_argument("--children", metavar="K", default="0",
                      help="fork K children that hold the same amount")
    hold.add_argument("--pidfile", help="append each holder's pid to this file once it holds memory")
    hold.add_argument("--seconds", metavar="S", help="exit by itself after this many seconds")
    hold.add_argument("--busy", action="store_true",
                      help="with --seconds: keep a CPU busy until then (a process finishing its work), "
                           "instead of sleeping")
    raise_xid = commands.add_parser("xid", parents=[tree], help="raise an Xid event on a simulated device")
    raise_xid.add_argument("--code", type=int, required=True, help="the Xid code, e.g. 31 (an MMU fault)")
    state = commands.add_parser("state", parents=[tree],
                                help="set the health of a simulated device (what NVML would report)")
    state.add_argument("--remap-pending", type=int, metavar="ROWS", help="memory rows waiting for a reset")
    state.add_argument("--remap-failed", action="store_true", help="a row remapping failed")
    state.add_argument("--ecc-uncorrected", type=int, metavar="N", help="volatile uncorrectable ECC errors")
    state.add_argument("--compute-mode", choices=("Default", "Exclusive_Process", "Prohibited"))
    state.add_argument("--mig-mode", choices=("on", "off"))
    state.add_argument("--persistence", choices=("on", "off"))
    state.add_argument("--clocks", metavar="REASONS",
                       help="clock event reasons, comma-separated: sw_power_cap, hw_slowdown, sw_thermal, "
                            "hw_thermal, hw_power_brake")
    state.add_argument("--lost", metavar="REASON", help="the device is lost (fallen off the bus)")
    state.add_argument("--probe-fails", metavar="ERROR", help="the CUDA probe fails on it with ERROR")
    state.add_argument("--probe-hangs", action="store_true", help="the CUDA probe never answers on it")
    state.add_argument("--clear", action="store_true", help="remove every health file first (a healthy GPU)")
    args = parser.parse_args(argv)
    if args.command == "init":
        _init(args, make)
        return 0
    if args.command == "xid":
        folder = _device_folder(args, raise_xid)
        xid(str(folder.parent), int(folder.name), args.code)
        return 0
    if args.command == "state":
        _state(args, state)
        return 0
    _check_hold(args, hold)
    if args.daemonize:
        _daemonize()
    _hold(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
