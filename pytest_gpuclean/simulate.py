"""Simulated GPU memory holders: ``python -m pytest_gpuclean.simulate hold --dir DIR --device N --mib M``.

A holder "allocates" by writing ``DIR/<device>/<pid>`` and keeps the memory until it is killed, like a
CUDA process: the simulated backend stops counting it the moment the process dies. Tests use it to make
realistic leakers: children, SIGTERM-ignoring processes and setsid daemons.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

MIB = 1024 * 1024


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
    """Mark ``pid`` (default: this process) as having initialised CUDA on simulated ``device``, without a
    context: listed under no process, it costs the device's ``context_overhead`` (as
    ``torch.cuda.is_available()`` costs a few MiB per real GPU)."""
    folder = Path(root) / str(device) / "cuda"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(pid or os.getpid())
    path.write_text("0")
    return path


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
        time.sleep(args.seconds)
        return
    while True:
        time.sleep(3600)


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
    hold = commands.add_parser("hold", help="hold simulated GPU memory until killed")
    hold.add_argument("--dir", required=True, help="simulated devices directory (GPUCLEAN_SIMULATE)")
    hold.add_argument("--device", type=int, default=0)
    hold.add_argument("--mib", type=float, required=True)
    hold.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM (needs SIGKILL)")
    hold.add_argument("--daemonize", action="store_true", help="double-fork and setsid before holding")
    hold.add_argument("--children", type=int, default=0, help="fork K children that hold the same amount")
    hold.add_argument("--pidfile", help="append each holder's pid to this file once it holds memory")
    hold.add_argument("--seconds", type=float, help="exit by itself after this many seconds")
    args = parser.parse_args(argv)
    if args.daemonize:
        _daemonize()
    _hold(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
