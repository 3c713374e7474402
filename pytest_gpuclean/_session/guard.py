"""Each test's check, from its setup to the end of its teardown: the marker's settings, the GPU locks, the
check before, the check after every fixture is torn down, and whose leak is whose."""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._locks.describe import describe_holders
from pytest_gpuclean._locks.directory import take_notices
from pytest_gpuclean._locks.gpus import LockTimeout
from pytest_gpuclean._model.outcomes import split_own
from pytest_gpuclean._model.records import (
    MIB,
    CheckResult,
    FixtureLeak,
    HealthFinding,
    Offender,
    OutsideAction,
    Phase,
    TestRecord,
)
from pytest_gpuclean._ownership.cookie import COOKIE_VAR, OWNER_VAR, restore_env
from pytest_gpuclean._ownership.evidence import fixture_owner
from pytest_gpuclean._session import store
from pytest_gpuclean._session.names import FIXTURE, MARKER, GpuCleanWarning
from pytest_gpuclean._session.torch_growth import TorchGrowth, torch_allocated
from pytest_gpuclean.report import terminal

if TYPE_CHECKING:
    from pytest_gpuclean._locks.held import HeldLocks
    from pytest_gpuclean._model.records import DeviceInfo, LockHolder
    from pytest_gpuclean._session.checked import CheckedSession


_EXTENSION_HOOKS = ("pytest_gpuclean_check_before", "pytest_gpuclean_check_after", "pytest_gpuclean_checked")


class TestState:
    """A test's state from its setup to the end of its teardown."""

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


class TestGuard:
    """The checks around each test of a started session."""

    def __init__(self, session: CheckedSession) -> None:
        self.session = session
        managed = session.checker.census.managed
        # A process whose handle a live fixture's value holds is that fixture's (asked only on a leak).
        managed.fixture_values = self.live_fixture_values
        # What a test module or conftest keeps in a global is the suite's doing, no library's helper.
        managed.suite_files = (*session.config.getini("python_files"), "conftest.py")
        self._fixture_tokens: dict[int, str] = {}
        self._fixture_defs: dict[str, pytest.FixtureDef[Any]] = {}
        """Token -> the fixture it was made for, until the check after the fixture ended."""
        self._tearing_down: TestState | None = None
        self._current: tuple[pytest.Item, TestState] | None = None
        """The test being run and its state. Not in the item's stash: every item lives to the session's
        end, and full garbage collections walk what it keeps."""
        self._parked: HeldLocks | None = None
        """The last test's GPU locks, kept for the next test's setup to take or let go."""
        self._candidates = tuple([d.uuid for d in session.devices])
        """What each test may lock."""
        self._by_locks: dict[tuple[str, ...], tuple[tuple[DeviceInfo, ...], tuple[str, ...]]] = {}
        self._known: dict[tuple[int, int], str] = {}
        """(pid, start ticks) -> who leaked it, for leaks left with reaping off: a later check that finds
        only these does not wait, and its test is skipped (``_blocked``)."""
        self._excused: set[tuple[int, int]] = set()
        """Session-owned processes whose GPU memory a check excused: said once each."""
        self._count_told = False
        self._warned_own_context = False
        self._warned_own_cuda = False
        self._torch_growth = TorchGrowth(session.records.note_replacing)
        """Tests whose in-process torch growth stayed within the floor (a session note)."""
        hook = session.config.hook
        # gpuclean's extension hooks, called only where one implements them: empty calls would cost every
        # checked test.
        extended = any(getattr(hook, name).get_hookimpls() for name in _EXTENSION_HOOKS)
        self._hook: Any = hook if extended else None

    def setup(self, item: pytest.Item, *, checked: bool, marker: pytest.Mark | None) -> None:
        """Open the test's ownership window; if it is ``checked``, lock its GPUs and check them (fails or
        skips the setup)."""
        session = self.session
        session.follow_fork()
        nodeid = item.nodeid  # a property that builds the string on each use, under pytest 9
        token = session.test_token(nodeid)
        state = TestState(nodeid, token, session.set_owner_env(token))
        self._current = (item, state)
        if store.TEST in item.stash:
            del item.stash[store.TEST]  # a test run again (a rerun plugin) starts a new record
        session.checker.ownership.open_window(token)
        if not checked:
            self.release_parked()  # kept by the last test's teardown; this test is not checked
            return
        state.checked = True
        self._before(item, state, marker)

    def _before(self, item: pytest.Item, state: TestState, marker: pytest.Mark | None) -> None:
        session = self.session
        applied = self._applied(item, marker)
        state.tolerance_mib, state.timeout = applied.tolerance_mib, applied.timeout
        record = session.records.new(state.nodeid, (item.location[0], (item.location[1] or 0) + 1))
        item.stash[store.TEST] = record
        self._choose_devices(item, state, record, applied.count)
        unusable = self._health_before(item, state, record)
        if unusable:
            pytest.fail(unusable, pytrace=False)  # at once: waiting would not make the GPU usable
        # An extension's check first: what it ends, it ends its own way.
        hook = self._hook
        if hook is not None and (failures := hook.pytest_gpuclean_check_before(session=session, state=state,
                                                                               record=record)):
            pytest.fail("\n\n".join(failures), pytrace=False)
        result = session.checker.check("setup", state.devices, tolerance_mib=state.tolerance_mib,
                                       timeout=state.timeout, device_errors=True,
                                       where=state.nodeid, known=self._known)
        # Each helper only where the result has something for it: the clean path stays short.
        if result.device_lost:
            self._note_lost(record, result, "setup")
        record.before = result
        record.before_s = result.waited_s
        if session.checker.notices:
            session.take_notices()
        self._note_own_context(result, state.nodeid)
        if result.clean and any(s.processes for s in result.devices):
            self._note_excused(state, result)
        if result.reaped:
            session.attribute_earlier(result.reaped, state.nodeid, result.notes)
        if result.siblings:
            self._record_siblings(state, result)
        state.torch_before = torch_allocated()
        if result.error is not None:
            self._stop_if_lost(item, result)
            pytest.fail(terminal.check_report(result, terminal.unreadable_heading(result)), pytrace=False)
        if not result.clean:
            if self._known and (blocked := self._blocked(result)):
                # Its leaker's finding, known and left: a skip at once, not a wait and an error per test.
                record.blocked_by = tuple(dict.fromkeys(leaker for leaker, _ in blocked))
                held = ", ".join(f"pid {o.process.pid} ({terminal.mib_list(o.mib_per_device) or 'no memory'})"
                                 for _, o in blocked if o.process is not None)
                raise _skip(f"gpuclean: the GPUs hold what {' and '.join(record.blocked_by)} leaked and "
                            f"reaping is off: {held}; not run ({self._option_source('reap')})")
            self._remember_unreaped(result)
            heading = terminal.not_clean_heading("setup", result, state.timeout)
            if self._outside_action(item, record, result) == "skip":
                # At the test's own file:line in -rs, as pytest's skip markers are.
                raise _skip(f"{terminal.outside_line('setup', result, state.timeout)} "
                            f"({self._outside_source()})")
            pytest.fail(terminal.check_report(result, heading), pytrace=False)
        if hook is not None and (failures := hook.pytest_gpuclean_checked(session=session, state=state,
                                                                          record=record, phase="setup")):
            pytest.fail("\n\n".join(failures), pytrace=False)

    def _outside_action(self, item: pytest.Item, record: TestRecord, result: CheckResult
                        ) -> OutsideAction | None:
        """What the test gets (``--gpuclean-outside``) when every finding is from outside the session;
        ``stop`` stops the session after this test. None if something of the session's is dirty too."""
        if result.outside is None or not result.outside.only:
            return None
        action = self.session.settings.outside
        record.outside_action = action
        if action == "stop" and not item.session.shouldstop:
            item.session.shouldstop = (f"gpuclean: {terminal.outside_cause(result)} at {item.nodeid}; "
                                       f"stopping the session ({self._outside_source()})")
        return action

    def _outside_source(self) -> str:
        return self._option_source("outside")

    def _option_source(self, name: str) -> str:
        """``--gpuclean-reap=off, from the command line``: an option's value and where it came from."""
        value = getattr(self.session.settings, name)
        source = self.session.settings.sources.get(name, "the default")
        return f"{settings.option(name).cli}={value}, {source}"

    def _blocked(self, result: CheckResult) -> list[tuple[str, Offender]]:
        """Who leaked what a check found, if it found only leaks an earlier check left; else empty."""
        known = self._known
        found: list[tuple[str, Offender]] = []
        for o in result.offenders:
            leaker = known.get((o.process.pid, o.process.start_ticks)) if o.process is not None else None
            if leaker is None or o.reason != "leaked":
                return []
            found.append((leaker, o))
        return found if result.error is None and result.outside is None else []

    def _remember_unreaped(self, result: CheckResult) -> None:
        """With reaping off: remember the leaks ``result`` found and left, for ``_blocked``."""
        if self.session.checker.reap_enabled:
            return
        for o in result.offenders:
            owner = o.owner
            if o.reason == "leaked" and o.process is not None and owner is not None and (
                    owner.kind in ("test", "fixture")):
                self._known[(o.process.pid, o.process.start_ticks)] = (
                    owner.name if owner.kind == "test" else f"fixture {owner.name}")

    def _applied(self, item: pytest.Item, marker: pytest.Mark | None) -> settings.TestSettings:
        # The session's settings with the marker's applied; skips or fails a test that cannot be checked.
        session = self.session
        try:
            applied = settings.for_marker(session.settings, marker.kwargs if marker else {}, item.nodeid,
                                          marker.args if marker else ())
        except ValueError as exc:
            # ``from None``: failing inside ``except`` would print the message twice, chained.
            message = f"gpuclean: {exc} (from the {MARKER} marker)"
            raise pytest.fail.Exception(message, pytrace=False) from None
        wants_gpu = marker is not None or FIXTURE in getattr(item, "fixturenames", ())
        if session.unavailable is not None and wants_gpu:
            action, why = session.no_gpu
            message = f"gpuclean: no GPU to check: {session.unavailable}" + (f" ({why})" if why else "")
            if action == "fail":
                pytest.fail(message, pytrace=False)
            raise _skip(message)
        if applied.count is not None and applied.count > len(session.devices):
            raise _skip(f"gpuclean: test needs {applied.count} GPU(s), found {len(session.devices)}")
        return applied

    def _choose_devices(self, item: pytest.Item, state: TestState, record: TestRecord,
                        count: int | None) -> None:
        # Those it locked, else the first ``count``; with a count, the test sees exactly those.
        session = self.session
        if session.locks is not None and session.devices:
            state.locks = self._lock_gpus(item, record, count or len(session.devices))
            state.devices, record.devices = self._locked_devices(state.locks.uuids)
        else:
            state.devices = session.devices if count is None else session.devices[:count]
            record.devices = tuple([d.uuid for d in state.devices])
        if count is not None:
            state.previous_visible = ("CUDA_VISIBLE_DEVICES" in os.environ,
                                      os.environ.get("CUDA_VISIBLE_DEVICES"))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in state.devices)

    def _locked_devices(self, uuids: tuple[str, ...]) -> tuple[tuple[DeviceInfo, ...], tuple[str, ...]]:
        """The session's devices whose locks are held, in the session's order, and their UUIDs: the same
        tuples from test to test, shared by the records."""
        chosen = self._by_locks.get(uuids)
        if chosen is None:
            devices = tuple([d for d in self.session.devices if d.uuid in uuids])
            chosen = self._by_locks[uuids] = (devices, tuple([d.uuid for d in devices]))
        return chosen

    def _lock_gpus(self, item: pytest.Item, record: TestRecord, wanted: int) -> HeldLocks:
        session = self.session
        assert session.locks is not None
        waiting: list[bool] = []

        def on_wait(holders: dict[str, LockHolder]) -> None:
            waiting.append(True)
            session.say(f"gpuclean: {item.nodeid} waits for GPU lock(s) held by: {describe_holders(holders)}")

        parked, self._parked = self._parked, None
        try:
            held = session.locks.acquire(self._candidates, wanted,
                                         session.settings.lock_timeout, item.nodeid, on_wait=on_wait,
                                         parked=parked)
        except LockTimeout as exc:
            # A finding, not a skip: the test never ran on GPUs it could call its own.
            record.lock_wait_s = exc.waited_s
            record.lock_timeout = str(exc)
            if waiting:
                session.say(f"gpuclean: {item.nodeid} gave up waiting for GPU lock(s) after "
                            f"{exc.waited_s:.1f}s")
            raise pytest.fail.Exception(f"gpuclean: could not lock the GPUs: {exc}", pytrace=False) from None
        except OSError as exc:  # the lock directory became unusable (full, removed, a planted link)
            raise pytest.fail.Exception(f"gpuclean: {exc}", pytrace=False) from None
        record.lock_wait_s = held.waited_s
        if waiting:
            session.say(f"gpuclean: {item.nodeid} got GPU lock(s) {', '.join(held.uuids)} after "
                        f"{held.waited_s:.1f}s")
        return held

    def teardown(self, item: pytest.Item, *, has_next: bool) -> Generator[None, None, None]:
        """Around the test's teardown: after every fixture is torn down, check the GPUs; fails the teardown
        with what the test leaked. ``has_next``: the GPU locks may be kept for the next test."""
        current = self._current
        state = current[1] if current is not None and current[0] is item else None
        self._tearing_down = state
        try:
            outcome: BaseException | None = None
            try:
                yield
            except BaseException as exc:  # keep the fixture's own teardown error; ours is added to it
                outcome = exc
            record = item.stash.get(store.TEST, None) if state is not None and state.checked else None
            failure = self._after(item, state, record) if state is not None and record is not None else None
            if state is not None and state.fixture_tokens and not _checked_after(record):
                # A wider fixture ended here and no check after this test judges it: judged alone.
                failure = "\n\n".join(f for f in (failure, self._fixtures_alone(item, state, record)) if f)
        finally:
            self._tearing_down = None
            if state is not None:
                self._current = None
                # An interrupt or pytest.exit: the session ends, so nothing is kept.
                self._end(state, has_next and (outcome is None or isinstance(outcome, Exception)))
        if outcome is not None:
            if failure:
                item.add_report_section("teardown", "gpuclean", failure)
            raise outcome
        if failure:
            pytest.fail(failure, pytrace=False)

    def _after(self, item: pytest.Item, state: TestState, record: TestRecord) -> str | None:
        if record.before is None or not record.before.clean:
            return None  # the test never ran on clean GPUs: its setup error already says why
        session, hook = self.session, self._hook
        failures: list[str] = [] if hook is None else hook.pytest_gpuclean_check_after(
            session=session, state=state, record=record)
        local_failure = self._after_local(item, state, record)
        growth_failure = self._note_torch_growth(item, state, record)
        health_failure = self._health_after(item, state, record)
        if hook is not None:
            failures += hook.pytest_gpuclean_checked(session=session, state=state, record=record,
                                                     phase="teardown")
        return "\n\n".join(f for f in (*failures, local_failure, growth_failure, health_failure) if f) or None

    def _after_local(self, item: pytest.Item, state: TestState, record: TestRecord) -> str | None:
        session = self.session
        result = session.checker.check("teardown", state.devices, tolerance_mib=state.tolerance_mib,
                                       timeout=state.timeout, device_errors=True,
                                       where=state.nodeid)
        if result.device_lost:
            self._note_lost(record, result, "teardown")
        self._note_own_context(result, state.nodeid)
        if result.offenders:
            self._remember_unreaped(result)
        if result.reaped:
            own_tokens = {state.token, *state.fixture_tokens}
            # A dead session's debris is that session's leak, never this test's.
            own, earlier = split_own(result.reaped, lambda owner: session.token_of(owner) in own_tokens)
            session.attribute_earlier(earlier, state.nodeid, result.notes)
            # This test's record keeps only what this test leaked; earlier tests' leaks went to theirs.
            if len(own) != len(result.reaped):
                result = result._replace(reaped=tuple(own))
        # What a fixture that ended here left is its own finding: the test may not even use it.
        fixtures = self._fixture_leaks(item, state, result)
        mine = result
        if fixtures:
            record.fixture_leaks += tuple(fixtures)
            mine = _without(result, fixtures)
        record.after = mine
        record.after_s = result.waited_s
        if session.checker.notices:
            session.take_notices()
        if result.siblings:
            self._record_siblings(state, result)
        headings: list[str] = []
        if result.error is not None:
            self._stop_if_lost(item, result)
            headings.append(terminal.unreadable_heading(result))
        leaked_offenders = [o for o in (*mine.offenders, *mine.lingered) if o.reason == "leaked"] if (
            mine.offenders or mine.lingered) else []
        if mine.reaped or leaked_offenders:
            # The processes are reported even if reaping made everything clean: the test leaked them.
            headings.append(terminal.leak_heading(mine.reaped, leaked_offenders,
                                                  session.checker.reap_enabled))
        if fixtures:
            headings.extend(terminal.fixture_leak_heading(f, session.checker.reap_enabled) for f in fixtures)
        if headings:
            # Every process, each with who spawned it.
            return terminal.check_report(result, "\n".join(headings))
        if not result.clean:
            if self._outside_action(item, record, result) == "skip":
                # The test has run: another job's use of its GPUs is no failure of its, so a note (a
                # warning would fail it under -W error); the next test's setup check skips.
                line = terminal.outside_line("teardown", result, state.timeout).removeprefix("gpuclean: ")
                session.records.note(f"gpuclean: {item.nodeid}: {line}; the test has run: not failed "
                                   f"({self._outside_source()})")
                return None
            heading = terminal.not_clean_heading("teardown", result, state.timeout)
            return terminal.check_report(result, heading)
        return None

    def _fixtures_alone(self, item: pytest.Item, state: TestState, record: TestRecord | None) -> str | None:
        """Fixtures that ended at the teardown of a test no check judges: what they left, in this test's
        record (made for it if it was not checked; its outcome does not change)."""
        session = self.session
        result = session.checker.check_owned(set(state.fixture_tokens), session.devices)
        if result.offenders:
            self._remember_unreaped(result)
        if result.notes:
            for note in result.notes:
                session.records.note(f"gpuclean: {note} (at the teardown of {state.nodeid})", once=True)
        fixtures = self._fixture_leaks(item, state, result)
        if not fixtures:
            return None
        if record is None:
            record = session.records.record_for(state.nodeid)
            if not record.location[0]:
                record.location = (item.location[0], (item.location[1] or 0) + 1)
            item.stash[store.TEST] = record  # for its JUnit properties, and xdist's controller
        record.fixture_leaks += tuple(fixtures)
        heading = "\n".join(terminal.fixture_leak_heading(f, session.checker.reap_enabled) for f in fixtures)
        return terminal.check_report(result, heading)

    def _fixture_leaks(self, item: pytest.Item, state: TestState, result: CheckResult) -> list[FixtureLeak]:
        """What each fixture that ended at this teardown left behind, as that fixture's findings."""
        leaks: list[FixtureLeak] = []
        owners = self.session.checker.ownership.owners
        for token in state.fixture_tokens:
            owner, fixturedef = owners.get(token), self._fixture_defs.get(token)
            if owner is None or fixturedef is None:
                continue
            reaped = tuple(r for r in result.reaped if r.owner is owner)
            leaked = tuple(o for o in result.offenders if o.reason == "leaked" and o.owner is owner)
            lingered = tuple(o for o in result.lingered if o.reason == "leaked" and o.owner is owner)
            if not (reaped or leaked or lingered):
                continue
            # Only on a finding: inspect reads the code object.
            leaks.append(FixtureLeak(fixturedef.argname, fixturedef.scope,
                                     fixture_location(fixturedef, item.config.rootpath), state.nodeid,
                                     reaped, leaked, lingered))
        return leaks

    def _stop_if_lost(self, item: pytest.Item, result: CheckResult) -> None:
        # One line, once, instead of an error per later test on a GPU that is gone.
        if result.device_lost and not item.session.shouldstop:
            item.session.shouldstop = terminal.stop_line(result.error or "a GPU is lost")

    def _record_siblings(self, state: TestState, result: CheckResult) -> None:
        """Another xdist worker's process on a GPU whose lock this test held: a finding of the test that
        started it, once per process; the check's notes name it. Without locks the notes alone say it."""
        if not result.siblings or state.locks is None:
            return
        records = self.session.records
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        for use in result.siblings:
            if use.owner.kind != "test":  # a fixture or that worker's set-up: no test's record
                records.note(f"gpuclean: pid {use.process.pid} of {use.describe()} held "
                           f"{terminal.mib_list(use.mib_per_device)} while {state.nodeid} held the GPU lock",
                           once=True)
                continue
            record = records.record_for(use.owner.name)
            key = (use.process.pid, use.process.start_ticks)
            if all((u.process.pid, u.process.start_ticks) != key for u in record.gpu_without_lock):
                record.gpu_without_lock += (
                    use._replace(seen_by=state.nodeid, seen_worker=worker, phase=result.phase),)

    # ---- GPU health (_check/health.py) ---------------------------------------------------------------------

    def _health_before(self, item: pytest.Item, state: TestState, record: TestRecord) -> str | None:
        # A GPU found unusable earlier fails this setup with the reason.
        watch = self.session.health
        if watch is None:
            return None
        found = watch.before(state.nodeid, state.devices, item.session.testsfailed)
        if not found:
            return None
        record.health += tuple(found)
        self._stop_on_health_lost(item, found)
        return terminal.failure_text(found, "setup")

    def _health_after(self, item: pytest.Item, state: TestState, record: TestRecord) -> str | None:
        # The Xids that arrived during the test are its own; the slow reads where something points.
        watch = self.session.health
        if watch is None:
            return None
        reaped = record.after.reaped if record.after is not None else ()
        found = watch.after(state.nodeid, state.devices, reaped, item.session.testsfailed)
        if not found:
            return None
        record.health += tuple(found)
        self._stop_on_health_lost(item, found)
        return terminal.failure_text(found, "teardown")

    def _note_lost(self, record: TestRecord, result: CheckResult, phase: Phase) -> None:
        """A check found a GPU lost: also a health finding, so later checks know it."""
        lost = self.session.checker.last_lost
        watch = self.session.health
        if result.device_lost and lost is not None and watch is not None:
            record.health += (watch.lost_now(lost, phase),)

    @staticmethod
    def _stop_on_health_lost(item: pytest.Item, found: list[HealthFinding]) -> None:
        lost = next((f for f in found if f.effect == "lost"), None)
        if lost is not None and not item.session.shouldstop:
            # One line, not every later test waiting out its timeout on a GPU that is gone.
            item.session.shouldstop = terminal.stop_reason(lost)

    def _end(self, state: TestState, keep_locks: bool) -> None:
        for token in state.fixture_tokens:
            self._fixture_defs.pop(token, None)
        self.session.checker.ownership.close_window(state.token)
        restore_env(COOKIE_VAR, state.previous_cookie[0])
        restore_env(OWNER_VAR, state.previous_cookie[1])
        if state.previous_visible is not None:
            was_set, value = state.previous_visible
            restore_env("CUDA_VISIBLE_DEVICES", value if was_set else None)
        held, state.locks = state.locks, None
        if held is not None:
            # Not in a forked child: the session's process never sees its next test.
            if keep_locks and os.getpid() == self.session.pid and held.park():
                self._parked = held
            else:
                held.release()
            self._note_lock_notices()
        if not keep_locks:
            self.release_parked()  # a test skipped before locking leaves the earlier ones

    def release_parked(self) -> None:
        """Let go of the GPU locks kept for a next test that will not take them."""
        parked, self._parked = self._parked, None
        if parked is not None:
            parked.release()
            self._note_lock_notices()

    def _note_lock_notices(self) -> None:
        """What letting go of locks noticed about the lock directory (a deleted lock file), once each."""
        for notice in take_notices():
            self.session.records.note(notice, once=True)

    # ---- fixtures owned by a scope wider than a test ----------------------------------------------

    @contextlib.contextmanager
    def fixture_window(self, fixturedef: pytest.FixtureDef[Any]) -> Iterator[None]:
        """While a wider fixture is set up, what it spawns is its own, protected while it is active."""
        ownership = self.session.checker.ownership
        token = ownership.new_token(fixture_owner(fixturedef.argname, fixturedef.scope))
        self._fixture_tokens[id(fixturedef)] = token
        self._fixture_defs[token] = fixturedef
        ownership.active_fixtures.add(token)
        with self.session.owned_by(token):
            yield

    def live_fixture_values(self) -> list[tuple[str, object]]:
        """The value of each live wider fixture, with its token: a process whose handle one holds is that
        fixture's. Read only for a process to be judged, never on the clean path."""
        values: list[tuple[str, object]] = []
        for token in self._fixture_tokens.values():
            fixturedef = self._fixture_defs.get(token)
            cached = getattr(fixturedef, "cached_result", None)
            if cached is not None and cached[2] is None:  # (value, cache key, exception info)
                values.append((token, cached[0]))
        return values

    def fixture_finalized(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        """A wider fixture was torn down: its processes are checked like a test's at this teardown's end."""
        token = self._fixture_tokens.pop(id(fixturedef), None)
        if token is not None:
            self.session.checker.ownership.active_fixtures.discard(token)
            # The test whose teardown finalizes it finds its leaks, and names the fixture for them.
            if self._tearing_down is not None:
                self._tearing_down.fixture_tokens.append(token)
            else:
                self._fixture_defs.pop(token, None)  # ended outside any test: the final sweep names it

    # ---- what a check excuses -------------------------------------------------------------------------

    def _note_excused(self, state: TestState, result: CheckResult) -> None:
        """Said once per process: GPU memory a clean check excused as the session's own, whose and why; and
        once, what a ``count`` test got beside it."""
        checker = self.session.checker
        ownership, me = checker.ownership, os.getpid()
        by_pid = {f.pid: f for f in checker.last_census if f.token is not None and f.live}
        held: dict[tuple[int, int], tuple[tuple[str, str], list[tuple[str, float]]]] = {}
        for snap in result.devices:
            for process in snap.processes:
                f = by_pid.get(process.pid)
                if f is None or process.pid == me or not process.used_bytes or (
                        not ownership.is_protected(f.token)):
                    continue
                entry = held.setdefault(f.key, (self._whose(f.token), []))
                entry[1].append((snap.device.label, process.used_bytes / MIB))
        for key, ((whose, why), mib) in held.items():
            if key not in self._excused:
                self._excused.add(key)
                self.session.records.note(f"gpuclean: excused: {terminal.mib_list(mib)} held by pid {key[0]} "
                                        f"{whose}, {why}, not a test's leak")
        if held and state.previous_visible is not None and not self._count_told:
            # A test with a count asked for its GPUs exclusively: say once what it got beside the session's.
            self._count_told = True
            got = "; ".join(", ".join(f"{label} with {value:.0f} MiB" for label, value in mib) + f" {whose}"
                            for (whose, _), mib in held.values())
            self.session.records.note(
                f"gpuclean: {state.nodeid} (count={len(state.devices)}) got {got} on it: count makes a "
                "test's GPUs exclusive against other tests and sessions, not against this session's own "
                "fixtures")

    def _whose(self, token: str | None) -> tuple[str, str]:
        """Whose a session-owned process is (``of fixture server (session-scoped, conftest.py:5)``), and
        why its memory is excused."""
        fixturedef = self._fixture_defs.get(token or "")
        if fixturedef is not None:
            where = fixture_location(fixturedef, self.session.config.rootpath)
            return (f"of {FixtureLeak(fixturedef.argname, fixturedef.scope, where, '')}",
                    "while the fixture is active: the fixture's own")
        owner = self.session.checker.ownership.owner(token)
        if owner.kind == "session":
            return "of the session set-up (a conftest or a plugin)", "until the session's end: its own"
        return f"({owner.name})", "never signalled"

    # ---- what the pytest process itself holds -----------------------------------------------------

    def _note_own_context(self, result: CheckResult, nodeid: str) -> None:
        # Once, as a session note: a warning would be filed under the test whose phase it is, and -W error
        # would make it that test's error.
        if result.self_mib and not self._warned_own_context:
            self._warned_own_context = True
            self._note_own(f"holds a CUDA context ({terminal.mib_list(result.self_mib)})", result.phase,
                           nodeid)
        if result.self_cuda_only and not self._warned_own_cuda:
            self._warned_own_cuda = True
            self._note_own(f"initialised CUDA without a context ({', '.join(result.self_cuda_only)}: a few "
                           "MiB the driver charges to no process)", result.phase, nodeid)

    def _note_own(self, what: str, phase: Phase, nodeid: str) -> None:
        when = f"after {nodeid}" if phase == "teardown" else f"before {nodeid}"
        self.session.records.note(f"gpuclean: this pytest process (pid {os.getpid()}) {what}, first seen "
                                f"{when}; it is not counted as a leak")

    def _note_torch_growth(self, item: pytest.Item, state: TestState, record: TestRecord) -> str | None:
        """Record the test's in-process torch growth and warn; the teardown's failure if the filters make
        that warning an error."""
        grown, floor = self._torch_growth.after(state.nodeid, state.tolerance_mib, state.torch_before)
        if not grown:
            return None
        record.in_process_mib = grown
        growth = ", ".join(f"{d} +{m:.1f} MiB" for d, m in grown)
        return _warn_at(item, f"{item.nodeid}: torch.cuda.memory_allocated grew during the test in the "
                              f"pytest process ({growth}, more than {floor} MiB): tensors kept alive after "
                              "the test")


def _warn_at(item: pytest.Item, message: str) -> str | None:
    """Warn ``message`` at ``item``'s own file and line, not the plugin's. Where the filters make it an
    error, return the error's line for the teardown to fail with: no traceback into the plugin."""
    path, line, _ = item.location
    try:
        warnings.warn_explicit(GpuCleanWarning(message), GpuCleanWarning, str(item.config.rootpath / path),
                               (line or 0) + 1)
    except GpuCleanWarning:
        return f"gpuclean: {message} (a GpuCleanWarning: the warning filters make it an error)"
    return None


def _checked_after(record: TestRecord | None) -> bool:
    """Whether the check after the test ran: only for a test its check before found clean."""
    return record is not None and record.before is not None and record.before.clean


def _skip(reason: str) -> BaseException:
    # At the test's own file:line (``-rs``), as pytest's skip markers are, not the plugin's.
    return pytest.skip.Exception(reason, _use_item_location=True)


def _without(result: CheckResult, fixtures: list[FixtureLeak]) -> CheckResult:
    """``result`` as the test's own: less what ``fixtures`` left (theirs, in their own records)."""
    theirs = {id(x) for f in fixtures for x in (*f.reaped, *f.leaked, *f.lingered)}
    offenders = tuple(o for o in result.offenders if id(o) not in theirs)
    clean = result.error is None and not offenders
    return result._replace(
        reaped=tuple(r for r in result.reaped if id(r) not in theirs), offenders=offenders,
        lingered=tuple(o for o in result.lingered if id(o) not in theirs), clean=clean,
        clean_after_s=result.clean_after_s if result.clean or not clean else result.waited_s)


def fixture_location(fixturedef: pytest.FixtureDef[Any], rootpath: Path) -> tuple[str, int]:
    """Where a fixture is defined, as pytest locates a test; ("", 0) if its code cannot be found."""
    func = getattr(fixturedef.func, "__func__", fixturedef.func)  # a method fixture of a test class
    try:
        func = inspect.unwrap(func)
        code = func.__code__
        path = Path(inspect.getsourcefile(func) or code.co_filename).absolute()
    except (AttributeError, TypeError, ValueError):
        return "", 0
    try:
        return path.relative_to(rootpath).as_posix(), code.co_firstlineno
    except ValueError:
        return str(path), code.co_firstlineno
