"""What held a GPU from outside when a check waited it out, per device: a later check finding it unchanged
for its own timeout does not wait again. An xdist run's workers share it through a file under ``flock``.
Only an optimisation: a lost file costs a wait, never makes a check pass."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pytest_gpuclean._check.decisions import OutsideState

STATE_VAR = "GPUCLEAN_OUTSIDE_STATE"
"""Set by an xdist controller for its workers: the shared file."""
_READ_LIMIT = 1 << 20


class OutsideMemory:
    """Per device UUID, the outside state a check waited out: in this process, or shared through ``path``."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._states: dict[str, OutsideState] = {}

    def load(self) -> dict[str, OutsideState]:
        """What is remembered now (read-only: ``update`` changes it)."""
        if self.path is None:
            return self._states
        with self._open(fcntl.LOCK_SH) as fd:
            return _parse(_read(fd)) if fd is not None else {}

    def update(self, remember: Mapping[str, OutsideState], forget: Iterable[str]) -> None:
        gone = set(forget) - remember.keys()
        if self.path is None:
            self._states.update(remember)
            for uuid in gone:
                self._states.pop(uuid, None)
            return
        with self._open(fcntl.LOCK_EX) as fd:
            if fd is None:
                return
            before = _parse(_read(fd))
            after = {u: s for u, s in before.items() if u not in gone}
            after.update(remember)
            if after != before:
                data = json.dumps({u: {"holders": sorted(s.holders), "used_bytes": s.used_bytes,
                                       "where": s.where, "since": s.since} for u, s in after.items()})
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, data.encode())

    def forget(self, uuids: Iterable[str]) -> None:
        """Forget ``uuids`` (found clean); cheap when nothing is remembered: the clean path."""
        if self.path is None:
            if self._states:
                self.update({}, uuids)
            return
        try:
            if os.stat(self.path).st_size <= 2:  # nothing, or "{}"
                return
        except OSError:
            return
        self.update({}, uuids)

    @contextlib.contextmanager
    def _open(self, how: int) -> Iterator[int | None]:
        assert self.path is not None
        try:
            # In a private directory the controller made (0700): no other user plants anything.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:
            yield None  # gone (the run is ending) or unusable: remember nothing
            return
        try:
            fcntl.flock(fd, how)
            yield fd
        finally:
            os.close(fd)  # (drops the lock)


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, _READ_LIMIT)


def _parse(data: bytes) -> dict[str, OutsideState]:
    try:
        raw: Any = json.loads(data) if data else {}
        return {str(uuid): OutsideState(frozenset((int(p), int(t)) for p, t in entry["holders"]),
                                        int(entry["used_bytes"]), str(entry["where"]), float(entry["since"]))
                for uuid, entry in raw.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}  # (only an optimisation: start afresh)
