"""What a test's check (``testcheck.py``) and an extension's hooks (``hookspecs.py``: the Ray
cluster's checks) need of a started session, as a protocol: ``session.py`` passes itself, and neither
imports it back.

The session's checker, health watch, records and GPU locks are protocols here too, of only what those two
use (``CheckerView``, ``HealthView``, ``RecordsView``, ``LocksView``): this module names only the core's
lower modules (``devices``, ``ownership``, ``locks.held``, ``settings``), not the checker, the health watch,
the report or the module that takes the locks (``locks.gpus``), so
the per-test check stands on them rather than on the whole check (``tests/test_layers.py`` holds the
package's longest import chain). They are annotations only: the check calls the session's ``Checker``,
``HealthWatch`` and ``SessionRecords`` directly, and mypy holds that those fit.

Also a test's state from its setup to the end of its teardown (``ItemState``), which both hand around.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from pytest_gpuclean._model.records import DeviceInfo, Owner, Reaped

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Sequence

    import pytest

    from pytest_gpuclean._locks.held import HeldLocks
    from pytest_gpuclean._model.outcomes import CheckResult, TestRecord
    from pytest_gpuclean._model.records import HealthFinding, LockHolder, Phase
    from pytest_gpuclean._ownership.census import CensusEntry
    from pytest_gpuclean._ownership.evidence import Ownership
    from pytest_gpuclean._reading.devices import DeviceLost
    from pytest_gpuclean._settings import Settings
__all__ = [
    "CheckerView",
    "HealthView",
    "ItemState",
    "LocksView",
    "RecordsView",
    "Started",
]



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


class CheckerView(Protocol):
    """The session's checker (``checker.Checker``) as a test's check and the cluster's checks use
    it."""

    @property
    def ownership(self) -> Ownership: ...

    @property
    def reap_enabled(self) -> bool: ...

    @property
    def last_lost(self) -> DeviceLost | None: ...

    @property
    def last_census(self) -> Sequence[CensusEntry]:
        """What the last check's census found (``--gpuclean-ray=auto`` looks there for a GCS server)."""

    @property
    def notices(self) -> list[str]: ...

    def check(self, phase: Phase, devices: Sequence[DeviceInfo], *, tolerance_mib: int,
              timeout: float, device_errors: bool = False, where: str = "an earlier check",
              known: Collection[tuple[int, int]] = ()) -> CheckResult: ...

    def check_owned(self, tokens: Collection[str], devices: Sequence[DeviceInfo]) -> CheckResult: ...

    def is_older(self, pid: int, start_ticks: int) -> bool: ...


class HealthView(Protocol):
    """The session's health watch (``health.HealthWatch``) as a test's check uses it."""

    def before(self, nodeid: str, devices: Sequence[DeviceInfo], tests_failed: int
               ) -> list[HealthFinding]: ...

    def after(self, nodeid: str, devices: Sequence[DeviceInfo], reaped: Sequence[Reaped],
              tests_failed: int) -> list[HealthFinding]: ...

    def lost_now(self, exc: DeviceLost, phase: Phase) -> HealthFinding: ...


class RecordsView(Protocol):
    """The session's records (``report.records.SessionRecords``) as a test's check and the cluster's
    checks fill them."""

    def new(self, nodeid: str, location: tuple[str, int]) -> TestRecord: ...

    def record_for(self, nodeid: str) -> TestRecord: ...

    def note(self, message: str, once: bool = False) -> None: ...
    def note_replacing(self, prefix: str, message: str) -> None: ...


class LocksView(Protocol):
    """The session's GPU locks (``locks.gpus.GpuLocks``) as a test's check takes them."""

    def acquire(self, candidates: Sequence[str], count: int, timeout: float, holder_id: str,
                prefer: Sequence[str] = (), on_wait: Callable[[dict[str, LockHolder]], None] | None = None,
                parked: HeldLocks | None = None) -> HeldLocks: ...


class Started(Protocol):
    """A started session (``session.CheckedSession``) as a test's check and the cluster's checks see it."""

    @property
    def config(self) -> pytest.Config: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def found(self) -> RecordsView: ...

    @property
    def checker(self) -> CheckerView: ...

    @property
    def unavailable(self) -> str | None: ...

    @property
    def no_gpu(self) -> tuple[str, str]: ...

    @property
    def devices(self) -> tuple[DeviceInfo, ...]: ...

    @property
    def locks(self) -> LocksView | None: ...

    @property
    def health(self) -> HealthView | None: ...

    @property
    def pid(self) -> int:
        """The session's own process (a test run in a forked child runs in another)."""

    def set_owner_env(self, token: str) -> tuple[str | None, str | None]: ...

    def owned_by(self, token: str) -> contextlib.AbstractContextManager[None]: ...

    def token_of(self, owner: Owner) -> str | None: ...

    def test_token(self, nodeid: str) -> str: ...

    def follow_fork(self) -> None: ...

    def attribute_earlier(self, reaped: list[Reaped] | tuple[Reaped, ...], nodeid: str,
                          notes: tuple[str, ...] = ()) -> None: ...

    def say(self, line: str) -> None: ...

    def take_notices(self) -> None: ...
