"""Who made a process: the evidence gpuclean acts on, never a guess.

A process is a test's only if the test made it: by ancestry, an inherited cookie, or birth inside the
test's window (pid and clock readings). Never if a live fixture, the set-up or another session made it or
an ancestor. Missing or contradicting evidence: owner ``unknown``, reported, never signalled."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pytest_gpuclean._model.records import UNKNOWN_OWNER, Owner
from pytest_gpuclean._ownership.cookie import (
    PREEXISTING_TOKEN,
    SESSION_NAME,
    SESSION_TOKEN,
    cookie,
)
from pytest_gpuclean._reading import procfs

SESSION_OWNER = Owner("session", "pytest session (conftest, plugins, collection)")
PREEXISTING = PREEXISTING_TOKEN
"""Processes that existed before the session, and what they start: never signalled."""
_PREEXISTING_OWNER = Owner("unknown", "no part of the session (it, or the process that started it, "
                           "existed before the session)")

_SESSION_ID = re.compile(r"gc\.(\d+)\.(\d+)\.(\d+)\.[0-9a-f]+$")


SESSION = SESSION_TOKEN
"""Processes born outside every test and fixture, or whose cookie says the set-up started them."""


class SessionRef(NamedTuple):
    """The leader of a gpuclean session, as its id names it."""

    session_id: str
    pid: int
    start_ticks: int
    pid_namespace: int

    def liveness(self) -> bool | None:
        """True when provably alive, False when provably dead (pid gone or reused), None in another pid
        namespace."""
        if self.pid_namespace != procfs.pid_namespace():
            return None
        # An exited leader nobody has waited for yet (a crashed xdist worker) is dead too.
        return procfs.is_live(self.pid, self.start_ticks)

    def describe(self) -> str:
        started = procfs.ticks_to_wall(self.start_ticks)
        import time

        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        return f"dead session {self.session_id.rsplit('/', 1)[-1]} (pytest pid {self.pid}, started {when})"


def innermost_session(cookie: str) -> SessionRef | None:
    """The session that spawned a cookie's carrier (``gc.1.2.3.ab:s1/gc.4.5.3.cd:t7``: test t7 of
    ``gc.4.5.3.cd``). None for a cookie no gpuclean session made."""
    session_id, sep, _token = cookie.rpartition(":")
    if not sep:
        return None
    match = _SESSION_ID.search(session_id)
    if match is None or not (match.start() == 0 or session_id[match.start() - 1] == "/"):
        return None
    pid, start, namespace = (int(g) for g in match.groups())
    return SessionRef(session_id, pid, start, namespace)


Liveness = Callable[[SessionRef], bool | None]


def _live_outer_session(cookie: str, own_session_id: str, liveness: Liveness) -> SessionRef | None:
    """The innermost provably live session enclosing the cookie's innermost one, other than ours and our
    enclosers: what a nested session left when it died is that session's to reap."""
    parts = cookie.split("/")
    for depth in range(len(parts) - 1, 0, -1):
        outer = innermost_session("/".join(parts[:depth]))
        if outer is None or own_session_id == outer.session_id or own_session_id.startswith(
                outer.session_id + ":"):
            continue
        if liveness(outer) is True:
            return outer
    return None


def dead_session_of(cookie: str, own_session_id: str, liveness: Liveness) -> SessionRef | None:
    """The dead session whose debris a carrier of ``cookie`` is: not ours, provably dead, enclosed by no
    other live session. None otherwise."""
    inner = innermost_session(cookie)
    if inner is None or inner.session_id == own_session_id or liveness(inner) is not False:
        return None
    return inner if _live_outer_session(cookie, own_session_id, liveness) is None else None


class Ambiguous(NamedTuple):
    """A process a test or a protected process may have started, and the evidence in words."""

    test: str
    protectors: tuple[str, ...]
    why: str


@dataclass(slots=True)
class Window:
    """The span of a test or higher-scoped fixture, bracketed by pid and clock readings; closed in place."""

    token: str
    first_pid: int | None
    """The last pid allocated when the window opened: everything born in it has a later pid."""
    start_tick: int
    last_pid: int | None = None
    """The last pid allocated when it closed (None while open, or where the kernel does not say)."""
    end_tick: int | None = None

    @property
    def closed(self) -> bool:
        return self.end_tick is not None


class Ownership:
    """Who spawned what: cookie tokens, their owners, and the windows they ran in."""

    def __init__(self, session_id: str, began_tick: int | None = None, began_pid: int | None = None) -> None:
        self.session_id = session_id
        self.began_tick = began_tick
        """When the session's cookie was exported, before any conftest was imported; None: no process is
        older than the session."""
        self.began_pid = began_pid
        """The last pid allocated then (None where the kernel does not say)."""
        self.owners: dict[str, Owner] = {}
        self.active_fixtures: set[str] = set()
        self.windows: list[Window] = []
        self.session_over = False
        """Set for the very last sweep: the set-up's processes are then no longer protected."""
        self.ambiguous: dict[str, Ambiguous] = {}
        self._counter = 0
        self._pid_space = procfs.pid_max()

    def new_token(self, owner: Owner) -> str:
        self._counter += 1
        token = f"{owner.kind[0]}{self._counter}"
        self.owners[token] = owner
        return token

    def ambiguous_token(self, test: str, protectors: Iterable[str], why: str) -> str:
        """The token of a process born in ``test``'s window with no cookie while ``protectors``' processes
        (whose children get no cookie) were alive: either may have started it. Protected while any of them
        is; then the first fixture's of them."""
        self._counter += 1
        token = f"a{self._counter}"
        self.ambiguous[token] = Ambiguous(test, tuple(protectors), why)
        return token

    def register(self, token: str, owner: Owner) -> None:
        """Name the owner of a token made before this object (the session's)."""
        self.owners[token] = owner

    def cookie(self, token: str) -> str:
        return cookie(self.session_id, token)

    def token_of_cookie(self, value: str | None) -> str | None:
        if value is None or not value.startswith(self.session_id + ":"):
            return None
        # A nested session prefixes its cookies with ours ("<ours>:t5/<its id>:t1"): ours is our test t5's.
        token = value[len(self.session_id) + 1 :].split("/", 1)[0]
        return token if token in self.owners else None

    def open_window(self, token: str) -> None:
        self.windows.append(Window(token, procfs.last_pid(), procfs.boot_ticks_now()))

    def close_window(self, token: str) -> None:
        for window in reversed(self.windows):
            if window.token == token and not window.closed:
                window.last_pid = procfs.last_pid()
                window.end_tick = procfs.boot_ticks_now()
                return

    def token_by_birth(self, pid: int, start_ticks: int) -> str | None:
        """The innermost window a process born after the session started was provably born in."""
        now_pid: int | None = None
        now_tick = 0
        if any(not window.closed for window in self.windows):
            now_pid, now_tick = procfs.last_pid(), procfs.boot_ticks_now()
        return born_in(self.windows, pid, start_ticks, now_pid, now_tick, self._pid_space)

    def existed_before(self, pid: int, start_ticks: int, last_pid: int | None = None) -> bool | None:
        """Whether ``pid`` (no cookie of ours, outside our tree) predates the session; ``last_pid``: read
        after the process was found."""
        if self.began_tick is None:
            return False
        if start_ticks != self.began_tick:
            return start_ticks < self.began_tick
        return older_than_session(pid, start_ticks, self.began_tick, self.began_pid,
                                  procfs.last_pid() if last_pid is None else last_pid, self._pid_space)

    def owner(self, token: str | None) -> Owner:
        if token == SESSION:
            return SESSION_OWNER
        if token == PREEXISTING:
            return _PREEXISTING_OWNER
        maybe = self.ambiguous.get(token or "")
        if maybe is not None:
            if self.is_protected(token):
                return Owner("unknown", f"{self.owner(maybe.test).name} or {self._names(maybe.protectors)}")
            # Its protectors ended: what is left is theirs to answer for (a fixture's first).
            fixtures = [t for t in maybe.protectors if self.owner(t).kind == "fixture"]
            return self.owner(fixtures[0] if fixtures else SESSION)
        return self.owners.get(token or "", UNKNOWN_OWNER)

    def _names(self, tokens: Iterable[str]) -> str:
        return ", ".join(dict.fromkeys(self.owner(t).name for t in tokens))

    def is_protected(self, token: str | None) -> bool:
        """An active fixture's or the set-up's, of unknown birth, no part of the session, or ambiguous
        while a possible starter is protected."""
        if token is not None and token.startswith("a") and token in self.ambiguous:
            return any(self.is_protected(t) for t in self.ambiguous[token].protectors)
        return (token is None or token == PREEXISTING or (token == SESSION and not self.session_over)
                or token in self.active_fixtures)


# ---- the decisions, over plain values (the readings are the caller's) ----------------------------


_FIXTURE_NAME = re.compile(r" \((?:function|class|module|package|session)-scoped\)$")


def fixture_owner(argname: str, scope: str) -> Owner:
    """The owner of what a fixture wider than a test spawns while it is set up."""
    return Owner("fixture", f"{argname} ({scope}-scoped)")


def owner_named(name: str) -> Owner:
    """The owner a dead session's process names in ``OWNER_VAR``, its kind read from the name: a fixture's
    name ends in ``(SCOPE-scoped)``, no node id ends in ``)``."""
    if name == SESSION_NAME:
        return Owner("session", name)
    if _FIXTURE_NAME.search(name):
        return Owner("fixture", name)
    return Owner("test", name)


def born_in(windows: Sequence[Window], pid: int, start_ticks: int, now_pid: int | None, now_tick: int,
            pid_space: int) -> str | None:
    """The token of the innermost of ``windows`` ``pid`` was provably born in: a pid and a start time
    between its readings (an open window ends at ``now_pid``, ``now_tick``). Pids wrap, so a window
    spanning half the pid space proves nothing by pid: then only a start time strictly inside counts (its
    edge ticks are shared). ``SESSION`` if provably outside every window; None if undecided."""
    for window in reversed(windows):
        end_tick, last = window.end_tick, window.last_pid
        if end_tick is None:
            end_tick, last = now_tick, now_pid
        if not window.start_tick <= start_ticks <= end_tick:
            continue
        by_pid = pid_between(pid, window.first_pid, last, pid_space)
        if by_pid:
            return window.token
        if by_pid is None:
            return window.token if window.start_tick < start_ticks < end_tick else None
    return SESSION


def older_than_session(pid: int, start_ticks: int, began_tick: int, began_pid: int | None,
                       last_pid: int | None, pid_space: int) -> bool | None:
    """Whether ``pid`` predates a session that began at ``began_tick``/``began_pid``: True, False, None.
    Within the export's very tick (10 ms) only the pids can decide, unless a reading is missing or may have
    wrapped."""
    if start_ticks != began_tick:
        return start_ticks < began_tick
    after = pid_between(pid, began_pid, last_pid, pid_space)
    return None if after is None else not after


def pid_between(pid: int, first: int | None, last: int | None, pid_space: int) -> bool | None:
    """Whether ``pid`` was allocated in ``(first, last]``; None if unknowable (a reading missing, a wrap)."""
    if first is None or last is None:
        return None
    span = (last - first) % pid_space
    if span > pid_space // 2:
        return None
    return 0 < (pid - first) % pid_space <= span
