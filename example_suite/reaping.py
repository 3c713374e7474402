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
from collections.abc import Sequence

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
