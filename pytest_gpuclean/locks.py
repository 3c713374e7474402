"""Cross-process GPU locks: one per physical GPU (by UUID) in a directory every session on the host shares.

fcntl locks (through filelock) die with their holder, so a crashed or SIGKILLed session never leaves a
GPU locked. Next to each lock a small JSON file says who holds it, so a waiting session can tell what
it waits for.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import random
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import filelock

_RETRY_S = (0.02, 0.1)
"""Back-off between all-or-nothing attempts, randomised so competing sessions don't stay in step."""
_LOCK_KWARGS: dict[str, Any] = ({"preserve_lock_file": True}
                if "preserve_lock_file" in inspect.signature(filelock.FileLock.__init__).parameters else {})
# Deleting a lock file on release would let two sessions lock two different inodes of one path.


class LockTimeout(Exception):
    """The locks could not be had in time; ``holders`` says who has them."""

    def __init__(self, message: str, holders: dict[str, dict[str, object]]) -> None:
        super().__init__(message)
        self.holders = holders


def ensure_lock_dir(path: str) -> str:
    """Create the shared lock directory (sticky and world-writable, like /tmp) if needed."""
    try:
        os.makedirs(path, mode=0o1777, exist_ok=True)
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise OSError(f"{path} is not a directory")
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o1777:
            os.chmod(path, 0o1777)  # makedirs' mode is filtered by the umask
    except OSError as exc:
        raise OSError(f"cannot use GPU lock directory {path!r}: {exc}") from exc
    return path


def _file_name(uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)


@dataclass
class HeldLocks:
    """Locks held by this process for one test; release them in ``release``."""

    uuids: tuple[str, ...]
    locks: list[filelock.BaseFileLock]
    holder_paths: list[str]
    waited_s: float

    def release(self) -> None:
        # Holder file first: once the lock is free, the next holder writes its own.
        for path in self.holder_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for lock in self.locks:
            lock.release(force=True)


class GpuLocks:
    """Acquire per-GPU locks all-or-nothing, in one global (UUID) order, so no two sessions deadlock."""

    def __init__(self, directory: str) -> None:
        self.directory = ensure_lock_dir(directory)

    def lock_path(self, uuid: str) -> str:
        return os.path.join(self.directory, _file_name(uuid) + ".lock")

    def holder_path(self, uuid: str) -> str:
        return os.path.join(self.directory, _file_name(uuid) + ".holder")

    def holder(self, uuid: str) -> dict[str, object]:
        """Who holds ``uuid``'s lock, as recorded next to it (empty if nobody recorded)."""
        try:
            with open(self.holder_path(uuid)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _try(self, uuid: str) -> filelock.BaseFileLock | None:
        lock = filelock.FileLock(self.lock_path(uuid), mode=0o666, **_LOCK_KWARGS)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return None
        return lock

    def acquire(self, candidates: Sequence[str], count: int, timeout: float, holder_id: str,
                prefer: Sequence[str] = ()) -> HeldLocks:
        """Lock ``count`` of ``candidates`` (all of them when ``count == len(candidates)``).

        Free devices are taken in UUID order, those listed in ``prefer`` first. If fewer than ``count``
        are free, everything taken is released and the attempt repeats until ``timeout``.
        """
        ordered = sorted(candidates, key=lambda u: (u not in prefer, u))
        started = time.monotonic()
        while True:
            taken: list[tuple[str, filelock.BaseFileLock]] = []
            for uuid in ordered:
                lock = self._try(uuid)
                if lock is not None:
                    taken.append((uuid, lock))
                    if len(taken) == count:
                        break
            if len(taken) == count:
                held = HeldLocks(tuple(u for u, _ in taken), [lk for _, lk in taken], [],
                                 time.monotonic() - started)
                for uuid, _lock in taken:
                    path = self.holder_path(uuid)
                    # Best effort: in the sticky lock directory another user's old holder file can't be
                    # replaced; the lock itself is what protects the GPU.
                    with contextlib.suppress(OSError):
                        _write_json(path, {"pid": os.getpid(), "host": socket.gethostname(),
                                           "test": holder_id, "since": time.time(), "uuid": uuid})
                        held.holder_paths.append(path)
                return held
            for _uuid, lock in taken:
                lock.release(force=True)
            waited = time.monotonic() - started
            if waited >= timeout:
                busy = [u for u in ordered if u not in {t for t, _ in taken}]
                holders = {u: self.holder(u) for u in busy}
                raise LockTimeout(
                    f"waited {waited:.1f}s for {count} of {len(ordered)} GPU lock(s); held by: "
                    + "; ".join(f"{u}: {describe_holder(h)}" for u, h in holders.items()), holders)
            time.sleep(random.uniform(*_RETRY_S))


def describe_holder(holder: dict[str, object]) -> str:
    """One line naming a lock holder."""
    if not holder:
        return "unknown holder"
    since = holder.get("since")
    age = f", for {time.time() - since:.0f}s" if isinstance(since, (int, float)) else ""
    return f"pid {holder.get('pid')} on {holder.get('host')} running {holder.get('test')}{age}"


def _write_json(path: str, data: dict[str, object]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
