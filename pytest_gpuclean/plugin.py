"""pytest-gpuclean: a clean-GPU gate before and after each marked test; reaps what a test leaked.

The only module with pytest hooks. Declarations live at module level; the stateful ``GpuCleanPlugin``
is registered in ``pytest_configure`` and undone through ``config.add_cleanup``.

The plugin loads into every pytest run of an environment that has it installed, so it starts lazily: at
``pytest_configure`` it only validates its options and exports the session's cookie; the device backend,
the subreaper, the lock directory, the checker (and the modules they need, psutil and NVML among them)
come at the end of the collection, and only if a collected test is to be checked.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import warnings
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from pytest_gpuclean import procfs, settings
from pytest_gpuclean.cookie import COOKIE_VAR, OWNER_VAR, SESSION_NAME, SESSION_TOKEN, cookie, new_session_id

if TYPE_CHECKING:
    from pytest_gpuclean import devices as devices_mod
    from pytest_gpuclean import processes, records, report
    from pytest_gpuclean.checker import Checker
    from pytest_gpuclean.locks import GpuLocks, HeldLocks, LockTimeout, describe_holders, take_notices
    from pytest_gpuclean.model import MIB, CheckResult, DeviceInfo, Owner, Reaped, TestRecord
    from pytest_gpuclean.ownership import SESSION_OWNER


def _import_session_modules() -> None:
    """Import what a started session runs on, into this module's namespace (once, at start).

    Deferred because a session that checks no test must not pay for it (psutil, NVML bindings, the lock
    and report code: tens of milliseconds); every name is declared above for the type checker.
    """
    if "Checker" in globals():
        return
    from pytest_gpuclean import checker, locks, model, ownership
    from pytest_gpuclean import devices as devices_module
    from pytest_gpuclean import processes as processes_module
    from pytest_gpuclean import records as records_module
    from pytest_gpuclean import report as report_module

    globals().update(
        devices_mod=devices_module, processes=processes_module, records=records_module, report=report_module,
        Checker=checker.Checker, GpuLocks=locks.GpuLocks, HeldLocks=locks.HeldLocks,
        LockTimeout=locks.LockTimeout, describe_holders=locks.describe_holders,
        take_notices=locks.take_notices, MIB=model.MIB, CheckResult=model.CheckResult,
        DeviceInfo=model.DeviceInfo, Owner=model.Owner, Reaped=model.Reaped, TestRecord=model.TestRecord,
        SESSION_OWNER=ownership.SESSION_OWNER)


MARKER = "needs_clean_gpus"
FIXTURE = "clean_gpus"
PLUGIN_NAME = "gpuclean-checker"
WORKER_OUTPUT_KEY = "gpuclean"
FORKED_REPORT_ATTR = "gpuclean_forked"
"""Attribute of a teardown report made in a forked child (pytest-forked): that child's records."""


class GpuCleanWarning(pytest.PytestWarning):
    """Something gpuclean noticed that is not a test failure (``-W error`` makes it one)."""


class DeviceState:
    """A device under check as the ``clean_gpus`` fixture shows it (figures from the setup check). (No
    dataclass, nor a NamedTuple, whose ``index`` is a method: see ``_ItemState``.)"""

    __slots__ = ("index", "name", "total_bytes", "used_bytes", "uuid")

    def __init__(self, index: int, uuid: str, name: str, used_bytes: int, total_bytes: int) -> None:
        self.index, self.uuid, self.name = index, uuid, name
        self.used_bytes, self.total_bytes = used_bytes, total_bytes

    def _key(self) -> tuple[int, str, str, int, int]:
        return self.index, self.uuid, self.name, self.used_bytes, self.total_bytes

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, DeviceState) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return ("DeviceState(index={}, uuid={!r}, name={!r}, used_bytes={}, total_bytes={})"
                .format(*self._key()))


class CleanGpus(NamedTuple):
    """What the ``clean_gpus`` fixture yields: the devices this test checks (and holds locks of)."""

    devices: tuple[DeviceState, ...]

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self.devices)


class _ItemState:
    """A test's state from its setup to the end of its teardown. (No dataclass: this module is imported
    by every pytest run of the environment, and creating a dataclass costs more than it saves here.)"""

    __slots__ = ("checked", "devices", "fixture_tokens", "locks", "nodeid", "previous_cookie",
                 "previous_visible", "timeout", "token", "tolerance_mib", "torch_before")

    def __init__(self, nodeid: str, token: str, previous_cookie: tuple[str | None, str | None]) -> None:
        self.nodeid = nodeid
        self.token = token
        self.previous_cookie = previous_cookie
        self.checked = False
        self.tolerance_mib = 0
        self.timeout = 0.0
        self.devices: tuple[DeviceInfo, ...] = ()
        self.locks: HeldLocks | None = None
        self.previous_visible: tuple[bool, str | None] | None = None
        self.torch_before: dict[int, int] | None = None
        self.fixture_tokens: list[str] = []


_STATE = pytest.StashKey[_ItemState]()
_SUBREAPER: dict[int, bool] = {}
"""pid -> whether PR_SET_CHILD_SUBREAPER took; once per process (xdist workers are processes too)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


class _Cookie(NamedTuple):
    """The session's cookie as exported: its id, the cookie it inherited, when, and what it replaced."""

    session_id: str
    inherited: str | None
    started_ticks: int
    previous: tuple[str | None, str | None]


_COOKIE = pytest.StashKey[_Cookie]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before any conftest is imported: what a conftest, a plugin's pytest_configure or the collection
    # starts carries the session's cookie. A process that then leaves our tree before the session starts
    # (a daemon's double fork: we are no subreaper yet) is still known as the session set-up's, protected
    # while the session runs and reaped at its very end, like one that stayed in the tree.
    _export_cookie(early_config)


def _export_cookie(config: pytest.Config) -> _Cookie:
    exported = config.stash.get(_COOKIE, None)
    if exported is None:
        # A cookie already set (a CI job's, or the test of an outer pytest session) prefixes ours, so
        # `gpuclean reap --cookie <job>` and the outer session still recognise everything we spawn.
        inherited = os.environ.get(COOKIE_VAR)
        exported = _Cookie(new_session_id(inherited), inherited, procfs.boot_ticks_now(),
                           (inherited, os.environ.get(OWNER_VAR)))
        config.stash[_COOKIE] = exported
        os.environ[COOKIE_VAR] = cookie(exported.session_id, SESSION_TOKEN)
        os.environ[OWNER_VAR] = SESSION_NAME
    return exported


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(tolerance_mib=None, timeout=None, count=None): check that the GPUs are clean (no memory "
        "in use, no stray processes) before and after this test, reap what it leaks; tolerance_mib: MiB "
        "allowed per device; timeout: seconds to wait for clean GPUs; count: GPUs the test needs "
        "(it gets exactly those through CUDA_VISIBLE_DEVICES).",
    )
    inifile = str(config.inipath) if config.inipath else None
    resolved = settings.resolve(vars(config.option), os.environ, config.getini, inifile)
    plugin = GpuCleanPlugin(config, resolved)
    config.pluginmanager.register(plugin, PLUGIN_NAME)
    config.add_cleanup(plugin.close)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(plugin), PLUGIN_NAME + "-xdist")
    if resolved.report:
        # A report was asked for: check its path now, and write it even if no test is checked.
        plugin.register_outputs()


def _select_devices(backend: devices_mod.Backend, resolved: settings.Settings) -> devices_mod.Selection:
    try:
        return devices_mod.choose_devices(backend, resolved.devices, resolved.sources.get("devices", ""),
                                          option=settings.option("devices").cli)
    except devices_mod.DeviceSelectionError as exc:
        raise pytest.UsageError(str(exc)) from None


def _torch_allocated() -> dict[int, int] | None:
    # Only look if the test process already initialised CUDA through torch; never initialise it.
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return {i: int(cuda.memory_allocated(i)) for i in range(cuda.device_count())}


class GpuCleanPlugin:
    """Per-session state: the device backend, the checker; hooks that drive them and keep the session's
    records (``records.SessionRecords``, in ``config.stash``)."""

    def __init__(self, config: pytest.Config, resolved: settings.Settings) -> None:
        self.config = config
        self.settings = resolved
        self._session_pid = os.getpid()
        self.started = False
        """Set up (backend, subreaper, locks, checker): at the end of the collection if a collected test
        is checked; in an xdist controller, at session start."""
        self.unavailable: str | None = None
        self.backend: devices_mod.Backend | None = None
        self.devices: tuple[DeviceInfo, ...] = ()
        self.locks: GpuLocks | None = None
        self.checker: Checker
        self.found: records.SessionRecords
        self.warned_own_context = False
        self.warned_own_cuda = False
        self.controller = False
        self._fixture_tokens: dict[int, str] = {}
        self._test_tokens: dict[str, str] = {}
        self._tearing_down: _ItemState | None = None
        self._outputs_registered = False
        # Exported before the conftests were imported (unless this plugin was registered later, by a
        # conftest's pytest_plugins: then now).
        exported = _export_cookie(config)
        self._inherited_cookie = exported.inherited
        self.session_id = exported.session_id
        self._started_ticks = exported.started_ticks
        self._session_token = SESSION_TOKEN
        self._previous_cookie = exported.previous
        self.ray: Any = None
        self._swept = False
        self._terminated = False
        self._previous_sigterm: Any = None
        if resolved.report:
            self._install_sigterm()  # a cancelled job still gets its report

    def start(self) -> None:
        """Set up what checking needs; once. Raises ``pytest.UsageError`` for an unusable device list or
        lock directory."""
        if self.started:
            return
        _import_session_modules()
        self.found = records.of(self.config)
        resolved = self.settings
        me = os.getpid()
        if me not in _SUBREAPER:
            _SUBREAPER[me] = processes.set_child_subreaper()
        try:
            self.backend = devices_mod.open_backend(resolved.simulate)
        except devices_mod.BackendUnavailable as exc:
            self.unavailable = str(exc)
        except devices_mod.SimulationError as exc:
            source = resolved.sources.get("simulate")
            raise pytest.UsageError(f"--gpuclean-simulate: {exc} ({source})") from None
        if self.backend is not None:
            selection = _select_devices(self.backend, resolved)
            self.devices = selection.devices
            if not self.devices:
                # Like a machine without GPUs: marked tests skip (or fail with --gpuclean-require-gpu).
                self.unavailable = selection.none_reason(self.backend.kind)
        if resolved.lock == "on" and self.backend is not None:
            try:
                self.locks = GpuLocks(resolved.lock_dir)
                self.locks.prepare([d.uuid for d in self.devices])
            except OSError as exc:
                source = resolved.sources.get("lock_dir", "the default")
                raise pytest.UsageError(f"--gpuclean-lock-dir: {exc} ({source})") from None
        # Only an xdist worker has peers: otherwise the run id in our environment was inherited (we are
        # a nested session started by a worker's test), and our siblings are no peers of ours.
        worker = hasattr(self.config, "workerinput")
        # Its start-up walk takes whatever already runs under us (a conftest's server, what the
        # collection started) for the session set-up's.
        self.checker = Checker(self.backend, reap=resolved.reap == "on", grace=resolved.grace,
                               ignore=resolved.ignore, host_scope=resolved.scope == "host",
                               settle=resolved.settle, session_id=self.session_id,
                               xdist_run=os.environ.get("PYTEST_XDIST_TESTRUNUID") if worker else None,
                               peer_cookie=self._inherited_cookie,
                               dead_sessions=resolved.dead_sessions == "on",
                               session_start_ticks=self._started_ticks)
        # Processes started outside any test (collection, other plugins, conftest imports) carry the
        # session's cookie: the session set-up's, protected until the very last sweep.
        self.checker.ownership.register(self._session_token, SESSION_OWNER)
        self.ray = _start_ray(resolved, self.checker)
        self.started = True
        self._install_sigterm()
        self.register_outputs()

    def register_outputs(self) -> None:
        """Register the JSON report, JUnit and GitHub outputs (checks the report path)."""
        if self._outputs_registered:
            return
        self._outputs_registered = True
        from pytest_gpuclean.outputs import OutputHooks  # (a session that writes none does not load them)

        self.config.pluginmanager.register(OutputHooks(self), PLUGIN_NAME + "-outputs")

    def close(self) -> None:
        if not self.started:
            _restore_env(COOKIE_VAR, self._previous_cookie[0])
            _restore_env(OWNER_VAR, self._previous_cookie[1])
            if self.backend is not None:  # a start that failed (a bad lock directory)
                self.backend.close()
            self._uninstall_sigterm()
            return
        if self.ray is not None:
            self._ray_sweep(include_session=True)
            self.ray.stop()
        # After every pytest_unconfigure: what the session set-up started (a conftest's server, a
        # plugin's daemon) and its owner did not stop would otherwise outlive pytest.
        try:
            late = self.checker.final_sweep(self.devices, include_session=True) if not self.controller else []
        except Exception as exc:  # the session is over: say what went wrong, lose nothing else
            late = []
            sys.stderr.write(f"gpuclean: the last sweep failed: {exc!r}\n")
        if late:
            sys.stderr.write(f"gpuclean: reaped {len(late)} process(es) of the session set-up (conftest, "
                             "plugins) still alive after pytest_unconfigure: "
                             + ", ".join(f"pid {r.process.pid} {r.how_ended} "
                                         f"({report.one_line(r.process.cmdline, 60)})" for r in late) + "\n")
        _restore_env(COOKIE_VAR, self._previous_cookie[0])
        _restore_env(OWNER_VAR, self._previous_cookie[1])
        self.checker.close()
        if self.backend is not None:
            self.backend.close()
        self._uninstall_sigterm()

    def _set_owner_env(self, token: str) -> tuple[str | None, str | None]:
        """Export ``token``'s cookie and owner to what the pytest process spawns; return the previous."""
        ownership = self.checker.ownership
        previous = os.environ.get(COOKIE_VAR), os.environ.get(OWNER_VAR)
        os.environ[COOKIE_VAR] = ownership.cookie(token)
        os.environ[OWNER_VAR] = ownership.owners[token].name
        return previous

    # ---- signals ---------------------------------------------------------------------------------

    def _install_sigterm(self) -> None:
        # A cancelled CI job sends SIGTERM: treat it like Ctrl-C, so that the final sweep runs and the
        # reports are written, then die of SIGTERM as the job runner expects. A handler that the suite
        # (or another plugin) installed is left alone.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _uninstall_sigterm(self) -> None:
        if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self._terminated:
            self._terminated = True
            atexit.register(_die_of, signal.SIGTERM)
        raise KeyboardInterrupt("SIGTERM")

    # ---- session ---------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # The xdist controller runs no tests; its children are the workers, which check themselves. It
        # collects nothing either, so it starts now, before it spawns the workers: as their subreaper it
        # adopts what a crashed worker leaves, and its start-up checks the options for all of them.
        self.controller = session.config.pluginmanager.hasplugin("dsession")
        if self.controller:
            self.start()

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # The end of the collection: start if anything will be checked, or if a report was asked for (the
        # session is then watched: what its unmarked tests leave behind is reaped and reported). Not for
        # --collect-only, nor when collection errors stop the run before any test.
        if self.started or self.controller or session.config.option.collectonly:
            return
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            return
        if self.settings.report or any(self._should_check(item) for item in session.items):
            self.start()
        else:
            # Nothing to check: off the hooks that run for every test, in favour of one that notices a
            # test that is checked after all.
            session.config.pluginmanager.unregister(self)
            session.config.pluginmanager.register(_IdleSession(self), PLUGIN_NAME + "-idle")

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        return self._header_lines() if self.started else []

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        # What the header says in an xdist controller, for a session that started at collection's end.
        if not self.started or self.controller or config.option.no_header:
            return []
        return self._header_lines() if config.get_verbosity() >= 0 else []

    def _header_lines(self) -> list[str]:
        if self.unavailable is not None:
            return [f"gpuclean: no GPUs checked: {self.unavailable}; tests marked {MARKER} will be "
                    + ("errors (--gpuclean-require-gpu)" if self.settings.require_gpu else "skipped")]
        assert self.backend is not None
        lines = [f"gpuclean: {self.backend.kind} devices (driver {self.backend.driver_version()}), "
                 f"checking {len(self.devices)}, scope {self.settings.scope}, reap {self.settings.reap}, "
                 f"subreaper {'on' if _SUBREAPER.get(os.getpid()) else 'OFF'}"]
        for snap in self.checker.snapshot(self.devices):
            mine = snap.bytes_of({os.getpid()})
            holders = f"this pytest process holds {mine / MIB:.0f} MiB (not counted)" if mine else ""
            lines.append("gpuclean: " + report.device_line(snap, holders))
        return lines

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.sweep(session)

    @pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_sessionfinish")
    def sessionfinish_guard(self, session: pytest.Session) -> Generator[None, None, None]:
        # A second pytest_sessionfinish: when another plugin's or a
        # conftest's pytest_sessionfinish raises, pluggy skips the rest, ours included; this outermost
        # wrapper sweeps anyway.
        try:
            return (yield)
        finally:
            self.sweep(session)

    def sweep(self, session: pytest.Session) -> None:
        """The final sweep, once, whatever else failed; a second interrupt only makes it quicker."""
        if self._swept or self.controller:
            return
        self._swept = True
        worker_output = getattr(session.config, "workeroutput", None)
        if not self.started:
            if worker_output is not None:
                from pytest_gpuclean.records import EMPTY_PAYLOAD

                worker_output[WORKER_OUTPUT_KEY] = dict(EMPTY_PAYLOAD)
            return
        hurry = threading.Event()
        restore = _quiet_interrupts(hurry)
        self.checker.hurry = hurry.is_set
        found = self.found
        try:
            found.session_reaped = self.checker.final_sweep(self.devices)
            found.session_reaped += self._ray_sweep(include_session=False)
        finally:
            self.checker.hurry = None
            restore()
        if not self.checker.reap_enabled:
            left = self.checker.survivors()
            if left:
                found.note(f"session end: {len(left)} process(es) spawned by this session still alive "
                           "(reaping is off): "
                           + ", ".join(f"pid {p.pid} {report.one_line(p.cmdline, 60)}" for p in left))
        for reaped in found.session_reaped:
            found.found_later(reaped)
        if worker_output is not None:
            worker_output[WORKER_OUTPUT_KEY] = found.payload()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.started:
            return  # (nothing found: what a report shows of such a session comes from the outputs)
        merged = self.found.merged()
        if not merged.records and not merged.session_reaped and not merged.notes:
            return
        terminalreporter.write_sep("=", report.SUMMARY_TITLE)
        for line in report.summary_lines(*merged):
            terminalreporter.write_line(line)

    # ---- fixtures owned by a scope wider than a test ----------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
                             ) -> Generator[None, Any, Any]:
        if fixturedef.scope == "function" or self.controller or not self.started:
            return (yield)
        ownership = self.checker.ownership
        token = ownership.new_token(Owner("fixture", f"{fixturedef.argname} ({fixturedef.scope}-scoped)"))
        self._fixture_tokens[id(fixturedef)] = token
        ownership.active_fixtures.add(token)
        previous = self._set_owner_env(token)
        ownership.open_window(token)
        try:
            return (yield)
        finally:
            ownership.close_window(token)
            _restore_env(COOKIE_VAR, previous[0])
            _restore_env(OWNER_VAR, previous[1])

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any],
                                      request: pytest.FixtureRequest) -> None:
        token = self._fixture_tokens.pop(id(fixturedef), None)
        if token is not None:
            # From now on its processes are checked like a test's, at the end of this teardown.
            self.checker.ownership.active_fixtures.discard(token)
            # request.node is the fixture's own node (module, class...), not the test whose teardown
            # finalizes it; that test's check is the one that blames the fixture.
            if self._tearing_down is not None:
                self._tearing_down.fixture_tokens.append(token)

    # ---- tests run in a forked child (pytest-forked) ------------------------------------------------

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        # pytest-forked calls this in the session's process, then forks the child that runs the test:
        # a token made here is unique across children, and the session knows whose cookie a leftover
        # carries. Without a fork, setup takes it from the same process.
        if self.started and not self.controller:
            self._test_tokens[nodeid] = self.checker.ownership.new_token(Owner("test", nodeid))

    def _follow_fork(self) -> None:
        pid = os.getpid()
        if pid == self._session_pid or pid in _SUBREAPER:
            return
        # A forked child: the subreaper setting is not inherited, and the records it inherited are the
        # session's, which keeps its own; this child ships only what it records itself.
        _SUBREAPER[pid] = processes.set_child_subreaper()
        self.found.forget()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        test_report = yield
        if call.when == "teardown" and self.started and os.getpid() != self._session_pid:
            # This child's memory dies with it: its records travel on the teardown report, which
            # pytest-forked serialises (plain dicts and lists) with the report's other attributes.
            setattr(test_report, FORKED_REPORT_ATTR, self.found.ship())
        return test_report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        shipped = getattr(report, FORKED_REPORT_ATTR, None)
        # The xdist controller gets the same report from a worker, which already merged it.
        if shipped is None or self.controller or os.getpid() != self._session_pid:
            return
        self.found.receive(shipped)
        # Orphans of the child that ended there (killed by its check, a double fork's middle process)
        # were re-parented to this process: exited, they hold nothing; collect them now rather than
        # report them as leftovers at session end.
        for found in self.checker.census():
            if not found.live and not self.checker.ownership.is_protected(found.token):
                processes.reap_if_child(found.pid)

    # ---- around each test -------------------------------------------------------------------------

    def _should_check(self, item: pytest.Item) -> bool:
        if self.controller:
            return False
        return (self.settings.all or item.get_closest_marker(MARKER) is not None
                or FIXTURE in getattr(item, "fixturenames", ()))

    # trylast: the innermost wrapper. Our check may fail the setup before ``yield``, and wrappers
    # outside us (logging, capture) must have run their own setup so that their teardown finds it.
    # Every wrapper still runs before the function-scoped fixtures are set up.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        if not self.started:
            if not self._should_check(item):
                return (yield)
            # Checked after all, though the collection did not say so (a marker added since): start now.
            self.start()
        self._follow_fork()
        ownership = self.checker.ownership
        token = self._test_tokens.pop(item.nodeid, None) or ownership.new_token(Owner("test", item.nodeid))
        state = _ItemState(item.nodeid, token, self._set_owner_env(token))
        item.stash[_STATE] = state
        if records.TEST in item.stash:
            del item.stash[records.TEST]  # a test run again (a rerun plugin) starts a new record
        ownership.open_window(token)
        if self._should_check(item):
            state.checked = True
            self._before(item, state)
        return (yield)

    def _before(self, item: pytest.Item, state: _ItemState) -> None:
        marker = item.get_closest_marker(MARKER)
        try:
            applied = settings.for_marker(self.settings, marker.kwargs if marker else {}, item.nodeid,
                                          marker.args if marker else ())
        except ValueError as exc:
            # ``from None``: failing inside ``except`` would print the message twice, chained.
            message = f"gpuclean: {exc} (from the {MARKER} marker)"
            raise pytest.fail.Exception(message, pytrace=False) from None
        wants_gpu = marker is not None or FIXTURE in getattr(item, "fixturenames", ())
        if self.unavailable is not None and wants_gpu:
            message = f"gpuclean: no GPU to check: {self.unavailable}"
            if self.settings.require_gpu:
                pytest.fail(message + " (--gpuclean-require-gpu)", pytrace=False)
            pytest.skip(message)
        if applied.count is not None and applied.count > len(self.devices):
            pytest.skip(f"gpuclean: test needs {applied.count} GPU(s), found {len(self.devices)}")
        state.tolerance_mib, state.timeout = applied.tolerance_mib, applied.timeout
        record = self.found.new(item.nodeid, (item.location[0], (item.location[1] or 0) + 1))
        item.stash[records.TEST] = record
        state.devices = self.devices
        if self.locks is not None and self.devices:
            state.locks = self._lock_gpus(item, record, applied.count or len(self.devices))
            state.devices = tuple(d for d in self.devices if d.uuid in state.locks.uuids)
        elif applied.count is not None:
            state.devices = self.devices[: applied.count]
        record.devices = tuple(d.uuid for d in state.devices)
        if applied.count is not None:
            state.previous_visible = ("CUDA_VISIBLE_DEVICES" in os.environ,
                                      os.environ.get("CUDA_VISIBLE_DEVICES"))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in state.devices)
        self._ray_before(state, record)
        result = self.checker.check("setup", state.devices, tolerance_mib=state.tolerance_mib,
                                    timeout=state.timeout)
        record.before = result
        record.before_s = result.waited_s
        self._note_own_context(result)
        self._attribute_earlier(result.reaped, state, result.notes)
        state.torch_before = _torch_allocated()
        if not result.clean:
            pytest.fail(report.check_report(result, report.not_clean_heading("setup", result, state.timeout)),
                        pytrace=False)
        item.stash[_CLEAN_GPUS] = CleanGpus(tuple(
            DeviceState(s.device.index, s.device.uuid, s.device.name, s.used_bytes, s.total_bytes)
            for s in result.devices))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None
                                ) -> Generator[None, None, None]:
        # tryfirst makes this wrapper the outermost, so the code after ``yield`` runs after every
        # fixture (and every other plugin's teardown) has finished.
        state = item.stash.get(_STATE, None)
        self._tearing_down = state
        try:
            outcome: BaseException | None = None
            try:
                yield
            except BaseException as exc:  # keep the fixture's own teardown error; ours is added to it
                outcome = exc
            record = item.stash.get(records.TEST, None) if state is not None and state.checked else None
            failure = self._after(item, state, record) if state is not None and record is not None else None
        finally:
            self._tearing_down = None
            if state is not None:
                self._end_test(state)
        if outcome is not None:
            if failure:
                item.add_report_section("teardown", "gpuclean", failure)
            raise outcome
        if failure:
            pytest.fail(failure, pytrace=False)

    def _after(self, item: pytest.Item, state: _ItemState, record: TestRecord) -> str | None:
        if record.before is None or not record.before.clean:
            return None  # the test never ran on clean GPUs: its setup error already says why
        ray_failure = self._ray_after(state, record)
        local_failure = self._after_local(item, state, record)
        return "\n\n".join(f for f in (ray_failure, local_failure) if f) or None

    def _after_local(self, item: pytest.Item, state: _ItemState, record: TestRecord) -> str | None:
        result = self.checker.check("teardown", state.devices, tolerance_mib=state.tolerance_mib,
                                    timeout=state.timeout)
        own_tokens = {state.token, *state.fixture_tokens}
        # A dead session's debris is that session's leak, never this test's.
        own = [r for r in result.reaped if r.found_by != "dead session" and (
            r.owner is None or r.owner.kind not in ("test", "fixture")
            or self._token_of(r.owner) in own_tokens)]
        self._attribute_earlier([r for r in result.reaped if r not in own], state, result.notes)
        # This test's record keeps only what this test leaked; earlier tests' leaks went to theirs.
        result = dataclasses.replace(result, reaped=tuple(own))
        record.after = result
        record.after_s = result.waited_s
        torch_after = _torch_allocated()
        if state.torch_before is not None and torch_after is not None:
            grown = [(f"cuda:{i}", (torch_after.get(i, 0) - before) / MIB)
                     for i, before in state.torch_before.items() if torch_after.get(i, 0) > before]
            if grown:
                record.in_process_mib = grown
                growth = ", ".join(f"{d} +{m:.1f} MiB" for d, m in grown)
                warnings.warn(GpuCleanWarning(
                    f"{item.nodeid}: torch.cuda.memory_allocated grew during the test in the pytest process "
                    f"({growth}): tensors kept alive after the test"), stacklevel=1)
        leaked_offenders = [o for o in (*result.offenders, *result.lingered) if o.reason == "leaked"]
        if own or leaked_offenders:
            # The processes are reported even if reaping made everything clean: the test leaked them.
            return report.check_report(result, report.leak_heading(own, leaked_offenders,
                                                                   self.checker.reap_enabled))
        if not result.clean:
            return report.check_report(result, report.not_clean_heading("teardown", result, state.timeout))
        return None

    # ---- the Ray cluster (--gpuclean-ray): see cluster.py ----------------------------------------

    def _ray_before(self, state: _ItemState, record: TestRecord) -> None:
        if self.ray is None:
            return
        check = self.ray.check_cluster("setup", tolerance_mib=state.tolerance_mib, timeout=state.timeout)
        record.cluster_before = check
        result = self.ray.result(check)
        self._attribute_earlier(result.reaped, state, result.notes)
        if not result.clean:
            pytest.fail(report.check_report(result, "gpuclean: the Ray cluster is not clean before the test"),
                        pytrace=False)

    def _ray_after(self, state: _ItemState, record: TestRecord) -> str | None:
        if self.ray is None:
            return None
        check = self.ray.check_cluster("teardown", tolerance_mib=state.tolerance_mib, timeout=state.timeout)
        result = self.ray.result(check)
        own_tokens = {state.token, *state.fixture_tokens}
        own = [r for r in result.reaped if r.owner is None or self._token_of(r.owner) in own_tokens]
        self._attribute_earlier([r for r in result.reaped if r not in own], state, result.notes)
        result = dataclasses.replace(result, reaped=tuple(own))
        record.cluster_after = dataclasses.replace(check, reaped=tuple(r for r in check.reaped
                                                                       if r.reaped in own))
        leaked = [o for o in result.offenders if o.reason == "leaked"]
        if own or leaked:
            return report.check_report(result, report.leak_heading(own, leaked, self.ray.reap)
                                       + " on the Ray cluster")
        if not result.clean:
            return report.check_report(result, "gpuclean: the Ray cluster is not clean after the test")
        return None

    def _ray_sweep(self, *, include_session: bool) -> list[Reaped]:
        """The cluster's part of the final sweep: what the session left on the cluster, reaped."""
        if self.ray is None:
            return []
        try:
            check = self.ray.sweep(include_session=include_session, timeout=self.settings.timeout)
        except Exception as exc:  # the session is over: say what went wrong, lose nothing else
            self.found.note(f"session end: the sweep of the Ray cluster failed: {exc!r}")
            sys.stderr.write(f"gpuclean: the sweep of the Ray cluster failed: {exc!r}\n")
            return []
        self.found.cluster_sweeps.append(check)
        reaped = [r.reaped for r in check.reaped]
        if include_session and (reaped or not check.clean):
            # After the reports: say it where the user looks.
            sys.stderr.write("gpuclean: the Ray cluster at the very end: " + "; ".join(
                [f"reaped pid {r.reaped.process.pid} "
                 f"{'by ray.kill' if r.via == 'ray.kill' else r.reaped.how_ended} "
                 f"({report.one_line(r.reaped.process.cmdline, 80)})" for r in check.reaped]
                + [report.one_line(f.offender.detail or str(f.offender.process), 120)
                   for f in check.findings]) + "\n")
        return reaped

    def _end_test(self, state: _ItemState) -> None:
        ownership = self.checker.ownership
        ownership.close_window(state.token)
        _restore_env(COOKIE_VAR, state.previous_cookie[0])
        _restore_env(OWNER_VAR, state.previous_cookie[1])
        if state.previous_visible is not None:
            was_set, value = state.previous_visible
            _restore_env("CUDA_VISIBLE_DEVICES", value if was_set else None)
        if state.locks is not None:
            state.locks.release()
            state.locks = None
            for notice in take_notices():
                self.found.note(notice, once=True)

    def _lock_gpus(self, item: pytest.Item, record: TestRecord, wanted: int) -> HeldLocks:
        assert self.locks is not None
        waiting: list[bool] = []

        def on_wait(holders: dict[str, dict[str, object]]) -> None:
            waiting.append(True)
            self._say(f"gpuclean: {item.nodeid} waits for GPU lock(s) held by: {describe_holders(holders)}")

        try:
            held = self.locks.acquire([d.uuid for d in self.devices], wanted, self.settings.lock_timeout,
                                      item.nodeid, on_wait=on_wait)
        except LockTimeout as exc:
            # A finding, not a skip: the test never ran on GPUs it could call its own.
            record.lock_wait_s = exc.waited_s
            record.lock_timeout = str(exc)
            if waiting:
                self._say(f"gpuclean: {item.nodeid} gave up waiting for GPU lock(s) after "
                          f"{exc.waited_s:.1f}s")
            raise pytest.fail.Exception(f"gpuclean: could not lock the GPUs: {exc}", pytrace=False) from None
        except OSError as exc:  # the lock directory became unusable (full, removed, a planted link)
            raise pytest.fail.Exception(f"gpuclean: {exc}", pytrace=False) from None
        record.lock_wait_s = held.waited_s
        if waiting:
            self._say(f"gpuclean: {item.nodeid} got GPU lock(s) {', '.join(held.uuids)} after "
                      f"{held.waited_s:.1f}s")
        return held

    def reap_crashed(self, nodeid: str) -> None:
        """Reap what a crashed xdist worker left (in the controller), blamed on the test it ran."""
        reaped, notes = self.checker.reap_dead_sessions(self.devices)
        for r in reaped:
            self.found.found_later(r, otherwise=nodeid)
        for note in notes:
            self.found.note(f"gpuclean: {note} (crashed while running {nodeid})")

    def _say(self, line: str) -> None:
        # Shown while the session waits (a lock can take minutes), not only in the final report: past
        # the output capture, which would otherwise file it under the test's "Captured stdout setup".
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)

    def _token_of(self, owner: Owner) -> str | None:
        for token, candidate in self.checker.ownership.owners.items():
            if candidate is owner:
                return token
        return None

    def _attribute_earlier(self, reaped: list[Reaped] | tuple[Reaped, ...], state: _ItemState,
                           notes: tuple[str, ...] = ()) -> None:
        # A leak of an earlier (e.g. unmarked) test, or of a session that died, found now: blame the test
        # that spawned it, and let the finder go on if reaping made things clean.
        for r in reaped:
            self.found.found_later(r)
            origin = next((n for n in notes if n.startswith(f"pid {r.process.pid}: left by ")), None)
            if origin is not None:
                self.found.note(f"gpuclean: {origin}, spawned by {r.owner}: reaped ({r.how_ended})")
            warnings.warn(GpuCleanWarning(
                f"gpuclean: pid {r.process.pid} ({report.one_line(r.process.cmdline, 80)}) was leaked by "
                f"{r.owner} and reaped ({r.how_ended}) before {state.nodeid}"
                + (f"; {origin}" if origin else "")),
                stacklevel=1)

    def _note_own_context(self, result: CheckResult) -> None:
        if result.self_mib and not self.warned_own_context:
            self.warned_own_context = True
            self._note_own(f"holds a CUDA context ({report.mib_list(result.self_mib)})")
        if result.self_cuda_only and not self.warned_own_cuda:
            self.warned_own_cuda = True
            self._note_own(f"initialised CUDA without a context ({', '.join(result.self_cuda_only)}: a few "
                           "MiB the driver charges to no process)")

    def _note_own(self, what: str) -> None:
        message = f"gpuclean: this pytest process (pid {os.getpid()}) {what}; it is not counted as a leak"
        self.found.note(message)
        warnings.warn(GpuCleanWarning(message), stacklevel=1)


_CLEAN_GPUS = pytest.StashKey[CleanGpus]()


@pytest.fixture
def clean_gpus(request: pytest.FixtureRequest) -> CleanGpus:
    """The devices under check for this test, as found clean by gpuclean's setup check.

    Requesting this fixture checks the test like the ``needs_clean_gpus`` marker does.
    """
    found: CleanGpus | None = request.node.stash.get(_CLEAN_GPUS, None)
    if found is None:
        pytest.skip("gpuclean is not checking this session (xdist controller or disabled)")
    return found


class _IdleSession:
    """Stands in for the plugin in a session whose collection found nothing to check, so that the session
    pays for one hook per test, not for each of the plugin's. A test that is checked after all (a marker
    added by another plugin while the test is set up) starts the session and brings the plugin back."""

    def __init__(self, plugin: GpuCleanPlugin) -> None:
        self.plugin = plugin

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        plugin = self.plugin
        if not plugin._should_check(item):
            return (yield)
        manager = plugin.config.pluginmanager
        manager.unregister(self)
        manager.register(plugin, PLUGIN_NAME)  # its hooks from the next call on; this one it joins here
        inner = plugin.pytest_runtest_setup(item)
        next(inner)  # starts the session and checks the GPUs (or fails the setup)
        try:
            result = yield
        except BaseException as exc:
            try:
                inner.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            raise
        try:
            inner.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        raise RuntimeError("gpuclean: the setup wrapper did not end")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.plugin.sweep(session)  # (nothing to sweep: what an xdist worker sends back all the same)


class XdistHooks:
    """Hooks that exist only with pytest-xdist: collect each worker's findings in the controller."""

    def __init__(self, plugin: GpuCleanPlugin) -> None:
        self.plugin = plugin

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: Any, sched: Any) -> None:
        # A worker died while running ``crashitem`` (a segfault, os._exit): its leaks were adopted by us,
        # the controller, and no worker's check would blame them on the right test. Reap them now, so
        # that no later test runs on dirty GPUs, and put them in the crashed test's record.
        self.plugin.reap_crashed(crashitem)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        payload = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT_KEY)
        if payload:
            from pytest_gpuclean.records import of

            of(self.plugin.config).add_worker(payload)


def _quiet_interrupts(hurry: threading.Event) -> Any:
    """Make SIGINT/SIGTERM set ``hurry`` instead of raising, until the returned function is called.

    During the final sweep a second Ctrl-C (or the job runner's SIGTERM) must shorten the grace, not
    abandon the leaks and the reports.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, frame: Any) -> None:
        hurry.set()

    for sig in previous:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _die_of(signum: int) -> None:
    # Registered when SIGTERM interrupted the session: everything is written, now exit the way the
    # sender expects (status 128 + 15 in a shell), not as an interrupted pytest.
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _start_ray(resolved: settings.Settings, checker: Checker) -> Any:
    # Ray (and cluster.py, which drives it) is loaded only when the option asks for a cluster.
    if resolved.ray == "off":
        return None
    from pytest_gpuclean import cluster

    address = cluster.resolve_address(resolved.ray)
    if address is None:
        return None
    check = cluster.RayCheck(address, checker.ownership, reap=resolved.reap == "on", grace=resolved.grace)
    try:
        check.start(resolved.timeout)
    except cluster.ClusterError as exc:
        source = resolved.sources.get("ray", "")
        raise pytest.UsageError(f"--gpuclean-ray: {exc} ({source})") from None
    return check


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
