"""The reap ladder: end processes (SIGTERM, the grace, SIGKILL; or SIGKILL at once) and wait until the
driver lets their GPU memory go, timing the release.

It signals only what it is handed: which processes those may be is decided before, by the one gate
(``deciding/gate.py``: ``Checker.gate`` over the census, ``reap_plan.plan`` for ``gpuclean reap``), and
``processes.terminate`` signals each through the pidfd pinned when it was found. The plugin's reaper and
``gpuclean reap`` both end processes through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pytest_gpuclean._model.records import DeviceInfo, DeviceSnapshot, FoundBy, Owner, ProcessInfo, Reaped
from pytest_gpuclean._reading import processes
from pytest_gpuclean._reading.devices import DeviceError

__all__ = [
    "Read",
    "kill_and_confirm",
    "reaped_record",
    "vanished",
]

_RELEASE_POLL_S = 0.005

Read = Callable[[Sequence[DeviceInfo]], Sequence[DeviceSnapshot]]
"""Reads the devices (``Checker.snapshot``)."""


def kill_and_confirm(targets: Sequence[processes.KillTarget], devices: Sequence[DeviceInfo],
                     holders: set[int], *, read: Read, grace: float, hurry: Callable[[], bool] | None = None,
                     kill_first: bool = False
                     ) -> tuple[dict[int, tuple[processes.KillOutcome, float | None]], float | None]:
    """The kill ladder, then wait until the driver lists none of ``holders`` (GPU-holding targets).

    Returns per pid its outcome and the driver's release time, and the seconds from the first
    signal until every holder was gone from the devices (None if none held a GPU or one stayed).
    """
    watch = _ReleaseWatch(read, devices, holders)
    killed_at = time.monotonic()
    outcomes = processes.terminate(targets, grace, watch=watch.poll, hurry=hurry, kill_first=kill_first)
    watch.finish(deadline=time.monotonic() + max(grace, 10.0))
    ended: dict[int, tuple[processes.KillOutcome, float | None]] = {}
    for outcome in outcomes:
        release = None
        if outcome.pid in watch.gone_at and outcome.signal_s is not None:
            # The driver frees memory while the process exits (before it is a zombie), so time
            # the release from the signal that ended it, not from its exit.
            release = max(0.0, watch.gone_at[outcome.pid] - (killed_at + outcome.signal_s))
        ended[outcome.pid] = (outcome, release)
    all_released = None
    if holders and holders <= watch.gone_at.keys():
        all_released = max(watch.gone_at[p] for p in holders) - killed_at
    return ended, all_released


class _ReleaseWatch:
    """Notes when each killed GPU holder disappears from the driver's process list."""

    def __init__(self, read: Read, devices: Sequence[DeviceInfo], holders: set[int]) -> None:
        self.read = read
        self.devices = devices
        self.holders = holders
        self.gone_at: dict[int, float] = {}

    def poll(self) -> None:
        if len(self.gone_at) == len(self.holders):
            return
        try:
            listed = {p.pid for s in self.read(self.devices) for p in s.processes}
        except DeviceError:
            # The killing goes on without timing the release; the check's next reading meets the error.
            self.holders = set(self.gone_at)
            return
        now = time.monotonic()
        for pid in self.holders - listed - self.gone_at.keys():
            self.gone_at[pid] = now

    def finish(self, deadline: float) -> None:
        self.poll()
        while len(self.gone_at) < len(self.holders) and time.monotonic() < deadline:
            time.sleep(_RELEASE_POLL_S)
            self.poll()


def vanished(pid: int) -> ProcessInfo:
    """A stand-in for a process that ended before it could be described."""
    return ProcessInfo(pid, 0, 0, -1, "?", "(exited)", "gone")


def reaped_record(info: ProcessInfo | None, pid: int, owner: Owner | None, found_by: FoundBy,
                  ended: tuple[processes.KillOutcome, float | None],
                  held: tuple[tuple[str, float], ...]) -> Reaped:
    """What the kill ladder did to one process, as reported."""
    outcome, release = ended
    return Reaped.after_kill(info or vanished(pid), owner, found_by, held, outcome, release)
