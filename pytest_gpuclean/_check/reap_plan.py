"""What ``gpuclean reap`` may end, over plain facts: one planner for this host and a Ray cluster's nodes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pytest_gpuclean._check.gate import refusal
from pytest_gpuclean._model.records import Credentials, FoundBy, ProcessInfo
from pytest_gpuclean.report.text import one_line


class ReapCandidate(NamedTuple):
    """A process ``reap`` might end, with every fact the decision needs (from ``_cli.py`` or
    ``ray/command_line.py``)."""

    pid: int
    info: ProcessInfo | None
    """None: not visible where it runs (exited, or in another PID namespace)."""
    mib: tuple[tuple[str, float], ...] = ()
    found_by: FoundBy = "gpu"
    """``gpu`` or ``cookie``; only an invisible ``gpu`` one is worth a line (an exited carrier is just
    gone)."""
    where: str = ""
    """``node 3f2a9c1b`` on a Ray cluster; "" on this host."""
    no_device_file: bool = False
    """The local process of that number has no ``/dev/nvidia*`` open: a container's driver may list host
    pids."""
    gpuclean_itself: bool = False
    """gpuclean or one of its ancestors."""
    ray_own: bool = False
    """The node's raylet, or a Ray daemon that is no actor's worker."""
    job_id: str = ""
    """"" if none."""
    job_running: bool = False
    job_driver_pid: int | None = None
    """The driver of its still running job, if the cluster knows the job."""
    task_worker: bool = False
    """A Ray worker that is no actor's: Ray ends it with its task."""
    credentials: Credentials | None = None
    """Whom a signal could reach; None where not read (a Ray node's: its uid alone is checked)."""


def plan(candidates: Iterable[ReapCandidate], *, my_uid: int, all_users: bool = False, cmd_width: int = 80
         ) -> tuple[list[ReapCandidate], list[str]]:
    """``(targets, left_alone)``: what ``reap`` may end, in ``candidates``' order, and a line for each
    process left alone, saying why."""
    targets: list[ReapCandidate] = []
    chosen: set[tuple[str, int]] = set()
    left: list[str] = []
    for c in candidates:
        if (c.where, c.pid) in chosen:
            continue
        why = _left_alone(c, my_uid, all_users, cmd_width)
        if why is None:
            chosen.add((c.where, c.pid))
            targets.append(c)
        elif why and (line := f"{c.where}: {why}" if c.where else why) not in left:
            left.append(line)  # (once: a process the driver lists may carry the cookie too)
    return targets, left


def _left_alone(c: ReapCandidate, my_uid: int, all_users: bool, width: int) -> str | None:
    """Why ``c`` is left alone ("" for no line); None if it may be ended."""
    pid, info = c.pid, c.info
    if info is None:
        if c.found_by != "gpu":
            return ""
        if c.where:
            return f"pid {pid}: not visible on its node (exited, or another PID namespace)"
        listed = ", ".join(label for label, _ in c.mib)
        return f"pid {pid} (listed on {listed}): not visible here (exited, or in another PID namespace)"
    cmd = one_line(info.cmdline, width)
    if c.no_device_file:
        listed = ", ".join(label for label, _ in c.mib)
        return (f"pid {pid} (listed on {listed}) is {cmd!r} here, which has no /dev/nvidia* open: not the "
                "driver's process (another PID namespace?)")
    if c.gpuclean_itself:
        carries = "carries the cookie, but is " if c.found_by == "cookie" else ""
        return f"pid {pid} ({cmd}): {carries}gpuclean itself or one of its ancestors"
    if c.ray_own:
        return f"pid {pid} ({cmd}): Ray's own (daemon or task worker)"
    if not all_users:
        # Another user's process, or a relay to one (the gate's rule, as the plugin's).
        why = refusal(c.credentials, my_uid) if c.credentials is not None else (
            "another user's process" if info.uid != my_uid else None)
        if why is not None:
            return f"pid {pid} of user {info.user} ({cmd}): {why}" + (
                "" if c.where else " (only root, with --all-users, ends those)")
    if c.job_running:
        return (f"pid {pid} ({cmd}): its Ray job {c.job_id} is still running"
                + (f" (driver pid {c.job_driver_pid})" if c.job_driver_pid is not None else ""))
    if c.task_worker:
        return f"pid {pid} ({cmd}): a task worker of job {c.job_id}: Ray ends it"
    return None
