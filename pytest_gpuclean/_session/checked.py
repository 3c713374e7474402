"""A gpuclean session that checks: its device backend, locks, checker and records, set up once a test is to
be checked. A session that checks nothing never imports it (psutil, NVML and the checking code come with
it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._check.checker import Checker, CheckSettings
from pytest_gpuclean._check.outside import STATE_VAR, OutsideMemory
from pytest_gpuclean._locks.gpus import GpuLocks
from pytest_gpuclean._model.records import MIB, DeviceInfo, HealthFinding, Owner, ProcessInfo, Reaped
from pytest_gpuclean._ownership.census import Census, KeptAlive, Registry, XdistPeers
from pytest_gpuclean._ownership.cookie import (
    COOKIE_VAR,
    OWNER_VAR,
    SESSION_TOKEN,
    WORKERS_SINCE_VAR,
    restore_env,
)
from pytest_gpuclean._ownership.evidence import SESSION_OWNER, Ownership
from pytest_gpuclean._reading import backends, devices, processes
from pytest_gpuclean._session import store
from pytest_gpuclean._session.names import MARKER
from pytest_gpuclean._session.opening import open_devices, select_devices
from pytest_gpuclean._session.signals import again_words, quiet_interrupts
from pytest_gpuclean.report import terminal

if TYPE_CHECKING:
    from pytest_gpuclean._check.health import HealthWatch
    from pytest_gpuclean._reading.nvml import NvmlOpening
    from pytest_gpuclean._session.names import ExportedCookie

_SUBREAPER: dict[int, bool] = {}
"""pid -> whether PR_SET_CHILD_SUBREAPER took; once per process."""


class CheckedSession:
    """What checking needs, set up at once: raises ``pytest.UsageError`` for an unusable device list,
    lock directory or Ray cluster."""

    def __init__(self, config: pytest.Config, resolved: settings.Settings, exported: ExportedCookie,
                 pid: int, opening: NvmlOpening | None = None, backend: backends.Backend | None = None
                 ) -> None:
        """``backend``: one opened already, taken over; else opened here."""
        self.config = config
        self.settings = resolved
        self.pid = pid
        """The session's own process: a forked child of it runs one test."""
        self.records = store.of(config)
        self.unavailable: str | None = None
        self.no_gpu = settings.no_gpu_action(resolved, os.environ)
        """What a marked test gets while ``unavailable``, and why."""
        self.backend: backends.Backend | None = None
        self.devices: tuple[DeviceInfo, ...] = ()
        self.locks: GpuLocks | None = None
        self.left_alone: list[ProcessInfo] = []
        """Set by ``close``: processes under pytest that existed before the session (never signalled)."""
        self.helpers_ended: list[Reaped] = []
        """Helpers only ``--gpuclean-helpers`` vouched for, ended at the very end."""
        self.health: HealthWatch | None = None
        self.health_at_start: list[HealthFinding] = []
        self._test_tokens: dict[str, str] = {}
        self._shared: tuple[str, str | None] | None = None
        """xdist controller: the workers' shared directory for outside holders, and ``STATE_VAR``'s old
        value."""
        me = os.getpid()
        if me not in _SUBREAPER:
            _SUBREAPER[me] = processes.set_child_subreaper()
        try:
            self.backend = backend if backend is not None else open_devices(resolved, opening)
        except devices.BackendUnavailable as exc:
            self.unavailable = str(exc)
        try:
            self._open(exported)
        except BaseException:
            if self.backend is not None:
                self.backend.close()
            raise

    def _open(self, exported: ExportedCookie) -> None:
        resolved = self.settings
        if self.backend is not None:
            selection = select_devices(self.backend, resolved)
            self.devices = selection.devices
            if not self.devices:
                # Like a machine without GPUs: marked tests skip or fail, as --gpuclean-no-gpu says.
                self.unavailable = selection.none_reason(self.backend.kind)
        if resolved.lock == "on" and self.backend is not None:
            try:
                self.locks = GpuLocks(resolved.lock_dir)
                self.locks.prepare([d.uuid for d in self.devices])
            except OSError as exc:
                source = resolved.sources.get("lock_dir", "the default")
                raise pytest.UsageError(f"--gpuclean-lock-dir: {exc} ({source})") from None
        # Only an xdist worker has peers: otherwise the run id was inherited (a nested session started by
        # a worker's test), and our siblings are no peers.
        worker = hasattr(self.config, "workerinput")
        # Its start-up walk takes whatever already runs under us for the session set-up's.
        ownership = Ownership(exported.session_id, exported.started_ticks, exported.last_pid)
        peers = XdistPeers(os.environ.get("PYTEST_XDIST_TESTRUNUID") if worker else None, exported.inherited,
                           _ticks(WORKERS_SINCE_VAR))
        kept = KeptAlive(resolved.helpers, resolved.persistent, _xprocess_registry(self.config))
        self.checker = Checker(self.backend, CheckSettings(
            reap=resolved.reap == "on", grace=resolved.grace, settle=resolved.settle, ignore=resolved.ignore,
            host_scope=resolved.scope == "host", dead_sessions=resolved.dead_sessions == "on"),
            Census(ownership, uid=os.getuid(), peers=peers, kept=kept))
        shared = os.environ.get(STATE_VAR) if worker else None
        if shared:
            self.checker.outside = OutsideMemory(shared)  # the run's other workers' too
        # What starts outside any test is the session set-up's, protected until the very last sweep.
        self.checker.ownership.register(SESSION_TOKEN, SESSION_OWNER)
        if self.backend is not None and self.devices:
            self._watch_health()
        # An extension (--gpuclean-ray) sets up what it checks.
        self.config.hook.pytest_gpuclean_session_start(session=self)

    def _watch_health(self) -> None:
        from pytest_gpuclean._check import health
        from pytest_gpuclean._reading import probe
        source = self.backend
        if not isinstance(source, backends.HealthSource):
            return  # a backend without health reads
        resolved = self.settings

        def prober(chosen: Sequence[DeviceInfo]) -> dict[str, str | None]:
            return probe.run(chosen, simulate=resolved.simulate, timeout=resolved.timeout)

        try:
            self.health = health.HealthWatch(source, self.devices, probe=resolved.probe, prober=prober,
                                             note=self.records.note)
            self.health_at_start = self.health.start()
        except devices.SimulationError as exc:
            raise pytest.UsageError(resolved.refused("simulate", exc)) from None

    def header_lines(self) -> list[str]:
        """What the session checks, for the header: the backend, the devices and what they hold."""
        if self.unavailable is not None:
            action, why = self.no_gpu
            return [f"gpuclean: no GPUs checked: {self.unavailable}; tests marked {MARKER} will be "
                    + ("errors" if action == "fail" else "skipped") + (f" ({why})" if why else "")]
        assert self.backend is not None
        lines = [f"gpuclean: {self.backend.kind} devices (driver {self.backend.driver_version()}), "
                 f"checking {len(self.devices)}, scope {self.settings.scope}, reap {self.settings.reap}, "
                 f"subreaper {'on' if _SUBREAPER.get(os.getpid()) else 'OFF'}"]
        lost = self.health.lost if self.health is not None else {}
        for snap in self.checker.snapshot([d for d in self.devices if d.uuid not in lost]):
            mine = snap.bytes_of({os.getpid()})
            holders = f"this pytest process holds {mine / MIB:.0f} MiB (not counted)" if mine else ""
            lines.append("gpuclean: " + terminal.device_line(snap, holders))
        for found in self.health_at_start:
            lines.append(f"gpuclean: {found.message}: tests on it fail at their setup")
        if self.health is not None and self.health.probe_s:
            lines.append(f"gpuclean: CUDA probe of {len(self.devices)} device(s) took "
                         f"{self.health.probe_s[0]:.2f}s")
        return lines

    def share_outside(self) -> None:
        """xdist controller, before it starts the workers: a private place for them to share what held a
        GPU from outside, so one worker's wait spares the others."""
        import tempfile

        folder = tempfile.mkdtemp(prefix="gpuclean-run-")  # 0700: no other user plants anything there
        self._shared = (folder, os.environ.get(STATE_VAR))
        os.environ[STATE_VAR] = os.path.join(folder, "outside.json")

    # ---- the session's end -----------------------------------------------------------------------

    def sweep(self, interrupted: bool = False) -> None:
        """The final sweep: what the session's tests left behind; a second interrupt only makes it quicker.
        ``interrupted``: say at once what the sweep waits for, and how to cut it short."""
        hurry = threading.Event()
        restore = quiet_interrupts(hurry)
        self.checker.hurry = hurry.is_set
        if interrupted:
            self.checker.before_grace = self._say_waiting
        records = self.records
        try:
            records.session_reaped = self.checker.final_sweep(self.devices)
            for reaped in self.config.hook.pytest_gpuclean_sweep(session=self, include_session=False,
                                                                 timeout=self.settings.timeout):
                records.session_reaped += reaped
        finally:
            self.checker.hurry = None
            self.checker.before_grace = None
            restore()
        if not self.checker.reap_enabled:
            left = self.checker.survivors()
            if left:
                records.note(f"session end: {len(left)} process(es) spawned by this session still alive "
                           "(reaping is off): "
                           + ", ".join(f"pid {p.pid} {terminal.one_line(p.cmdline, 60)}" for p in left))
        for reaped in records.session_reaped:
            records.found_later(reaped)
        self.take_notices()

    def take_notices(self) -> None:
        """The checker's lines about helpers and persistent processes, into the session's notes."""
        notices = self.checker.notices
        for line in notices:
            self.records.note(line, once=True)
        notices.clear()

    def close(self, *, controller: bool) -> list[Reaped]:
        """After every pytest_unconfigure: reap what the session set-up started (a conftest's server) and
        its owner did not stop, which would otherwise outlive pytest."""
        self.config.hook.pytest_gpuclean_session_finish(session=self)
        if self._shared is not None:
            import shutil

            folder, previous = self._shared
            shutil.rmtree(folder, ignore_errors=True)
            restore_env(STATE_VAR, previous)
            self._shared = None
        late: list[Reaped] = []
        older: list[ProcessInfo] = []
        try:
            if not controller:
                late = self.checker.final_sweep(self.devices, include_session=True)
                older = self.checker.no_part_of_the_session()
                self.helpers_ended = self.checker.end_declared_helpers(self.devices)
        except Exception as exc:  # the session is over: say what went wrong, lose nothing else
            sys.stderr.write(f"gpuclean: the last sweep failed: {exc!r}\n")
        self.records.session_reaped.extend(late)
        self.left_alone = older
        return late

    def close_backend(self) -> None:
        """Stop the checker and close the device backend (after the environment is restored)."""
        self.checker.close()
        if self.backend is not None:
            self.backend.close()

    def reap_crashed(self, nodeid: str | None) -> None:
        """In the controller: reap what a crashed worker left, blamed on ``nodeid`` (None: on the test each
        process names)."""
        reaped, notes = self.checker.reap_dead_sessions(self.devices)
        for r in reaped:
            self.records.found_later(r, otherwise=nodeid)
        why = f"crashed while running {nodeid}" if nodeid is not None else "its xdist worker ended unheard"
        for note in notes:
            self.records.note(f"gpuclean: {note} ({why})")

    # ---- whose process is it ---------------------------------------------------------------------

    def set_owner_env(self, token: str) -> tuple[str | None, str | None]:
        """Export ``token``'s cookie and owner to what the pytest process spawns; return the previous."""
        ownership = self.checker.ownership
        previous = os.environ.get(COOKIE_VAR), os.environ.get(OWNER_VAR)
        os.environ[COOKIE_VAR] = ownership.cookie(token)
        os.environ[OWNER_VAR] = ownership.owners[token].name
        return previous

    @contextlib.contextmanager
    def owned_by(self, token: str) -> Iterator[None]:
        """While the block runs, what the pytest process spawns is ``token``'s."""
        previous = self.set_owner_env(token)
        self.checker.ownership.open_window(token)
        try:
            yield
        finally:
            self.checker.ownership.close_window(token)
            restore_env(COOKIE_VAR, previous[0])
            restore_env(OWNER_VAR, previous[1])

    def token_of(self, owner: Owner) -> str | None:
        """The token ``owner`` was registered under."""
        for token, candidate in self.checker.ownership.owners.items():
            if candidate is owner:
                return token
        return None

    def announce(self, nodeid: str) -> None:
        """A test is about to run. pytest-forked calls this before forking the test's child, so a token made
        here is unique across children and known to the session."""
        self._test_tokens[nodeid] = self.checker.ownership.new_token(Owner("test", nodeid))

    def test_token(self, nodeid: str) -> str:
        """The token of the test that is set up now."""
        return self._test_tokens.pop(nodeid, None) or self.checker.ownership.new_token(Owner("test", nodeid))

    def follow_fork(self) -> None:
        """In a child forked to run one test (pytest-forked): that child's own subreaper and records."""
        pid = os.getpid()
        if pid == self.pid or pid in _SUBREAPER:
            return
        # The subreaper setting is not inherited; the child ships only what it records itself.
        _SUBREAPER[pid] = processes.set_child_subreaper()
        self.records.forget()

    def receive_forked(self, shipped: Any) -> None:
        """Take what a forked child recorded, and collect that child's exited orphans."""
        self.records.receive(shipped)
        # The child's orphans were re-parented to us: exited, they hold nothing; collect them now rather
        # than report them as leftovers at session end.
        for found in self.checker.take_census():
            if not found.live and not self.checker.ownership.is_protected(found.token):
                processes.reap_if_child(found.pid)

    # ---- what the session says -------------------------------------------------------------------

    def attribute_earlier(self, reaped: list[Reaped] | tuple[Reaped, ...], nodeid: str,
                          notes: tuple[str, ...] = ()) -> None:
        """Blame a leak of an earlier test (or a dead session) found in ``nodeid``'s check on its spawner.
        In that test's record, not a warning: a warning would be filed under ``nodeid``, and ``-W error``
        would make it ``nodeid``'s error."""
        for r in reaped:
            self.records.found_later(r)
            origin = next((n for n in notes if n.startswith(f"pid {r.process.pid}: left by ")), None)
            if origin is not None:
                self.records.note(f"gpuclean: {origin}, spawned by {r.owner}: reaped ({r.how_ended}) before "
                                f"{nodeid}")

    def _say_waiting(self, pids: list[int], grace: float) -> None:
        self.say(f"gpuclean: interrupted: ending {len(pids)} process(es) the session left "
                 f"({', '.join(f'pid {p}' for p in pids)}): SIGTERM now, SIGKILL after at most {grace:g}s; "
                 f"interrupt again ({again_words()}) to SIGKILL them now")

    def say(self, line: str) -> None:
        """Show ``line`` now, past the output capture, while the session waits (a lock can take minutes)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)
            flush = getattr(reporter, "flush", None)  # a pipe (a CI log): now, not at the end
            if flush is not None:
                flush()


def _xprocess_registry(config: pytest.Config) -> Registry | None:
    """What pytest-xprocess keeps alive across sessions, if loaded: its pid files and live ``Popen``s are
    the evidence that a process is meant to outlive the session."""
    if not config.pluginmanager.hasplugin("xprocess"):
        return None
    # xprocess's directory is ``.xprocess`` in pytest's cache directory; not made here.
    try:
        cache_dir = os.path.expanduser(os.path.expandvars(str(config.getini("cache_dir"))))
    except ValueError:  # -p no:cacheprovider: no such ini value, and xprocess has no records
        return None
    root = Path(config.rootpath, cache_dir, "d", ".xprocess")
    uid = os.getuid()

    def registry() -> dict[int, tuple[str, float | None]]:
        found: dict[int, tuple[str, float | None]] = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(root):
                pidfile = os.path.join(entry.path, "xprocess.PID")
                try:
                    record = os.stat(pidfile)
                    pid = int(Path(pidfile).read_text().strip())
                except (OSError, ValueError):
                    continue
                if record.st_uid != uid:
                    continue  # another user's file in a shared cache directory vouches for nothing of ours
                recorded = record.st_mtime
                found[pid] = (f"pytest-xprocess keeps {entry.name!r}", recorded)
        xprocess = getattr(config, "_xprocess", None)  # xprocess's live processes
        for resource in getattr(xprocess, "resources", None) or ():
            popen, info = getattr(resource, "popen", None), getattr(resource, "info", None)
            if isinstance(popen, subprocess.Popen) and popen.returncode is None:
                name = getattr(info[0], "name", "?") if isinstance(info, tuple) and info else "?"
                found[popen.pid] = (f"pytest-xprocess keeps {name!r}", None)
        return found

    return registry


def _ticks(name: str) -> int | None:
    """A boot tick that environment variable ``name`` holds (set by gpuclean); None if unset or not one."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None

