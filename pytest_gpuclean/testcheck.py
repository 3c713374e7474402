"""Each test's check, from its setup to the end of its teardown: the marker's settings, the GPU locks,
the check before, the check after every fixture is torn down, and whose leak is whose.

Part of a started session (``session.py``); the plugin's setup and teardown hooks delegate here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpuclean import records, report, settings
from pytest_gpuclean.cookie import COOKIE_VAR, OWNER_VAR, restore_env
from pytest_gpuclean.locks import LockTimeout, describe_holders, take_notices
from pytest_gpuclean.model import MIB, CheckResult, DeviceInfo, OutsideAction, Owner, TestRecord
from pytest_gpuclean.plugin import FIXTURE, MARKER, GpuCleanWarning

if TYPE_CHECKING:
    from pytest_gpuclean.locks import HeldLocks
    from pytest_gpuclean.session import CheckedSession


class ItemState:
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


_STATE = pytest.StashKey[ItemState]()


class ItemChecks:
    """The checks around each test of a started session."""

    def __init__(self, session: CheckedSession) -> None:
        self.session = session
        self._fixture_tokens: dict[int, str] = {}
        self._tearing_down: ItemState | None = None
        self._warned_own_context = False
        self._warned_own_cuda = False

    def setup(self, item: pytest.Item, *, checked: bool) -> CheckResult | None:
        """Open the test's ownership window; if it is ``checked``, lock its GPUs and check them (fails or
        skips the setup). The setup check's result, for a checked test."""
        session = self.session
        session.follow_fork()
        token = session.test_token(item.nodeid)
        state = ItemState(item.nodeid, token, session.set_owner_env(token))
        item.stash[_STATE] = state
        if records.TEST in item.stash:
            del item.stash[records.TEST]  # a test run again (a rerun plugin) starts a new record
        session.checker.ownership.open_window(token)
        if not checked:
            return None
        state.checked = True
        return self._before(item, state)

    def _before(self, item: pytest.Item, state: ItemState) -> CheckResult:
        session = self.session
        applied = self._applied(item)
        state.tolerance_mib, state.timeout = applied.tolerance_mib, applied.timeout
        record = session.found.new(item.nodeid, (item.location[0], (item.location[1] or 0) + 1))
        item.stash[records.TEST] = record
        self._choose_devices(item, state, record, applied.count)
        if session.cluster is not None:
            session.cluster.before(state, record)
        result = session.checker.check("setup", state.devices, tolerance_mib=state.tolerance_mib,
                                       timeout=state.timeout, where=state.nodeid)
        record.before = result
        record.before_s = result.waited_s
        self._note_own_context(result)
        session.attribute_earlier(result.reaped, state.nodeid, result.notes)
        state.torch_before = _torch_allocated()
        if not result.clean:
            heading = report.not_clean_heading("setup", result, state.timeout)
            if self._outside_action(item, record, result) == "skip":
                pytest.skip(f"{report.outside_line('setup', result, state.timeout)} "
                            f"({self._outside_source()})")
            pytest.fail(report.check_report(result, heading), pytrace=False)
        if session.cluster is not None and session.cluster.discover("before", state.nodeid):
            session.cluster.before(state, record)
        return result

    def _outside_action(self, item: pytest.Item, record: TestRecord, result: CheckResult
                        ) -> OutsideAction | None:
        """What the test gets for a check whose every finding is from outside the session
        (``--gpuclean-outside``), recorded; with ``stop``, the session stops after this test (under xdist,
        this worker, and the controller ends the run). None if something of the session's is dirty too:
        that is a finding like any other."""
        if result.outside is None or not result.outside.only:
            return None
        action = self.session.settings.outside
        record.outside_action = action
        if action == "stop" and not item.session.shouldstop:
            item.session.shouldstop = (f"gpuclean: {report.outside_cause(result)} at {item.nodeid}; "
                                       f"stopping the session ({self._outside_source()})")
        return action

    def _outside_source(self) -> str:
        value = self.session.settings.outside
        source = self.session.settings.sources.get("outside", "the default")
        return f"{settings.option('outside').cli}={value}, {source}"

    def _applied(self, item: pytest.Item) -> settings.TestSettings:
        # The session's settings with the marker's applied; skips or fails a test that cannot be checked.
        session = self.session
        marker = item.get_closest_marker(MARKER)
        try:
            applied = settings.for_marker(session.settings, marker.kwargs if marker else {}, item.nodeid,
                                          marker.args if marker else ())
        except ValueError as exc:
            # ``from None``: failing inside ``except`` would print the message twice, chained.
            message = f"gpuclean: {exc} (from the {MARKER} marker)"
            raise pytest.fail.Exception(message, pytrace=False) from None
        wants_gpu = marker is not None or FIXTURE in getattr(item, "fixturenames", ())
        if session.unavailable is not None and wants_gpu:
            message = f"gpuclean: no GPU to check: {session.unavailable}"
            if session.settings.require_gpu:
                pytest.fail(message + " (--gpuclean-require-gpu)", pytrace=False)
            pytest.skip(message)
        if applied.count is not None and applied.count > len(session.devices):
            pytest.skip(f"gpuclean: test needs {applied.count} GPU(s), found {len(session.devices)}")
        return applied

    def _choose_devices(self, item: pytest.Item, state: ItemState, record: TestRecord,
                        count: int | None) -> None:
        # The devices this test checks: those it locked, else the first ``count``; with a count, the test
        # sees exactly those.
        session = self.session
        state.devices = session.devices
        if session.locks is not None and session.devices:
            state.locks = self._lock_gpus(item, record, count or len(session.devices))
            state.devices = tuple(d for d in session.devices if d.uuid in state.locks.uuids)
        elif count is not None:
            state.devices = session.devices[:count]
        record.devices = tuple(d.uuid for d in state.devices)
        if count is not None:
            state.previous_visible = ("CUDA_VISIBLE_DEVICES" in os.environ,
                                      os.environ.get("CUDA_VISIBLE_DEVICES"))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in state.devices)

    def _lock_gpus(self, item: pytest.Item, record: TestRecord, wanted: int) -> HeldLocks:
        session = self.session
        assert session.locks is not None
        waiting: list[bool] = []

        def on_wait(holders: dict[str, dict[str, object]]) -> None:
            waiting.append(True)
            session.say(f"gpuclean: {item.nodeid} waits for GPU lock(s) held by: {describe_holders(holders)}")

        try:
            held = session.locks.acquire([d.uuid for d in session.devices], wanted,
                                         session.settings.lock_timeout, item.nodeid, on_wait=on_wait)
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

    def teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        """Around the test's teardown (the plugin's outermost wrapper delegates here): after every fixture
        is torn down, check the GPUs; fails the teardown with what the test leaked."""
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
                self._end(state)
        if outcome is not None:
            if failure:
                item.add_report_section("teardown", "gpuclean", failure)
            raise outcome
        if failure:
            pytest.fail(failure, pytrace=False)

    def _after(self, item: pytest.Item, state: ItemState, record: TestRecord) -> str | None:
        if record.before is None or not record.before.clean:
            return None  # the test never ran on clean GPUs: its setup error already says why
        cluster = self.session.cluster
        ray_failure = cluster.after(state, record) if cluster is not None else None
        local_failure = self._after_local(item, state, record)
        if cluster is not None and cluster.discover("after", state.nodeid):
            # Started during the test: checked from now on, this test's own leftovers there included.
            ray_failure = cluster.after(state, record, appeared=True)
        return "\n\n".join(f for f in (ray_failure, local_failure) if f) or None

    def _after_local(self, item: pytest.Item, state: ItemState, record: TestRecord) -> str | None:
        session = self.session
        result = session.checker.check("teardown", state.devices, tolerance_mib=state.tolerance_mib,
                                       timeout=state.timeout, where=state.nodeid)
        own_tokens = {state.token, *state.fixture_tokens}
        # A dead session's debris is that session's leak, never this test's.
        own = [r for r in result.reaped if r.found_by != "dead session" and (
            r.owner is None or r.owner.kind not in ("test", "fixture")
            or session.token_of(r.owner) in own_tokens)]
        session.attribute_earlier([r for r in result.reaped if r not in own], state.nodeid, result.notes)
        # This test's record keeps only what this test leaked; earlier tests' leaks went to theirs.
        if len(own) != len(result.reaped):
            result = result.replace(reaped=tuple(own))
        record.after = result
        record.after_s = result.waited_s
        self._note_torch_growth(item, state, record)
        leaked_offenders = [o for o in (*result.offenders, *result.lingered) if o.reason == "leaked"]
        if own or leaked_offenders:
            # The processes are reported even if reaping made everything clean: the test leaked them.
            return report.check_report(result, report.leak_heading(own, leaked_offenders,
                                                                   session.checker.reap_enabled))
        if not result.clean:
            if self._outside_action(item, record, result) == "skip":
                # The test has run: it cannot be skipped, and what another job put on its GPUs is no
                # failure of its. Said, not failed; the next test's setup check skips.
                warnings.warn(GpuCleanWarning(
                    f"{item.nodeid}: {report.outside_line('teardown', result, state.timeout)}; the test "
                    f"has run: not failed ({self._outside_source()})"), stacklevel=1)
                return None
            return report.check_report(result, report.not_clean_heading("teardown", result, state.timeout))
        return None

    def _end(self, state: ItemState) -> None:
        self.session.checker.ownership.close_window(state.token)
        restore_env(COOKIE_VAR, state.previous_cookie[0])
        restore_env(OWNER_VAR, state.previous_cookie[1])
        if state.previous_visible is not None:
            was_set, value = state.previous_visible
            restore_env("CUDA_VISIBLE_DEVICES", value if was_set else None)
        if state.locks is not None:
            state.locks.release()
            state.locks = None
            for notice in take_notices():
                self.session.found.note(notice, once=True)

    # ---- fixtures owned by a scope wider than a test ----------------------------------------------

    @contextlib.contextmanager
    def fixture_window(self, fixturedef: pytest.FixtureDef[Any]) -> Iterator[None]:
        """While a fixture wider than a test is set up, what it spawns is its own, protected while it is
        active."""
        ownership = self.session.checker.ownership
        token = ownership.new_token(Owner("fixture", f"{fixturedef.argname} ({fixturedef.scope}-scoped)"))
        self._fixture_tokens[id(fixturedef)] = token
        ownership.active_fixtures.add(token)
        with self.session.owned_by(token):
            yield

    def fixture_finalized(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        """A fixture wider than a test was torn down: from now on its processes are checked like a
        test's, at the end of this teardown."""
        token = self._fixture_tokens.pop(id(fixturedef), None)
        if token is not None:
            self.session.checker.ownership.active_fixtures.discard(token)
            # The test whose teardown finalizes it (not the fixture's own node) is the one that blames it.
            if self._tearing_down is not None:
                self._tearing_down.fixture_tokens.append(token)

    # ---- what the pytest process itself holds -----------------------------------------------------

    def _note_own_context(self, result: CheckResult) -> None:
        if result.self_mib and not self._warned_own_context:
            self._warned_own_context = True
            self._note_own(f"holds a CUDA context ({report.mib_list(result.self_mib)})")
        if result.self_cuda_only and not self._warned_own_cuda:
            self._warned_own_cuda = True
            self._note_own(f"initialised CUDA without a context ({', '.join(result.self_cuda_only)}: a few "
                           "MiB the driver charges to no process)")

    def _note_own(self, what: str) -> None:
        message = f"gpuclean: this pytest process (pid {os.getpid()}) {what}; it is not counted as a leak"
        self.session.found.note(message)
        warnings.warn(GpuCleanWarning(message), stacklevel=1)

    def _note_torch_growth(self, item: pytest.Item, state: ItemState, record: TestRecord) -> None:
        torch_after = _torch_allocated()
        if state.torch_before is None or torch_after is None:
            return
        grown = [(f"cuda:{i}", (torch_after.get(i, 0) - before) / MIB)
                 for i, before in state.torch_before.items() if torch_after.get(i, 0) > before]
        if grown:
            record.in_process_mib = grown
            growth = ", ".join(f"{d} +{m:.1f} MiB" for d, m in grown)
            warnings.warn(GpuCleanWarning(
                f"{item.nodeid}: torch.cuda.memory_allocated grew during the test in the pytest process "
                f"({growth}): tensors kept alive after the test"), stacklevel=1)


def _torch_allocated() -> dict[int, int] | None:
    # Only look if the test process already initialised CUDA through torch; never initialise it.
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return {i: int(cuda.memory_allocated(i)) for i in range(cuda.device_count())}
