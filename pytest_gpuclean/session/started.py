"""What a test's check (``testcheck.py``) and an extension's hooks (``plugin.GpuCleanHooks``: the Ray
cluster's checks) need of a started session, as a protocol: ``session.py`` passes itself, and neither
imports it back.

Also a test's state from its setup to the end of its teardown (``ItemState``), which both hand around.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from pytest_gpuclean.model.records import DeviceInfo, Owner, Reaped

if TYPE_CHECKING:
    import pytest

    from pytest_gpuclean.core.checker import Checker
    from pytest_gpuclean.core.health import HealthWatch
    from pytest_gpuclean.core.locks import GpuLocks, HeldLocks
    from pytest_gpuclean.core.settings import Settings
    from pytest_gpuclean.report.records import SessionRecords


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


class Started(Protocol):
    """A started session (``session.CheckedSession``) as a test's check and the cluster's checks see it."""

    @property
    def config(self) -> pytest.Config: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def found(self) -> SessionRecords: ...

    @property
    def checker(self) -> Checker: ...

    @property
    def unavailable(self) -> str | None: ...

    @property
    def devices(self) -> tuple[DeviceInfo, ...]: ...

    @property
    def locks(self) -> GpuLocks | None: ...

    @property
    def health(self) -> HealthWatch | None: ...

    def set_owner_env(self, token: str) -> tuple[str | None, str | None]: ...

    def owned_by(self, token: str) -> contextlib.AbstractContextManager[None]: ...

    def token_of(self, owner: Owner) -> str | None: ...

    def test_token(self, nodeid: str) -> str: ...

    def follow_fork(self) -> None: ...

    def attribute_earlier(self, reaped: list[Reaped] | tuple[Reaped, ...], nodeid: str,
                          notes: tuple[str, ...] = ()) -> None: ...

    def say(self, line: str) -> None: ...
