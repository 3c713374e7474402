"""The census: the session's processes, and whose each is (the token that names its owner).

Readings only: the descendant tree through ``procfs``, cookie carriers outside it, the evidence of
``ownership``; each process pinned by ``processes`` from the moment it is found. What a check makes of a
census (offenders, excused, what may be signalled) is decided in ``decide.py``; no signal is sent here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import NamedTuple

from pytest_gpuclean.core import processes, procfs
from pytest_gpuclean.core.ownership import (
    COOKIE_VAR,
    OWNER_VAR,
    PREEXISTING,
    SESSION,
    Ownership,
    SessionRef,
    dead_session_of,
    innermost_session,
)
from pytest_gpuclean.model.records import FoundBy, Owner, OwnerKind

XDIST_RUN_VAR = "PYTEST_XDIST_TESTRUNUID"
XDIST_WORKER_VAR = "PYTEST_XDIST_WORKER"
MULTIPROCESSING_PACKAGES = ("multiprocessing", "multiprocess")
"""Packages whose resource tracker and forkserver serve the pytest process (``multiprocess`` is the
dill-based fork that vLLM's tests use)."""
_HELPER_MODULES = tuple((f"{p}.resource_tracker", f"{p}.forkserver") for p in MULTIPROCESSING_PACKAGES)


class Found:
    """A process that is ours (a descendant, or carrying a cookie of ours or of a dead session). (A plain
    class: see ``ownership.Window``.)"""

    __slots__ = ("debris_of", "depth", "found_by", "handle", "owner_name", "pid", "start_ticks", "state",
                 "token")

    def __init__(self, pid: int, start_ticks: int, depth: int, found_by: FoundBy, token: str | None,
                 state: procfs.KernelState, handle: processes.Handle | None = None,
                 debris_of: SessionRef | None = None, owner_name: str | None = None) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.depth = depth
        self.found_by = found_by
        self.token = token
        self.state = state
        """``R`` for a zombie leader whose other threads still run."""
        self.handle = handle
        self.debris_of = debris_of
        """For debris of a dead session: that session."""
        self.owner_name = owner_name
        """For debris: the owner its ``OWNER_VAR`` names."""

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start_ticks

    @property
    def live(self) -> bool:
        return self.state not in procfs.EXITED


class Sibling(NamedTuple):
    """Who in a live sibling xdist worker started a process: the worker and the owner its cookie names."""

    worker: str
    owner: Owner


_OWNER_KINDS: dict[str, OwnerKind] = {"t": "test", "f": "fixture"}
"""A cookie token's first letter: the kind of owner (``Ownership.new_token``)."""


class Census:
    """The session's processes as the checks find them: the descendant tree of the process running the
    checks, cookie carriers outside it, the debris of dead sessions; each with its token, decided once per
    process (pid and start time) and kept."""

    def __init__(self, ownership: Ownership, *, uid: int, session_start_ticks: int,
                 xdist_run: str | None = None, peer_cookie: str | None = None,
                 peers_since: int | None = None) -> None:
        self.ownership = ownership
        self.uid = uid
        self.session_start_ticks = session_start_ticks
        """When the session began (its cookie exported): a process carrying our cookie that is older is not
        ours, its value was recycled."""
        self.xdist_run = xdist_run
        self.peer_cookie = peer_cookie
        """The cookie our xdist siblings started with (the controller's): theirs, not a leak's."""
        self.peers_since = peers_since
        """When the controller started its workers (boot ticks; ``cookie.WORKERS_SINCE_VAR``)."""
        self._me = -1
        self._never_touch: set[int] = set()
        self._handles: dict[tuple[int, int], processes.Handle] = {}
        self._tokens: dict[tuple[int, int], str | None] = {}
        self._debris: dict[tuple[int, int], tuple[SessionRef, str | None]] = {}
        """Processes under us that a nested session left when it died: (that session, owner name)."""
        self._tree = procfs.DescendantWalk()
        self.last: list[Found] = []
        """What the last census found (``--gpuclean-ray=auto`` looks there for a Ray cluster the session
        started)."""
        # What already runs under us belongs to the session set-up (a conftest imported before this
        # checker existed, a plugin's pytest_configure): never a test's leak. Unless it existed before the
        # session began, or descends from a process that did: a container entrypoint's `server & exec
        # pytest` leaves the server our child, and it is no part of the session.
        walked = self._walk()
        upto = procfs.last_pid()  # every process just walked had its pid by now
        tokens: dict[int, str] = {}
        for pid, _depth, parent in walked:
            stat = procfs.read_stat(pid)
            if stat is None:
                continue
            token = tokens.get(parent) or self._set_up_or_older(pid, stat.start_ticks, upto)
            tokens[pid] = self._tokens[(pid, stat.start_ticks)] = token


    def _set_up_or_older(self, pid: int, start_ticks: int, upto: int | None) -> str:
        """Whose is ``pid``, found under us when the checker starts and descended from none of our other
        processes: the session set-up's if it carries our cookie (exported before anything of the
        set-up ran) or was provably born after the session began; otherwise it existed before the session,
        or may have (born in the very tick the session began): either way it is left alone."""
        value = procfs.read_environ_vars(pid, (COOKIE_VAR,)).get(COOKIE_VAR)
        if value is not None and value.startswith(self.ownership.session_id + ":"):
            return SESSION
        return SESSION if self.ownership.existed_before(pid, start_ticks, upto) is False else PREEXISTING

    # ---- who we are (a forked test runner changes it) -------------------------------------------

    @property
    def me(self) -> int:
        """The process running the checks: under a forked runner, the forked child, not the session."""
        pid = os.getpid()
        if pid != self._me:
            self._me = pid
            self._never_touch = processes.ancestors(pid)
        return pid

    @property
    def never_touch(self) -> set[int]:
        """This process and its ancestors: never suspects, never signalled."""
        _ = self.me
        return self._never_touch

    @property
    def my_sid(self) -> int:
        return os.getsid(0)

    def close(self) -> None:
        """Close the pidfds of every process still pinned."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    # ---- the census ---------------------------------------------------------------------------

    def helper_pids(self) -> set[int]:
        # multiprocessing's resource tracker and forkserver are long-lived helpers of the pytest
        # process itself, started lazily by whichever test first needs them; killing them breaks
        # later tests (forkserver's own waitpid would fail). They exit with pytest. The
        # ``multiprocess`` package (dill-based, used by vLLM's tests) has the same helpers.
        helpers: set[int] = set()
        modules = sys.modules
        for tracker_name, forkserver_name in _HELPER_MODULES:
            # (each getattr only where the module was imported: this runs on every check, and most
            # sessions never import them)
            module = modules.get(tracker_name)
            if module is not None:
                tracker = getattr(module, "_resource_tracker", None)
                if getattr(tracker, "_pid", None):
                    helpers.add(tracker._pid)  # type: ignore[union-attr]
            module = modules.get(forkserver_name)
            if module is not None:
                forkserver = getattr(module, "_forkserver", None)
                if getattr(forkserver, "_forkserver_pid", None):
                    helpers.add(forkserver._forkserver_pid)  # type: ignore[union-attr]
        return helpers

    def _walk(self, me: int | None = None) -> list[tuple[int, int, int]]:
        """Our descendants as (pid, depth, parent pid), parents before their children. ``me``: this
        process's pid, if the caller has just read it (``self.me``)."""
        if me is None:
            me = self.me
        return self._tree.walk(me, me)

    def _pin(self, pid: int) -> tuple[processes.Handle, procfs.ProcStat] | None:
        """A pinned process and its current stat; pinned once, from the moment it is first found."""
        # The walk just read it: a process is placed in the tree and pinned by the same reading.
        stat = self._tree.stats.get(pid) or procfs.read_stat(pid)
        if stat is not None:
            handle = self._handles.get((pid, stat.start_ticks))
            if handle is not None:
                return handle, stat
        pinned = processes.pin(pid)
        if pinned is not None:
            self._handles[(pid, pinned[1].start_ticks)] = pinned[0]
        return pinned

    def _forget_gone(self, seen: set[tuple[int, int]]) -> None:
        for key in [k for k in self._handles if k not in seen]:
            handle = self._handles[key]
            if handle.exited():
                handle.close()
                del self._handles[key]

    def _token(self, pid: int, start_ticks: int, parent_token: str | None, parent_ours: bool) -> str | None:
        key = (pid, start_ticks)
        if key not in self._tokens:
            if parent_ours:
                # Made by one of our processes: whoever owns the parent owns the child, whatever the
                # child's environment or birth time say (a fixture's server forking a worker on request).
                token = parent_token
            else:
                values = procfs.read_environ_vars(pid, (COOKIE_VAR, OWNER_VAR))
                cookie = values.get(COOKIE_VAR)
                token = self.ownership.token_of_cookie(cookie)
                if token is None and self.ownership.existed_before(pid, start_ticks) is not False:
                    token = PREEXISTING  # older than the session (or maybe): no part of it
                elif token is None:
                    token = self.ownership.token_by_birth(pid, start_ticks)
                elif cookie is not None and self.ownership.is_protected(token):
                    # Started under our session set-up by a nested session that has since died (an
                    # xdist worker that crashed, adopted by us, its controller): that session's debris.
                    inner = dead_session_of(cookie, self.ownership.session_id, SessionRef.liveness)
                    if inner is not None:
                        self._debris[key] = (inner, values.get(OWNER_VAR))
            self._tokens[key] = token
        return self._tokens[key]

    def take(self, scan_cookies: bool = False, dead_sessions: bool = False) -> list[Found]:
        """Our processes: the descendant tree (cheap), plus cookie carriers outside it (a /proc scan).

        With ``dead_sessions``, the scan also returns the debris of dead gpuclean sessions of this user.
        """
        found: list[Found] = []
        helpers = self.helper_pids()
        by_pid: dict[int, Found] = {}
        me = self.me  # (one getpid per census: the pid cannot change during it, nothing here forks)
        my_sid: int | None = None  # (read when a direct child needs it: the clean path has none)
        seen_keys: set[tuple[int, int]] = set()
        for pid, depth, parent in self._walk(me):
            if pid in helpers:
                continue
            pinned = self._pin(pid)
            if pinned is None:
                continue
            handle, stat = pinned
            if stat.ppid != parent and stat.ppid not in by_pid and stat.ppid != me:
                continue  # not the process the walk found any more
            parent_found = by_pid.get(stat.ppid)
            token = self._token(pid, stat.start_ticks, parent_found.token if parent_found else None,
                                parent_found is not None)
            # A direct child in another session escaped with setsid and was re-parented to our subreaper.
            found_by: FoundBy = "descendant"
            if depth == 1:
                if my_sid is None:
                    my_sid = self.my_sid
                if stat.sid != my_sid:
                    found_by = "adopted"
            state = "R" if procfs.live_state(pid, stat.state) else stat.state
            entry = Found(pid, stat.start_ticks, depth, found_by, token, state, handle)
            if entry.key in self._debris:
                entry.found_by = "dead session"
                entry.debris_of, entry.owner_name = self._debris[entry.key]
            by_pid[pid] = entry
            seen_keys.add(entry.key)
            found.append(entry)
        if scan_cookies or dead_sessions:
            found.extend(self._cookie_carriers(by_pid, helpers, dead_sessions, seen_keys))
        self._forget_gone(seen_keys)
        self.last = found
        return found

    def _cookie_carriers(self, known: dict[int, Found], helpers: set[int], dead_sessions: bool,
                         seen_keys: set[tuple[int, int]]) -> list[Found]:
        found: list[Found] = []
        prefix = "" if dead_sessions else self.ownership.session_id + ":"
        never_touch = self.never_touch
        for pid, value in processes.cookie_holders(COOKIE_VAR, prefix, self.uid):
            if pid in known or pid in never_touch or pid in helpers:
                continue
            token = self.ownership.token_of_cookie(value)
            debris = None
            if token is None:
                debris = (dead_session_of(value, self.ownership.session_id, SessionRef.liveness)
                          if dead_sessions else None)
                if debris is None:
                    # A live session's (also when a nested session that one's test ran died: an xdist
                    # sibling's), or no session's: never ours.
                    continue
            pinned = self._pin(pid)
            if pinned is None:
                continue
            handle, stat = pinned
            if stat.start_ticks < self.session_start_ticks and debris is None:
                continue  # carries our cookie but predates us: a recycled value, not our child
            owner_name = procfs.read_environ_vars(pid, (OWNER_VAR,)).get(OWNER_VAR) if debris else None
            entry = Found(pid, stat.start_ticks, 0, "dead session" if debris else "cookie", token,
                          "R" if procfs.live_state(pid, stat.state) else stat.state, handle, debris,
                          owner_name)
            seen_keys.add(entry.key)
            found.append(entry)
        return found

    def owner_of(self, f: Found) -> Owner:
        if f.debris_of is not None:
            if f.owner_name:
                return Owner("test", f.owner_name)
            return Owner("session", f.debris_of.describe())
        return self.ownership.owner(f.token)

    def is_protected(self, f: Found) -> bool:
        """Not to be reaped now: an active fixture's, the session set-up's, or of unknown birth."""
        return f.debris_of is None and self.ownership.is_protected(f.token)

    def peer_pids(self, pids: Iterable[int]) -> set[int]:
        """Of ``pids``, the sibling pytest-xdist workers of our run (``is_peer``): they hold their own CUDA
        contexts, like we do."""
        if not self.xdist_run or not self.peer_cookie:
            return set()
        parent = os.getppid()
        peers: set[int] = set()
        for pid in pids:
            stat = procfs.read_stat(pid)
            if stat is None or stat.ppid != parent:
                continue
            values = procfs.read_environ_vars(pid, (XDIST_RUN_VAR, COOKIE_VAR))
            if is_peer(values.get(COOKIE_VAR), values.get(XDIST_RUN_VAR), stat.start_ticks, self.peer_cookie,
                       self.xdist_run, self.peers_since):
                peers.add(pid)
        return peers

    def siblings(self, pids: Iterable[int]) -> dict[int, Sibling]:
        """Of ``pids``, those that a live sibling worker of our xdist run started, and who there did.

        The proof is the run's cookie: a worker's session id extends the controller's cookie (our
        ``peer_cookie``) by its own ``gc.<pid>.<start>.<namespace>.<random>``, and what its tests, fixtures
        and set-up start carry that id and a token, however deeply nested. The worker the cookie names
        must be alive and a peer of ours (``peer_pids``); the process must carry our run's id (xdist
        exports it in a worker before any test runs) and be born after that worker. Such a process
        belongs to that live session: never ours to wait for or to signal; the sibling reaps it at its
        own next check if it leaked. A sibling that died is not one: what it left is a dead session's
        debris, as before.
        """
        if not self.xdist_run or not self.peer_cookie:
            return {}
        found: dict[int, Sibling] = {}
        peers: dict[int, bool] = {}
        for pid in pids:
            values = procfs.read_environ_vars(pid, (COOKIE_VAR, OWNER_VAR, XDIST_RUN_VAR, XDIST_WORKER_VAR))
            claim = sibling_claim(values.get(COOKIE_VAR, ""), values.get(XDIST_RUN_VAR), self.peer_cookie,
                                  self.xdist_run, self.ownership.session_id)
            if claim is None:
                continue
            ref, kind = claim
            stat = procfs.read_stat(pid)
            if stat is None or stat.start_ticks < ref.start_ticks:
                continue  # older than the worker its cookie names: a recycled value, proves nothing
            if ref.pid not in peers:
                peers[ref.pid] = self._is_sibling_worker(ref)
            if not peers[ref.pid]:
                continue
            worker = values.get(XDIST_WORKER_VAR) or f"xdist worker pid {ref.pid}"
            found[pid] = Sibling(worker, Owner(kind, values.get(OWNER_VAR, "?")))
        return found

    def _is_sibling_worker(self, ref: SessionRef) -> bool:
        """Whether the session leader ``ref`` names is a live sibling worker: the very process (pid and start
        time, in our pid namespace), and a peer."""
        return (ref.pid_namespace == procfs.pid_namespace() and procfs.is_live(ref.pid, ref.start_ticks)
                and bool(self.peer_pids((ref.pid,))))

    def of_our_run(self, pid: int) -> bool:
        """A process that a sibling xdist worker of our run started (its cookie extends the controller's):
        the run's, never outside the session, though this worker does not account for it."""
        if not self.xdist_run or not self.peer_cookie:
            return False
        value = procfs.read_environ_vars(pid, (COOKIE_VAR,)).get(COOKIE_VAR)
        return value is not None and value.startswith(self.peer_cookie + "/")

    def is_older(self, pid: int, start_ticks: int) -> bool:
        """Whether the census found ``pid`` (started at ``start_ticks``) to be no part of the session: it, or
        the process that started it, existed before the session."""
        return self._tokens.get((pid, start_ticks)) == PREEXISTING


# ---- the decisions about xdist siblings, over plain values (the readings are the caller's) -------------


def is_peer(cookie: str | None, run: str | None, start_ticks: int, peer_cookie: str, xdist_run: str,
            peers_since: int | None) -> bool:
    """Whether a direct child of our xdist controller (its cookie ``cookie``, the run id ``run`` in its
    environment, started at ``start_ticks``) is a sibling worker of ours, a peer.

    A peer started with the controller's own cookie (``peer_cookie``): what a worker's test starts (even an
    orphan of a crashed worker, adopted by the controller) carries that worker's longer cookie, and is a
    leak, never a peer. xdist exports the run id in a worker only once it runs, so its initial environment
    (all that others can read) may lack it: then it was started when the controller started its workers
    (``peers_since``), not before (a process that a conftest started while the controller was configured
    carries the controller's cookie too).
    """
    return cookie == peer_cookie and (run == xdist_run
                                      or (peers_since is not None and start_ticks >= peers_since))


def sibling_claim(cookie: str, run: str | None, peer_cookie: str, xdist_run: str,
                  own_session_id: str) -> tuple[SessionRef, OwnerKind] | None:
    """The sibling worker's session that a process's ``cookie`` names (it extends our run's ``peer_cookie``
    by that worker's session id and a token, and the process carries our run's id ``run``), and the kind of
    owner there that started it; None if the cookie names no other worker of our run (ours included)."""
    prefix = peer_cookie + "/"
    if not cookie.startswith(prefix) or run != xdist_run:
        return None
    own_id, sep, rest = cookie[len(prefix):].partition(":")
    token = rest.split("/", 1)[0]
    ref = innermost_session(f"{prefix}{own_id}:{token}") if sep and "/" not in own_id else None
    if ref is None or ref.session_id == own_session_id or not token:
        return None
    return ref, "session" if token == SESSION else _OWNER_KINDS.get(token[0], "unknown")
