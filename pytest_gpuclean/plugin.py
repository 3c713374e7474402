"""pytest-gpuclean's pytest plugin (the ``pytest11`` entry point): a clean-GPU gate before and after each
marked test, and the reaping of what a test leaked.

The hooks delegate to the session (``_session/checked.py``) and each test's check (``_session/guard.py``).
It starts lazily, at the end of the collection and only if a test is checked: hence the function-level
imports. Until then it only validates its options and exports the session's cookie."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpuclean import _settings as settings
from pytest_gpuclean import hookspecs
from pytest_gpuclean._ownership.cookie import (
    COOKIE_VAR,
    OWNER_VAR,
    SESSION_NAME,
    SESSION_TOKEN,
    WORKERS_SINCE_VAR,
    cookie,
    new_session_id,
    restore_env,
)
from pytest_gpuclean._reading import procfs
from pytest_gpuclean._session.names import (
    FIXTURE,
    FORKED_REPORT_ATTR,
    FORKING_PLUGINS,
    MARKER,
    PLUGIN_NAME,
    WORKER_OUTPUT_KEY,
    ExportedCookie,
)
from pytest_gpuclean._session.names import (
    GpuCleanWarning as GpuCleanWarning,  # public here too: -W error::pytest_gpuclean.plugin.GpuCleanWarning
)

if TYPE_CHECKING:
    from pytest_gpuclean._model.records import CleanGpus, Reaped
    from pytest_gpuclean._reading.backends import Backend
    from pytest_gpuclean._session.checked import CheckedSession
    from pytest_gpuclean._session.guard import TestGuard
    from pytest_gpuclean._session.signals import SigtermAsInterrupt


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


_COOKIE = pytest.StashKey[ExportedCookie]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before any conftest is imported, so what a conftest or plugin starts carries the cookie: a daemon
    # that double-forks before we are a subreaper is still known as the session set-up's.
    _export_cookie(early_config)


def _export_cookie(config: pytest.Config) -> ExportedCookie:
    exported = config.stash.get(_COOKIE, None)
    if exported is None:
        # A cookie already set (a CI job's, or the test of an outer pytest session) prefixes ours, so
        # `gpuclean reap --cookie <job>` and the outer session still recognise everything we spawn.
        inherited = os.environ.get(COOKIE_VAR)
        exported = ExportedCookie(new_session_id(inherited, *procfs.self_identity()), inherited,
                                  procfs.boot_ticks_now(), (inherited, os.environ.get(OWNER_VAR)),
                                  procfs.last_pid())
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
    if resolved.simulate:
        _check_simulated(resolved)
    plugin = _GpuCleanPlugin(config, resolved)
    if not hasattr(config, "workerinput"):  # an xdist worker's would repeat its controller's
        # Notes, not config-time warnings: -W error would turn one into an INTERNALERROR before any test.
        plugin.notes.extend(f"gpuclean: {line}" for line in settings.unknown_variables(os.environ))
    config.pluginmanager.register(plugin, PLUGIN_NAME)
    config.add_cleanup(plugin.close)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(plugin), PLUGIN_NAME + "-xdist")
    if resolved.ray != "off":
        # Idle until a session starts checking; imported only with the option.
        from pytest_gpuclean.ray import hooks
        config.pluginmanager.register(hooks.RayHooks(), hooks.PLUGIN_NAME)
    if resolved.report:
        # Check the report's path now, and write it even if no test is checked.
        plugin.register_outputs()


def _check_simulated(resolved: settings.Settings) -> None:
    """A ``--gpuclean-simulate`` directory without devices (a typo) is a usage error in every session:
    otherwise the checked tests would be skipped, a green run that checked nothing."""
    from pytest_gpuclean._reading.simulated_layout import device_indices, no_device
    assert resolved.simulate is not None
    try:
        found = device_indices(resolved.simulate)
    except OSError:
        return  # unreadable: the backend says so, in the same words, when it opens it
    if not found:
        raise pytest.UsageError(resolved.refused("simulate", no_device(resolved.simulate)))


def _check_device_list(config: pytest.Config, resolved: settings.Settings) -> Backend | None:
    """Check an explicit ``--gpuclean-devices`` at the session's start, in every session: raised later, the
    usage error would print after the summary. Returns the opened backend (NVML's start is slow) for the
    session to go on with; None without the option, in an xdist worker, or without a driver."""
    if not resolved.explicit("devices") or hasattr(config, "workerinput"):
        return None
    from pytest_gpuclean._reading import devices
    from pytest_gpuclean._session.opening import open_devices, select_devices
    try:
        backend = open_devices(resolved)
    except devices.BackendUnavailable:
        return None
    try:
        select_devices(backend, resolved)
    except BaseException:
        backend.close()
        raise
    return backend


class _GpuCleanPlugin:
    """The session's hooks; they delegate to the started session (``checked.CheckedSession``)."""

    def __init__(self, config: pytest.Config, resolved: settings.Settings) -> None:
        self.config = config
        self.settings = resolved
        self.pid = os.getpid()
        """The session's own process: a forked child of it runs one test."""
        self.session: CheckedSession | None = None
        """Set at the end of the collection; in an xdist controller, at session start."""
        self.tests: TestGuard | None = None
        self.controller = False
        self._workers_since: tuple[str | None] | None = None
        """An xdist controller: what ``WORKERS_SINCE_VAR`` was before it set it."""
        self._swept = False
        self._opened: Backend | None = None
        """Opened by ``_check_device_list``; closed at the collection's end unless the session starts."""
        self._interrupted = False
        """Ctrl-C or SIGTERM: the sweep says at once what it waits for."""
        self.notes: list[str] = []
        """Start-up notes (an unknown ``GPUCLEAN_`` variable): in the header, summary and JSON report."""
        self._notes_shown = False
        self._sigterm: SigtermAsInterrupt | None = None
        # Exported already, unless a conftest's pytest_plugins registered this plugin late.
        self._cookie = _export_cookie(config)
        if resolved.report:
            self._install_sigterm()  # a cancelled job still gets its report

    @property
    def started(self) -> bool:
        return self.session is not None

    def start(self) -> None:
        """Set up what checking needs; once. Raises ``pytest.UsageError`` for an unusable device list or
        lock directory."""
        if self.session is not None:
            return
        opening = None
        if not self.settings.simulate and self._opened is None:
            # NVML starts in a thread while the checking code is imported.
            from pytest_gpuclean._reading.nvml import NvmlOpening
            opening = NvmlOpening()
        from pytest_gpuclean._session.checked import CheckedSession  # psutil and the checking code
        from pytest_gpuclean._session.guard import TestGuard

        backend, self._opened = self._opened, None
        self.session = CheckedSession(self.config, self.settings, self._cookie, self.pid, opening, backend)
        self.tests = TestGuard(self.session)
        for line in self.notes:
            self.session.records.note(line, once=True)
        self._install_sigterm()
        self.register_outputs()
        manager = self.config.pluginmanager
        if {getattr(p, "__name__", None) for p in manager.get_plugins()} & FORKING_PLUGINS:
            manager.register(_ForkedHooks(self), PLUGIN_NAME + "-forked")

    def register_outputs(self) -> None:
        """Register the JSON report, JUnit and GitHub outputs (checks the report path)."""
        from pytest_gpuclean._session.outputs import OutputHooks, PerTestOutputs
        manager = self.config.pluginmanager
        outputs = manager.get_plugin(PLUGIN_NAME + "-outputs")
        if outputs is None:
            outputs = OutputHooks(self)
            manager.register(outputs, PLUGIN_NAME + "-outputs")
        # Again at an xdist controller's start (known to be one only then), if the report registered
        # them at configure.
        per_test = PLUGIN_NAME + "-outputs-tests"
        if outputs.per_test() and manager.get_plugin(per_test) is None:
            manager.register(PerTestOutputs(outputs), per_test)

    def _install_sigterm(self) -> None:
        if self._sigterm is None:
            from pytest_gpuclean._session.signals import SigtermAsInterrupt
            self._sigterm = SigtermAsInterrupt()
        self._sigterm.install()

    def close(self) -> None:
        try:
            late = self.session.close(controller=self.controller) if self.session is not None else []
            if late:
                self._report_late(late)
            ended = self.session.helpers_ended if self.session is not None else []
            if ended:
                self._say_last(f"gpuclean: ended {len(ended)} helper process(es) of the pytest process at "
                               "the session's end (--gpuclean-helpers; not leaks): "
                               + ", ".join(f"pid {r.process.pid} {r.how_ended}" for r in ended))
            older = self.session.left_alone if self.session is not None else []
            if older:
                # Said once, so that nobody wonders why gpuclean left them.
                from pytest_gpuclean.report.terminal import one_line
                self._say_last(f"gpuclean: left alone {len(older)} process(es) under pytest that are no part "
                               "of the session (they, or the process that started them, existed before it): "
                               + ", ".join(f"pid {p.pid} ({one_line(p.cmdline, 60)})" for p in older))
        finally:
            self._close_rest()

    def _close_opened(self) -> None:
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.close()

    def _say_last(self, line: str) -> None:
        # An xdist worker's terminal goes nowhere; its stderr reaches the controller's.
        reporter = (None if hasattr(self.config, "workerinput")
                    else self.config.pluginmanager.get_plugin("terminalreporter"))
        if reporter is not None:
            reporter.write_line(line)
        else:
            sys.stderr.write(line + "\n")

    def _report_late(self, late: list[Reaped]) -> None:
        # The very last sweep runs after the summary and the report (a pytest_unconfigure may still stop
        # what it started): its line comes last, and the report is written again with it.
        from pytest_gpuclean.report.terminal import set_up_reaped_line
        self._say_last(set_up_reaped_line(late))
        outputs = self.config.pluginmanager.get_plugin(PLUGIN_NAME + "-outputs")
        if outputs is not None:
            outputs.add_late(late)

    def _close_rest(self) -> None:
        self._close_opened()
        restore_env(COOKIE_VAR, self._cookie.previous[0])
        restore_env(OWNER_VAR, self._cookie.previous[1])
        if self._workers_since is not None:
            restore_env(WORKERS_SINCE_VAR, self._workers_since[0])
        if self.session is not None:
            self.session.close_backend()
        if self._sigterm is not None:
            self._sigterm.uninstall()

    # ---- session ---------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # The xdist controller collects nothing, so it starts now, before it spawns the workers: as their
        # subreaper it adopts what a crashed worker leaves, and it checks the options for all of them.
        self.controller = session.config.pluginmanager.hasplugin("dsession")
        if not self.controller:
            self._opened = _check_device_list(self.config, self.settings)
        if self.controller:
            self.start()
            # Just before xdist starts the workers (its sessionstart is trylast): tells each worker which
            # of the controller's children are sibling workers and which a conftest started.
            self._workers_since = (os.environ.get(WORKERS_SINCE_VAR),)
            os.environ[WORKERS_SINCE_VAR] = str(procfs.boot_ticks_now())
            assert self.session is not None
            self.session.share_outside()

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # With a report, the session starts even if nothing is marked: what unmarked tests leave behind
        # is reaped and reported.
        if self.started or self.controller:
            return
        if session.config.option.collectonly or (
                session.testsfailed and not session.config.option.continue_on_collection_errors):
            self._close_opened()
            return
        if self.settings.report or any(self._should_check(item) for item in session.items):
            self.start()
        else:
            self._close_opened()
            # Off the per-test hooks, for one that notices a test checked after all.
            session.config.pluginmanager.unregister(self)
            session.config.pluginmanager.register(_IdleSession(self), PLUGIN_NAME + "-idle")

    # tryfirst: pytest prints header lines in reverse call order, so ours come after rootdir: and plugins:.
    @pytest.hookimpl(tryfirst=True)
    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        self._notes_shown = True
        return [*self.notes, *(self.session.header_lines() if self.session is not None else [])]

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        # The header, for a session that started at the collection's end (xdist's workers).
        if self.session is None or self.controller or config.option.no_header:
            return []
        return self.session.header_lines() if config.get_verbosity() >= 0 else []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.sweep(session)

    @pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_sessionfinish")
    def sessionfinish_guard(self, session: pytest.Session) -> Generator[None, None, None]:
        # When another pytest_sessionfinish raises, pluggy skips the rest, ours included: this sweeps anyway.
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
        if self.tests is not None:
            self.tests.release_parked()  # locks kept for a test that never ran (-x, an interrupt)
        if self.session is not None:
            self.session.sweep(interrupted=self._interrupted)
        if worker_output is not None:
            from pytest_gpuclean._session.store import EMPTY_PAYLOAD
            found = self.session.records.payload() if self.session is not None else dict(EMPTY_PAYLOAD)
            worker_output[WORKER_OUTPUT_KEY] = found

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # Also called for pytest.exit, which is no interrupt.
        self._interrupted = isinstance(excinfo.value, KeyboardInterrupt)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.session is None:
            self.summarise_notes(terminalreporter)
            return
        merged = self.session.records.merged()
        if not merged.records and not merged.session_reaped and not merged.notes:
            return
        from pytest_gpuclean.report.terminal import SUMMARY_TITLE, summary_lines
        terminalreporter.write_sep("=", SUMMARY_TITLE)
        extension = self.config.hook.pytest_gpuclean_summary_parts
        for line in summary_lines(merged.records, merged.session_reaped, merged.notes,
                                  more_parts=lambda record: [
                                      part for parts in extension(record=record) for part in parts]):
            terminalreporter.write_line(line)

    def summarise_notes(self, terminalreporter: Any) -> None:
        """A session that did not start: its notes, where the header did not show them (``-q``)."""
        if not self.notes or self._notes_shown:
            return
        from pytest_gpuclean.report.terminal import SUMMARY_TITLE
        terminalreporter.write_sep("=", SUMMARY_TITLE)
        for line in self.notes:
            terminalreporter.write_line(line)

    # ---- fixtures owned by a scope wider than a test ----------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
                             ) -> Generator[None, Any, Any]:
        if fixturedef.scope == "function" or self.controller or self.tests is None:
            return (yield)
        with self.tests.fixture_window(fixturedef):
            return (yield)

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any],
                                      request: pytest.FixtureRequest) -> None:
        if self.tests is not None:
            self.tests.fixture_finalized(fixturedef)

    # ---- around each test -------------------------------------------------------------------------

    def _should_check(self, item: pytest.Item) -> bool:
        return self._marked(item)[0]

    def _marked(self, item: pytest.Item) -> tuple[bool, pytest.Mark | None]:
        """Whether ``item`` is checked, and its marker (the check's settings come from it too)."""
        if self.controller:
            return False, None
        marker = item.get_closest_marker(MARKER)
        checked = self.settings.all or marker is not None or FIXTURE in getattr(item, "fixturenames", ())
        return checked, marker

    # trylast: the innermost wrapper. Our check may fail the setup before ``yield``, and wrappers
    # outside us (logging, capture) must have run their own setup so that their teardown finds it.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        checked, marker = self._marked(item)
        if self.session is None:
            if not checked:
                return (yield)
            # A marker added since the collection.
            self.start()
        assert self.tests is not None
        self.tests.setup(item, checked=checked, marker=marker)
        return (yield)

    # tryfirst: the outermost wrapper, so the check runs after every fixture and plugin's teardown.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None
                                ) -> Generator[None, None, None]:
        if self.tests is None:
            return (yield)
        return (yield from self.tests.teardown(item, has_next=nextitem is not None))

    def reap_crashed(self, nodeid: str | None) -> None:
        """In the controller: reap what a crashed worker left, blamed on ``nodeid`` (None: on the test each
        process names)."""
        if self.session is not None:
            self.session.reap_crashed(nodeid)


@pytest.fixture
def clean_gpus(request: pytest.FixtureRequest) -> CleanGpus:
    """The devices under check for this test, as found clean by gpuclean's setup check.

    Requesting this fixture checks the test like the ``needs_clean_gpus`` marker does.
    """
    # Here, not at the top: a session that checks nothing imports neither.
    from pytest_gpuclean._model.records import CleanGpus, DeviceState
    from pytest_gpuclean._session.store import TEST
    record = request.node.stash.get(TEST, None)
    if record is None or record.before is None:
        pytest.skip("gpuclean is not checking this session (xdist controller or disabled)")
    return CleanGpus(tuple(DeviceState(s.device.index, s.device.uuid, s.device.name, s.used_bytes,
                                       s.total_bytes) for s in record.before.devices))


class _IdleSession:
    """Stands in for the plugin when nothing is to be checked: one hook per test, not all of the plugin's.
    A test checked after all (a marker added late) starts the session and brings the plugin back."""

    def __init__(self, plugin: _GpuCleanPlugin) -> None:
        self.plugin = plugin

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        plugin = self.plugin
        if not plugin._should_check(item):
            return (yield)
        manager = plugin.config.pluginmanager
        manager.unregister(self)
        manager.register(plugin, PLUGIN_NAME)  # its hooks from the next call on; this one it joins here
        return (yield from plugin.pytest_runtest_setup(item))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.plugin.sweep(session)  # nothing to sweep, but an xdist worker must send its payload

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        self.plugin.summarise_notes(terminalreporter)


class _ForkedHooks:
    """Hooks for tests run in a forked child (pytest-forked, pytest-isolate); registered only with those."""

    def __init__(self, plugin: _GpuCleanPlugin) -> None:
        self.plugin = plugin

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        session = self.plugin.session
        if session is not None and not self.plugin.controller:
            session.announce(nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        test_report = yield
        session = self.plugin.session
        if call.when == "teardown" and session is not None and os.getpid() != self.plugin.pid:
            # The child's memory dies with it: its records travel on the teardown report.
            setattr(test_report, FORKED_REPORT_ATTR, session.records.ship())
        return test_report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        shipped = getattr(report, FORKED_REPORT_ATTR, None)
        session = self.plugin.session
        # The xdist controller gets the same report from a worker, which already merged it.
        if shipped is not None and session is not None and not self.plugin.controller \
                and os.getpid() == self.plugin.pid:
            session.receive_forked(shipped)


class _XdistHooks:
    """Hooks that exist only with pytest-xdist: collect each worker's findings in the controller."""

    def __init__(self, plugin: _GpuCleanPlugin) -> None:
        self.plugin = plugin
        self._ready: set[int] = set()
        """``id`` of xdist's nodes: those that started, and (``_heard``) those whose findings arrived."""
        self._heard: set[int] = set()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodeready(self, node: Any) -> None:
        self._ready.add(id(node))

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: Any, sched: Any) -> None:
        # We, the controller, adopted the dead worker's leaks, and no worker's check would blame the
        # right test: reap them now, before a later test runs on dirty GPUs.
        self.plugin.reap_crashed(crashitem)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self._take(node)

    def _stream(self, test_report: Any) -> None:
        """A test's record on a report xdist never handed on."""
        from pytest_gpuclean._session.outputs import RECORD_ATTRIBUTE
        record = getattr(test_report, RECORD_ATTRIBUTE, None)
        if record is not None and test_report.when in ("setup", "teardown"):
            from pytest_gpuclean._session.store import of
            of(self.plugin.config).stream(test_report.nodeid, record)

    def _take(self, node: Any) -> None:
        payload = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT_KEY)
        if payload and id(node) not in self._heard:
            from pytest_gpuclean._session.store import of
            self._heard.add(id(node))
            of(self.plugin.config).add_worker(payload)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # After xdist's own. An interrupted controller stops reading its workers' events before they end,
        # so their findings sit unread in xdist's queue: take them from there. A worker that never sent
        # them (killed) is reaped as a crashed one.
        if not self.plugin.controller:
            return
        dsession = session.config.pluginmanager.get_plugin("dsession")
        events = getattr(dsession, "queue", None)
        while events is not None:
            try:
                name, kwargs = events.get_nowait()
            except Exception:  # queue.Empty
                break
            if name == "workerfinished":
                self._take(kwargs.get("node"))
            elif name == "testreport":
                self._stream(kwargs.get("rep"))
        if self._ready - self._heard:
            self.plugin.reap_crashed(None)
