"""Waiting for processes to end and reaping the ones that end up as our children (zombies).

gpuclean makes the pytest process a child subreaper, so any orphan below it (a vLLM worker whose EngineCore
exited first, the resource tracker of a finished subprocess, ...) becomes *our* child, and a zombie once it
exits, until someone waits for it. These helpers wait for exactly the pids they are given: never
``waitpid(-1)``, which would steal exit statuses from ``subprocess``/``multiprocessing`` objects.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence

import psutil

RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def descendants() -> list[psutil.Process]:
    """All live descendants of this process (resource tracker excluded: it lives as long as we do)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if RESOURCE_TRACKER not in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def wait_and_reap(
    processes: Sequence[psutil.Process], timeout_s: float, *, kill_survivors: bool
) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``processes`` to be gone, reaping those that are our zombies.

    With ``kill_survivors``, SIGKILL what still runs after that and wait 5 s more. Returns what is left
    (running, or a zombie of another parent).
    """
    deadline = time.monotonic() + timeout_s
    pending = list(processes)
    while True:
        pending = [p for p in pending if _still_there(p)]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if kill_survivors and pending:
        for process in pending:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        return wait_and_reap(pending, 5.0, kill_survivors=False)
    return pending


def _still_there(process: psutil.Process) -> bool:
    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            return True
        os.waitpid(process.pid, os.WNOHANG)
    except psutil.NoSuchProcess:
        return False
    except ChildProcessError:
        return True  # a zombie of another parent, which should wait for it (or die, and leave it to us)
    return psutil.pid_exists(process.pid)


@contextlib.contextmanager
def orphans_reaped(grace_s: float = 10.0) -> Iterator[None]:
    """Around running a subprocess: afterwards, wait for those of its descendants re-parented to this process.

    gpuclean makes pytest a child subreaper, so orphans of a subprocess become our children instead of init's.
    One always appears: a subprocess that used multiprocessing's spawn (vLLM does) has a resource tracker that
    exits by itself just after the subprocess, and then stays our zombie until someone waits for it. A new
    child still running after ``grace_s`` is a real leak: it is left to gpuclean, not killed.
    """
    known_children = {c.pid for c in psutil.Process().children()}
    try:
        yield
    finally:
        orphans = [c for c in psutil.Process().children() if c.pid not in known_children]
        wait_and_reap(orphans, grace_s, kill_survivors=False)


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie counts as gone: it holds no memory)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
