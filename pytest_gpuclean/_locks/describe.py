"""Who holds a GPU's lock, in words: a line per GPU, for a waiting session and a lock timeout."""

from __future__ import annotations

import time

from pytest_gpuclean._locks.directory import HOST, QUEUE_AFTER_S
from pytest_gpuclean._model.records import HolderRecord, LockHolder


def describe_holders(holders: dict[str, LockHolder]) -> str:
    """``uuid: holder; uuid: holder`` for a message."""
    return "; ".join(f"{u}: {describe_holder(h)}" for u, h in holders.items())


def describe_holder(holder: LockHolder) -> str:
    """One line naming a lock's holder: its record, checked against the kernel's /proc/locks."""
    lock_pid = holder.lock_pid
    record = holder.record
    if holder.making and lock_pid is None and not holder.held:
        return ("its lock file is being created by another session (a moment; if it lasts, a process keeps "
                "its mark on the lock directory up: lslocks shows OFDLCK locks)")
    if holder.missing:
        if not holder.held:
            return "its lock file is missing; the next attempt creates it"
        who = "a session that left no record"
        if record is not None:
            who = _recorded(record)
            if holder.alive is False:
                who += " (gone: a process that inherited its descriptors, a raw fork's child, keeps its mark)"
        return ("its lock file was deleted (by hand or by a tmp cleaner?) while a session held the GPU, "
                f"which it still does through the deleted file: {who}; a new lock file is made as soon as it "
                "lets go")
    recorded = _recorded(record) if record is not None else None
    if lock_pid is None and holder.queued:
        return (f"free, but another session has waited over {QUEUE_AFTER_S:.0f}s for it and goes first "
                "(long waiters before newcomers)")
    if lock_pid is None:
        if recorded is None:
            return "unknown holder (no valid holder record, and /proc/locks does not name the process)"
        if holder.alive is False:
            return recorded + " (that process is gone: a stale record; the holder did not record itself)"
        return recorded
    if lock_pid == 0:
        return (recorded or "unknown holder") + " (the lock is held from another PID namespace)"
    real = (f"pid {lock_pid} (user {holder.lock_user}: {holder.lock_cmd or '?'}), which left "
            "no record")
    if record is None or recorded is None:
        return real
    if record.host != HOST:
        return f"{recorded} (pid {lock_pid} here)"  # another container: its own pid numbers
    if record.pid == lock_pid and holder.alive is not False:
        return recorded
    state = "that process is gone" if holder.alive is False else "that process does not hold it"
    return f"{real}; the newest record, {recorded}, is stale ({state})"


def _recorded(record: HolderRecord) -> str:
    age = max(0.0, time.time() - record.since)
    return f"pid {record.pid} (user {record.user}) on {record.host} running {record.test}, for {age:.0f}s"
