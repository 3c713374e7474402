"""Simulated devices, for CPU CI: directories that ``pytest_gpuclean.simulate`` writes (layout in
``simulated_layout``), read as NVML would report such devices."""

from __future__ import annotations

import contextlib
import os
import time
import uuid as uuid_mod
from collections.abc import Iterable, Sequence
from pathlib import Path
from stat import S_ISDIR
from typing import NamedTuple

from pytest_gpuclean._model.records import DeviceHealth, DeviceInfo, DeviceSnapshot, GpuProcess
from pytest_gpuclean._reading import procfs
from pytest_gpuclean._reading import simulated_layout as layout
from pytest_gpuclean._reading.devices import (
    CLOCK_REASONS,
    COMPUTE_MODES,
    BackendUnavailable,
    DeviceError,
    DeviceLost,
    LastReadings,
    SimulationError,
)

SIM_NAME = "Simulated GPU"
"""A device's name where its folder has no ``name`` file."""
_LOST_BY_FILE = f"simulated (its file {layout.LOST!r})"


class SimulatedBackend:
    """Devices as directories: ``DIR/<index>/<pid>`` holds the bytes ``pid`` allocated (docs/ci.md). As the
    driver: memory counts only while its process lives, a dead process's file is not credited to a reused
    pid, a file another user planted is charged to no process, and a pid in ``cuda/`` costs
    ``context_overhead`` charged to none."""

    kind = "simulated"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        try:
            is_dir = S_ISDIR(os.stat(self.root).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            is_dir = False
        except OSError as exc:  # a directory it may not search (another user's), a name too long
            raise SimulationError(f"simulated device directory {str(self.root)!r} cannot be read: "
                                  f"{exc.strerror or exc}") from None
        if not is_dir:
            raise BackendUnavailable(f"simulated device directory {str(self.root)!r} does not exist")
        self._idle: dict[int, DeviceSnapshot] = {}
        self._settled: dict[int, _Settled] = {}
        """Per device index, its folder as last read empty with a settled ctime, with its reading."""
        self._last: LastReadings[DeviceSnapshot] = LastReadings()
        self.notices: list[str] = []
        """Lines about files a reading did not trust, once each, for whoever reports them."""
        self._allocations = _Allocations(self.notices)
        self._empty_since: dict[int, tuple[int, int, float]] = {}
        """Per device index: the folder's inode and ctime when first read empty, and when (monotonic)."""
        self._last_batch: tuple[Sequence[DeviceInfo], list[_Settled],
                                tuple[DeviceSnapshot, ...]] | None = None
        """The devices of the last ``readings``, their settled folders and the readings, if all were
        settled and empty."""
        self._xid_path = str(self.root / layout.XID)
        self._xid_read: int | None = None
        """Bytes of ``DIR/xid`` read (None: not watching)."""
        self._xid_uuids: dict[int, list[str]] = {}
        """Device index -> the watched UUIDs with that index."""
        self._devices = self._enumerate()
        for device in self._devices:
            # A corrupt file or unreadable folder is a set-up mistake: say so now. A lost device is a check's
            # finding.
            try:
                self.snapshot(device)
            except DeviceLost:
                pass
            except SimulationError:
                raise
            except DeviceError as exc:
                raise SimulationError(str(exc)) from None

    def _enumerate(self) -> tuple[DeviceInfo, ...]:
        found: list[DeviceInfo] = []
        try:
            indices = layout.device_indices(self.root)
        except OSError as exc:  # listed only by its owner (mode 700, another user's home)
            raise SimulationError(f"simulated device directory {str(self.root)!r} cannot be read: "
                                  f"{exc.strerror or exc}") from None
        if not indices:
            raise SimulationError(layout.no_device(str(self.root)))
        self._folders: dict[int, str] = {}
        for index in indices:
            folder = self.root / str(index)
            self._folders[index] = str(folder)
            uuid = _read_text(folder / layout.UUID) or simulated_uuid(self.root, index)
            name = _read_text(folder / layout.NAME) or SIM_NAME
            found.append(DeviceInfo(index=index, uuid=uuid, name=name))
        return tuple(found)

    def devices(self) -> tuple[DeviceInfo, ...]:
        return self._devices

    def readings(self, devices: Sequence[DeviceInfo]) -> tuple[DeviceSnapshot, ...]:
        # The clean path: while every folder stays settled and empty, one stat each, and the very same
        # readings.
        last = self._last_batch
        if last is not None and last[0] is devices:
            try:
                for folder in last[1]:
                    seen = os.stat(folder.where)
                    if seen.st_ino != folder.inode or seen.st_ctime_ns != folder.ctime_ns:
                        break
                else:
                    return last[2]
            except OSError:
                pass  # (gone or unreadable: ``snapshot`` says which)
        settled = self._settled
        found: list[DeviceSnapshot] = []
        unchanged: list[_Settled] = []
        for device in devices:
            known = settled.get(device.index)
            if known is not None:
                try:
                    info = os.stat(known.where)
                except OSError:
                    info = None
                if info is not None and known.inode == info.st_ino and known.ctime_ns == info.st_ctime_ns:
                    found.append(known.idle)
                    unchanged.append(known)
                    continue
            found.append(self.snapshot(device))
        readings = tuple(found)
        self._last_batch = (devices, unchanged, readings) if len(unchanged) == len(found) else None
        return readings

    def snapshot(self, device: DeviceInfo) -> DeviceSnapshot:
        # A str path: this runs on every poll.
        where = self._folders.get(device.index) or str(self.root / str(device.index))
        try:
            info = os.stat(where)
            names = os.listdir(where)
        except FileNotFoundError:
            raise DeviceLost(device, f"vanished ({where} is gone)") from None
        except OSError as exc:
            raise DeviceError(f"simulated {device.label} ({where}) unreadable: {exc}") from exc
        if not names:
            # Adding or removing a file moves the folder's ctime, once that ctime is settled.
            idle = self._idle.get(device.index)
            if idle is None:
                idle = self._idle[device.index] = DeviceSnapshot(device, 0, layout.DEFAULT_TOTAL, ())
            # Settled by the wall clock that stamps it, and by a clock no one can set (a wall clock stepped
            # forward alone would call a fresh ctime settled).
            now = time.monotonic()
            seen = self._empty_since.get(device.index)
            if seen is None or seen[:2] != (info.st_ino, info.st_ctime_ns):
                self._empty_since[device.index] = (info.st_ino, info.st_ctime_ns, now)
            elif (now - seen[2]) * 1e9 > procfs.SETTLED_NS and (
                    time.time_ns() - info.st_ctime_ns > procfs.SETTLED_NS):
                self._settled[device.index] = _Settled(where, info.st_ino, info.st_ctime_ns, idle)
            return idle
        self._settled.pop(device.index, None)
        try:
            return self._last.same(self._read(device, Path(where), names))
        except SimulationError as exc:
            exc.device = device  # the file names the folder; a failed check's line names the device too
            raise

    def _read(self, device: DeviceInfo, folder: Path, names: list[str]) -> DeviceSnapshot:
        processes: list[GpuProcess] = []
        total = layout.DEFAULT_TOTAL
        overhead = 0
        unclaimed = 0
        cuda_users: set[int] = set()
        for name in names:
            if not name.isdigit():
                if name == layout.CUDA:
                    cuda_users = self._live_cuda_users(folder / name)
                elif name == layout.TOTAL:
                    total = _bytes_in(folder / name, _read_text(folder / name), layout.DEFAULT_TOTAL)
                elif name == layout.CONTEXT_OVERHEAD:
                    overhead = _bytes_in(folder / name, _read_text(folder / name), 0)
                elif name == layout.LOST:
                    raise DeviceLost(device, _read_text(folder / name) or _LOST_BY_FILE)
                continue
            pid = int(name)
            held, used = self._allocations.of(folder / name, pid)
            if held:
                processes.append(GpuProcess(pid, used))
            elif used:
                unclaimed += used  # a file that may not speak for its process: no one's, but still used
        processes.sort(key=lambda p: p.pid)
        # Like the driver: each context, or CUDA initialised without one, may cost memory charged to no
        # process.
        charged_to_none = overhead * (len(processes) + len(cuda_users - {p.pid for p in processes}))
        return DeviceSnapshot(
            device=device,
            used_bytes=sum(p.used_bytes or 0 for p in processes) + charged_to_none + unclaimed,
            total_bytes=total,
            processes=tuple(processes),
        )

    def cuda_users(self, pids: Iterable[int]) -> dict[int, frozenset[str]]:
        wanted = set(pids)
        users: dict[int, set[str]] = {}
        for device in self._devices:
            where = Path(self._folders.get(device.index) or self.root / str(device.index))
            listed: set[int] = set()
            with contextlib.suppress(OSError):
                listed = {int(n) for n in os.listdir(where) if n.isdigit()} & wanted
            try:
                on_device = self._live_cuda_users(where / layout.CUDA) & wanted
                on_device |= {pid for pid in listed if self._allocations.of(where / str(pid), pid)[0]}
            except SimulationError as exc:
                exc.device = device
                raise
            for pid in on_device:
                users.setdefault(pid, set()).add(device.uuid)
        return {pid: frozenset(uuids) for pid, uuids in users.items()}

    def _live_cuda_users(self, folder: Path) -> set[int]:
        try:
            names = os.listdir(folder)
        except OSError:
            return set()
        return {int(n) for n in names if n.isdigit() and self._allocations.of(folder / n, int(n))[0]}

    def driver_version(self) -> str:
        return "simulated"

    # ---- health: files in the device's folder ----------------------------------------------------

    def _folder(self, device: DeviceInfo) -> Path:
        return Path(self._folders.get(device.index) or self.root / str(device.index))

    def _health_file(self, device: DeviceInfo, name: str) -> str:
        folder = self._folder(device)
        if (folder / layout.LOST).exists():
            raise DeviceLost(device, _read_text(folder / layout.LOST) or _LOST_BY_FILE)
        if not folder.is_dir():
            raise DeviceLost(device, f"vanished ({folder} is gone)")
        return _read_text(folder / name)

    def health(self, device: DeviceInfo) -> DeviceHealth:
        folder = self._folder(device)

        def count(name: str) -> int:
            return _bytes_in(folder / name, self._health_file(device, name), 0)

        def word(name: str, default: str, allowed: Iterable[str]) -> str:
            text = self._health_file(device, name) or default
            if text not in allowed:
                raise SimulationError(f"simulated device file {str(folder / name)!r} holds {text[:40]!r}, "
                                      f"not one of {', '.join(allowed)}")
            return text

        return DeviceHealth(
            remap_pending=count(layout.REMAP_PENDING), remap_failed=bool(count(layout.REMAP_FAILED)),
            ecc_uncorrected=count(layout.ECC_UNCORRECTED),
            compute_mode=word(layout.COMPUTE_MODE, "Default", COMPUTE_MODES.values()),
            mig_mode=word(layout.MIG_MODE, "off", ("on", "off")),
            persistence=word(layout.PERSISTENCE, "on", ("on", "off")))

    def clock_reasons(self, device: DeviceInfo) -> tuple[str, ...]:
        where = self._folder(device) / layout.CLOCKS_EVENT_REASONS
        names = tuple(n.strip() for n in self._health_file(device, where.name).split(",") if n.strip())
        known = [name for _bit, name in CLOCK_REASONS]
        for name in names:
            if name not in known:
                raise SimulationError(f"simulated device file {str(where)!r} names {name!r}, not one of "
                                      f"{', '.join(known)}")
        return names

    def watch_xids(self, devices: Sequence[DeviceInfo]) -> bool:
        # Like an NVML event set: only what happens from now on.
        if self._xid_read is None:
            try:
                self._xid_read = os.stat(self._xid_path).st_size
            except OSError:
                self._xid_read = 0
        for device in devices:
            self._xid_uuids.setdefault(device.index, []).append(device.uuid)
        return True

    def drain_xids(self) -> list[tuple[str, int]]:
        done = self._xid_read
        if done is None:
            return []
        # One stat per check; the file is read only when it grew.
        try:
            size = os.stat(self._xid_path).st_size
        except OSError:
            return []
        if size == done:
            return []
        if size < done:  # rewritten: its lines are new
            done = 0
        with open(self._xid_path, "rb") as f:
            f.seek(done)
            chunk = f.read(size - done)
        complete = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self._xid_read = done + complete
        found: list[tuple[str, int]] = []
        for line in chunk[:complete].decode(errors="replace").splitlines():
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2 or not all(w.isdigit() for w in words):
                raise SimulationError(f"simulated device file {self._xid_path!r} holds the line "
                                      f"{line[:40]!r}, not '{layout.XID_LINE}'")
            found.extend((uuid, int(words[1])) for uuid in self._xid_uuids.get(int(words[0]), ()))
        return found

    def close(self) -> None:
        pass


class _Settled(NamedTuple):
    """A device folder last read empty with a settled ctime: while its inode and ctime stay, a ``stat``
    replaces a ``listdir``."""

    where: str
    inode: int
    ctime_ns: int
    idle: DeviceSnapshot


# A holder writes its file after it starts. The slack covers start-tick rounding and coarse file times; its
# error (a dead holder's file credited to a pid reused within it) makes a device dirty, never clean.
_STALE_SLACK_S = 1.0
_EMPTY_RETRIES = 5


class _Allocations:
    """Which simulated device files are live processes' allocations. A wrong "no" is the worst answer (a
    clean verdict beside held memory), so each doubt lists the process:

    - File times (wall clock) and starts (boot clock) are compared through the earliest offset seen, so a
      wall clock stepped forward later (a resumed VM) cannot make a holder's file look older.
    - A file rewritten in place (``echo N > file`` truncates) is read again; still empty, its process is
      listed with its amount unknown.
    - Only root's files or files of a user the process runs as speak for it: another user's file must not
      make gpuclean end or claim a process."""

    def __init__(self, notices: list[str]) -> None:
        self._offset = procfs.wall_minus_boot()
        self._fresh: dict[str, tuple[tuple[int, int, int, int, int], bool, bool]] = {}
        self._notices = notices
        self._named: set[str] = set()

    def of(self, path: Path, pid: int) -> tuple[bool, int | None]:
        """(whether ``pid`` holds memory through ``path``, how much: None if unknown). A file that may not
        speak for ``pid`` gives its bytes as charged to no process."""
        stat = procfs.read_stat(pid)
        if stat is None or not procfs.live_state(pid, stat.state):
            return False, None
        where = str(path)
        try:
            info = os.stat(where)
        except OSError:
            return False, None  # the holder removed it while we looked
        key = (pid, stat.start_ticks, info.st_ino, info.st_mtime_ns, info.st_uid)
        known = self._fresh.get(where)
        if known is None or known[0] != key:
            self._offset = min(self._offset, procfs.wall_minus_boot())
            started = self._offset + stat.start_ticks / procfs.CLOCK_TICKS
            fresh = started <= info.st_mtime_ns / 1e9 + _STALE_SLACK_S
            known = self._fresh[where] = (key, fresh, fresh and self._may_speak(where, info.st_uid, pid))
        if not known[1]:
            return False, None  # left by a dead process whose pid a newer one reuses
        if not known[2]:
            return False, self._content(path, where)[1]
        return self._content(path, where)

    def _may_speak(self, where: str, owner: int, pid: int) -> bool:
        """Whether a file of ``owner`` may say what ``pid`` holds: root's, or one of the users ``pid`` runs
        as."""
        if owner == 0:
            return True
        # (imported here: a session that only names its devices reads no holder)
        from pytest_gpuclean._reading.credentials import uids_of, user_name
        uids = uids_of(pid)
        if uids is not None and owner in uids:
            return True
        if where not in self._named:
            self._named.add(where)
            runs_as = ", ".join(user_name(uid) for uid in sorted(uids or ()))
            self._notices.append(
                f"simulated device file {where!r} belongs to user {user_name(owner)}, but pid "
                f"{pid} runs as {runs_as or 'a user it cannot tell'}: it cannot speak for that process "
                "(ignored: its bytes count as memory of no process)")
        return False

    def _content(self, path: Path, where: str) -> tuple[bool, int | None]:
        """(True, the bytes at ``where``: None if it stays empty while rewritten), or (False, None) if it
        is gone."""
        for attempt in range(_EMPTY_RETRIES):
            try:
                content = Path(where).read_text().strip()
            except OSError:
                return False, None
            if content:
                return True, _bytes_in(path, content, 0)
            time.sleep(0.001 * (attempt + 1))
        return True, None


def _bytes_in(path: Path, content: str, default: int) -> int:
    """The byte count a simulated device file holds (``default`` if empty); SimulationError otherwise."""
    if not content:
        return default
    try:
        value = int(content)
    except ValueError:
        value = -1
    if value < 0:
        raise SimulationError(f"simulated device file {str(path)!r} holds {content[:40]!r}, not a number of "
                              "bytes (a whole number >= 0)")
    return value


def simulated_uuid(root: str | os.PathLike[str], index: int) -> str:
    """Stable UUID of simulated device ``index`` under ``root``, where no ``uuid`` file exists."""
    real = os.path.realpath(root)
    return "GPU-" + str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"gpuclean-simulated:{real}:{index}"))


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
