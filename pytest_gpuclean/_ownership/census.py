"""The census: the session's processes, and whose each is (the token that names its owner).

Our tree, cookie carriers outside it and dead sessions' debris, each pinned by its pidfd when found;
helpers and persistent processes are left out. A direct child that would be judged is asked about once
(``Managed``): who in the pytest process holds its handle. Nothing here judges or signals."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

from pytest_gpuclean._model.records import FoundBy, Owner, OwnerKind
from pytest_gpuclean._ownership.cookie import COOKIE_VAR, OWNER_VAR, new_session_id
from pytest_gpuclean._ownership.evidence import (
    PREEXISTING,
    SESSION,
    Ownership,
    SessionRef,
    dead_session_of,
    innermost_session,
    owner_named,
)
from pytest_gpuclean._ownership.handles import holders
from pytest_gpuclean._ownership.library_helpers import library_helpers, torch_shm_manager
from pytest_gpuclean._reading import processes, procfs
from pytest_gpuclean.report.text import one_line

XDIST_RUN_VAR = "PYTEST_XDIST_TESTRUNUID"
XDIST_WORKER_VAR = "PYTEST_XDIST_WORKER"
Registry = Callable[[], Mapping[int, tuple[str, "float | None"]]]
"""pid -> (what it is, when its record was written, or None where a live handle here proves it)."""
_RECORD_SLACK_S = 1.0
"""Start-time tick rounding and the file system's coarse clock: a process started after its record reuses
the pid."""
_DECLARED = "its command line matches --gpuclean-helpers"
"""Why a helper only ``--gpuclean-helpers`` vouches for is one (the session's end ends it)."""


_SINGLETON_PIPE = "--singleton-died-pipe"


def _mpi_singleton_daemon(pid: int, words: list[str], me: int) -> bool:
    """Whether ``pid`` is Open MPI's singleton daemon for this process (``import mpi4py.MPI`` without
    ``mpirun``): it serves the process for its life, and killing it hangs MPI in the next test. Evidence,
    not the name: this process holds the pipe at its ``--singleton-died-pipe FD``."""
    if _SINGLETON_PIPE not in words:
        return False
    try:
        fd = int(words[words.index(_SINGLETON_PIPE) + 1])
    except (IndexError, ValueError):
        return False
    pipe = procfs.fd_target(pid, fd)
    return pipe.startswith("pipe:") and pipe in procfs.pipes_of(me)


def _trees(walked: Sequence[tuple[int, int, int]], roots: Mapping[int, str]) -> dict[int, int]:
    """Each process of ``walked`` (pid, depth, parent; parents first) in the tree of one of ``roots``, with
    its root."""
    if not roots:
        return {}
    root_of: dict[int, int] = {}
    for pid, _depth, parent in walked:
        if pid in roots:
            root_of[pid] = pid
        elif parent in root_of:
            root_of[pid] = root_of[parent]
    return root_of


class CensusEntry:
    """A process that is ours (a descendant, or carrying a cookie of ours or of a dead session)."""

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

    def exited(self) -> bool:
        """As its pidfd says (one never pinned counts as exited)."""
        return self.handle is None or self.handle.exited()


class Sibling(NamedTuple):
    """Who in a live sibling xdist worker started a process: the worker and the owner its cookie names."""

    worker: str
    owner: Owner


_OWNER_KINDS: dict[str, OwnerKind] = {"t": "test", "f": "fixture"}
"""A cookie token's first letter: the kind of owner."""


class XdistPeers(NamedTuple):
    """An xdist worker's run: how it tells its sibling workers, and what they started, from its own."""

    run: str | None = None
    """``PYTEST_XDIST_TESTRUNUID``, in a worker only."""
    cookie: str | None = None
    """The cookie the workers started with: their controller's."""
    since: int | None = None
    """When the controller started its workers (boot ticks)."""


class KeptAlive(NamedTuple):
    """What the options and plugins say the session keeps alive."""

    helpers: tuple[str, ...] = ()
    """``--gpuclean-helpers``: command-line globs of the pytest process's children that serve it."""
    persistent: tuple[str, ...] = ()
    """``--gpuclean-persistent``: command-line globs of processes meant to outlive the session."""
    registry: Registry | None = None
    """Processes a plugin keeps alive across sessions (pytest-xprocess)."""


class Census:
    """The session's processes as the checks find them, each token decided once per process and kept."""

    def __init__(self, ownership: Ownership, *, uid: int, peers: XdistPeers | None = None,
                 kept: KeptAlive | None = None) -> None:
        assert ownership.began_tick is not None  # (the census of a session that began)
        peers, kept = peers or XdistPeers(), kept or KeptAlive()
        self.ownership = ownership
        self.helper_globs = kept.helpers
        self.persistent_globs = kept.persistent
        self.persistent_registry = kept.registry
        """Read only when there is something to look at."""
        self.helpers: dict[int, str] = {}
        """Left out by the last census as helpers, with why (descendants too): excused like this process."""
        self.persistent: dict[int, str] = {}
        """What the last census left out as persistent, with why (descendants too): never signalled, memory
        excused."""
        self.declared_helpers: dict[tuple[int, int], processes.Handle] = {}
        """Helpers only ``helper_globs`` vouched for, pinned: the session's end ends those still alive."""
        self._announced: set[tuple[int, int]] = set()
        self.notices: list[str] = []
        """One line per helper or persistent process when first seen (and per ``Managed`` decision), for
        the session's notes."""
        self.uid = uid
        self.session_start_ticks = ownership.began_tick
        """When the session began: a process carrying our cookie that is older is not ours (a recycled
        value)."""
        self.xdist_run = peers.run
        self.peer_cookie = peers.cookie
        """Our xdist siblings' starting cookie (the controller's): theirs, not a leak's."""
        self.peers_since = peers.since
        self._me = -1
        self._never_touch: set[int] = set()
        self._handles: dict[tuple[int, int], processes.Handle] = {}
        self._tokens: dict[tuple[int, int], str | None] = {}
        self._debris: dict[tuple[int, int], tuple[SessionRef, str | None]] = {}
        """Processes under us a dead nested session left: (that session, owner name)."""
        self.managed = Managed(ownership, self.notices, processes.command_line)
        """Who in the pytest process manages a direct child it started: asked once per child that would be
        judged."""
        self._tree = procfs.DescendantWalk()
        self.last: list[CensusEntry] = []
        """What the last census found (``--gpuclean-ray=auto`` looks there for a cluster the session
        started)."""
        # What already runs under us is the set-up's, never a test's leak; unless it or an ancestor predates
        # the session (``server & exec pytest`` leaves the server our child).
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
        """Whose is ``pid``, found under us at start outside our other trees: the set-up's if it carries
        our cookie or was provably born after the session began; otherwise it may predate it, and is left
        alone."""
        value = procfs.read_environ_vars(pid, (COOKIE_VAR,)).get(COOKIE_VAR)
        if value is not None and value.startswith(self.ownership.session_id + ":"):
            return SESSION
        return SESSION if self.ownership.existed_before(pid, start_ticks, upto) is False else PREEXISTING

    @classmethod
    def of_its_own(cls, *, peers: XdistPeers | None = None, kept: KeptAlive | None = None) -> Census:
        """The census of a session that begins now, with an id of its own (the ``gpuclean`` command's)."""
        began_tick, began_pid = procfs.boot_ticks_now(), procfs.last_pid()
        ownership = Ownership(new_session_id(None, *procfs.self_identity()), began_tick, began_pid)
        return cls(ownership, uid=os.getuid(), peers=peers, kept=kept)

    # ---- who we are (a forked test runner changes it) --------------------------------------------

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
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    # ---- the census ---------------------------------------------------------------------------

    def helper_pids(self) -> dict[int, str]:
        """The pytest process's own helpers that its libraries keep, with why."""
        return library_helpers()

    def _left_out(self, walked: list[tuple[int, int, int]], listed: AbstractSet[int],
                  roots: dict[int, str]) -> tuple[dict[int, str], dict[int, str]]:
        """Of a walk of our descendants, the helpers and persistent processes to leave out, with their
        descendants. A helper whose tree holds GPU memory (``listed``) is judged like any process: an
        excuse covering held memory would be a clean verdict beside it. ``roots``: the libraries' helpers
        (added to)."""
        shm_manager = torch_shm_manager()
        stats = self._tree.stats
        for pid, depth, _parent in walked:
            if depth != 1 or pid in roots:
                continue
            if self.managed.kept:
                stat = stats.get(pid) or procfs.read_stat(pid)
                kept = self.managed.kept.get((pid, stat.start_ticks)) if stat is not None else None
                if kept is not None:
                    roots[pid] = kept
                    continue
            if shm_manager is not None and procfs.exe_path(pid) == shm_manager:
                roots[pid] = ("torch's shared-memory manager (libshm), which the pytest process's shared "
                              "tensors use, and which ends once no process uses it")
                continue
            command = processes.command_line(pid)
            if _mpi_singleton_daemon(pid, command.split(), self.me):
                roots[pid] = ("Open MPI's daemon for the pytest process as an MPI singleton, which ends when "
                              "the pytest process does (it holds the daemon's --singleton-died-pipe)")
            elif self.helper_globs and processes.matches_any(command, self.helper_globs):
                roots[pid] = _DECLARED
        persistent = self.persistent_of([pid for pid, _, _ in walked], walked=True)
        helpers = _trees(walked, roots)
        spoiled = {root for pid, root in helpers.items() if pid in listed}
        self._note_new(roots, persistent, spoiled)
        return ({pid: roots[root] for pid, root in helpers.items() if root not in spoiled},
                {pid: persistent[root] for pid, root in _trees(walked, persistent).items()})

    def persistent_of(self, pids: Iterable[int], walked: bool = False) -> dict[int, str]:
        """Of ``pids``, this user's processes meant to outlive the session, with why: by command line, or
        recorded by ``persistent_registry`` before the process started (not a reused pid)."""
        if not (self.persistent_globs or self.persistent_registry is not None):
            return {}
        registry = self.persistent_registry() if self.persistent_registry is not None else {}
        found: dict[int, str] = {}
        for pid in pids:
            if not walked and not procfs.owned_by(pid, self.uid):
                continue
            record = registry.get(pid)
            if record is not None:
                name, recorded_at = record
                stat = procfs.read_stat(pid)
                if stat is not None and (recorded_at is None or procfs.ticks_to_wall(stat.start_ticks)
                                         <= recorded_at + _RECORD_SLACK_S):
                    found[pid] = name
                    continue
            if self.persistent_globs and processes.matches_any(processes.command_line(pid),
                                                               self.persistent_globs):
                found[pid] = "its command line matches --gpuclean-persistent"
        if found and not walked:
            self._note_new({}, found, set())
        return found

    def _note_new(self, helpers: dict[int, str], persistent: dict[int, str], spoiled: set[int]) -> None:
        for pid, how in (*helpers.items(), *persistent.items()):
            stat = procfs.read_stat(pid)
            if stat is None:
                continue
            key = (pid, stat.start_ticks)
            if pid in helpers and how == _DECLARED and pid not in spoiled and (
                    key not in self.declared_helpers):
                pinned = processes.pin(pid)
                if pinned is not None:
                    self.declared_helpers[key] = pinned[0]
            if key in self._announced or pid in spoiled:
                continue
            self._announced.add(key)
            born = self.ownership.owner(self.ownership.token_by_birth(pid, stat.start_ticks))
            during = f", started during {born}" if born.kind == "test" else ""
            cmd = one_line(processes.command_line(pid), 80)
            if pid in persistent:
                self.notices.append(
                    f"gpuclean: pid {pid} is persistent ({how}{during}): left running past the session, "
                    f"never signalled, its GPU memory excused in every check: {cmd}")
            else:
                self.notices.append(
                    f"gpuclean: pid {pid} is a helper of the pytest process ({how}{during}): not a leak, "
                    f"left to end with the session: {cmd}")

    def _walk(self, me: int | None = None) -> list[tuple[int, int, int]]:
        """Our descendants as (pid, depth, parent pid), parents first. ``me``: this process's pid, if just
        read."""
        if me is None:
            me = self.me
        return self._tree.walk(me, me)

    def _pin(self, pid: int) -> tuple[processes.Handle, procfs.ProcStat] | None:
        """A pinned process and its current stat; pinned once, when first found."""
        # Placed in the tree and pinned by the same reading.
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
        if parent_ours:
            # Whoever owns the parent owns the child, whatever its environment or birth say; a live fixture's
            # process takes its children along.
            self._tokens[key] = parent_token
            return parent_token
        if key not in self._tokens:
            values = procfs.read_environ_vars(pid, (COOKIE_VAR, OWNER_VAR))
            cookie = values.get(COOKIE_VAR)
            token = self.ownership.token_of_cookie(cookie)
            if token is None and self.ownership.existed_before(pid, start_ticks) is not False:
                token = PREEXISTING  # older than the session (or maybe): no part of it
            elif token is None:
                token = self.ownership.token_by_birth(pid, start_ticks)
                self.managed.born_bare(key, token)  # (no cookie of ours: its birth alone says whose)
            elif cookie is not None and self.ownership.is_protected(token):
                # Started under our set-up by a nested session since dead (a crashed xdist worker): its
                # debris.
                inner = dead_session_of(cookie, self.ownership.session_id, SessionRef.liveness)
                if inner is not None:
                    self._debris[key] = (inner, values.get(OWNER_VAR))
            self._tokens[key] = token
        return self._tokens[key]

    def take(self, scan_cookies: bool = False, dead_sessions: bool = False,
             listed: AbstractSet[int] = frozenset()) -> list[CensusEntry]:
        """Our processes: the descendant tree, plus cookie carriers outside it (a /proc scan), without
        helpers and persistent ones. ``listed``: the pids on the checked GPUs. ``dead_sessions``: also dead
        sessions' debris."""
        found: list[CensusEntry] = []
        by_pid: dict[int, CensusEntry] = {}
        me = self.me  # (read once: nothing here forks)
        my_sid: int | None = None  # (read when a direct child needs it: the clean path has none)
        seen_keys: set[tuple[int, int]] = set()
        walked = self._walk(me)
        # the clean path walks nothing: no helper is looked for then
        library = library_helpers() if walked or scan_cookies or dead_sessions else {}
        self.helpers, self.persistent = (self._left_out(walked, listed, dict(library)) if walked
                                         else ({}, {}))
        left_out = self.helpers.keys() | self.persistent.keys() if self.persistent else self.helpers
        for pid, depth, parent in walked:
            if pid in left_out:
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
            entry = CensusEntry(pid, stat.start_ticks, depth, found_by, token, state, handle)
            if entry.key in self._debris:
                entry.found_by = "dead session"
                entry.debris_of, entry.owner_name = self._debris[entry.key]
            by_pid[pid] = entry
            seen_keys.add(entry.key)
            found.append(entry)
        if scan_cookies or dead_sessions:
            found.extend(self._cookie_carriers(by_pid, library.keys() | self.helpers.keys(), dead_sessions,
                                               seen_keys))
        # A direct child that would be judged is first asked about once.
        asked = self.managed.asked
        # Not the set-up's (reaped after pytest_unconfigure), nor one born after its owner's processes were
        # first asked about: the test's code had run by then, so it made no handle.
        undecided = [f for f in found if f.depth == 1 and f.key not in asked and f.debris_of is None
                     and f.token is not None and f.token != SESSION and f.live
                     and not self.ownership.is_protected(f.token)
                     and not self.managed.born_since_asked(f.token, f.start_ticks)]
        if undecided:
            owners = self.managed.ask(undecided, found, listed)
            if owners is not None:
                self._tokens.update(owners)
                return self.take(scan_cookies, dead_sessions, listed)  # (once: each is asked once)
        self._forget_gone(seen_keys)
        self.last = found
        return found

    def _cookie_carriers(self, known: dict[int, CensusEntry], helpers: AbstractSet[int], dead_sessions: bool,
                         seen_keys: set[tuple[int, int]]) -> list[CensusEntry]:
        found: list[CensusEntry] = []
        prefix = "" if dead_sessions else self.ownership.session_id + ":"
        never_touch = self.never_touch
        carriers = [(pid, value) for pid, value in processes.cookie_holders(COOKIE_VAR, prefix, self.uid)
                    if pid not in known and pid not in never_touch and pid not in helpers]
        # A persistent process outlives its session by design: never a dead session's debris, never ours.
        persistent = self.persistent_of(pid for pid, _ in carriers) if carriers else {}
        for pid, value in carriers:
            if pid in persistent:
                self.persistent[pid] = persistent[pid]
                continue
            token = self.ownership.token_of_cookie(value)
            debris = None
            if token is None:
                debris = (dead_session_of(value, self.ownership.session_id, SessionRef.liveness)
                          if dead_sessions else None)
                if debris is None:
                    # A live session's (or a dead one nested in a live one), or no session's: never ours.
                    continue
            pinned = self._pin(pid)
            if pinned is None:
                continue
            handle, stat = pinned
            if stat.start_ticks < self.session_start_ticks and debris is None:
                continue  # carries our cookie but predates us: a recycled value, not our child
            owner_name = procfs.read_environ_vars(pid, (OWNER_VAR,)).get(OWNER_VAR) if debris else None
            entry = CensusEntry(pid, stat.start_ticks, 0, "dead session" if debris else "cookie", token,
                          "R" if procfs.live_state(pid, stat.state) else stat.state, handle, debris,
                          owner_name)
            seen_keys.add(entry.key)
            found.append(entry)
        return found

    def pinned(self, entries: Iterable[CensusEntry]) -> list[CensusEntry]:
        """The last census's own pinned entry for each of ``entries``: act on what the check decided on."""
        by_key = {f.key: f for f in self.last}
        return [by_key[e.key] for e in entries if e.key in by_key]

    def owner_of(self, f: CensusEntry) -> Owner:
        if f.debris_of is not None:
            if f.owner_name:
                return owner_named(f.owner_name)
            return Owner("session", f.debris_of.describe())
        return self.ownership.owner(f.token)

    def is_protected(self, f: CensusEntry) -> bool:
        """Not to be reaped now: an active fixture's, the session set-up's, or of unknown birth."""
        return f.debris_of is None and self.ownership.is_protected(f.token)

    def peer_pids(self, pids: Iterable[int]) -> set[int]:
        """Of ``pids``, our run's sibling xdist workers: they hold their own CUDA contexts, like we do."""
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
        """Of ``pids``, those a live sibling worker of our xdist run started, and who there did: the cookie
        extends our ``peer_cookie`` by a live peer's session id, and the process carries our run's id and
        is younger than that worker. Its session reaps it; a dead sibling's leftovers are debris."""
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
        """Whether ``ref`` names a live sibling worker: that very process, in our pid namespace, and a
        peer."""
        return (ref.pid_namespace == procfs.pid_namespace() and procfs.is_live(ref.pid, ref.start_ticks)
                and bool(self.peer_pids((ref.pid,))))

    def of_our_run(self, pid: int) -> bool:
        """Started by a sibling xdist worker: the run's, never outside, though this worker does not account
        for it."""
        if not self.xdist_run or not self.peer_cookie:
            return False
        value = procfs.read_environ_vars(pid, (COOKIE_VAR,)).get(COOKIE_VAR)
        return value is not None and value.startswith(self.peer_cookie + "/")

    def is_older(self, pid: int, start_ticks: int) -> bool:
        """Whether ``pid`` (started at ``start_ticks``), or the process that started it, existed before the
        session."""
        return self._tokens.get((pid, start_ticks)) == PREEXISTING


# ---- xdist siblings, over plain values (the readings are the caller's) ---------------------------


def is_peer(cookie: str | None, run: str | None, start_ticks: int, peer_cookie: str, xdist_run: str,
            peers_since: int | None) -> bool:
    """Whether a direct child of our controller is a sibling worker: it started with the controller's own
    cookie (a worker's test's processes carry the worker's longer one). xdist exports the run id only once
    the worker runs, so without it the child must have started at or after ``peers_since``."""
    return cookie == peer_cookie and (run == xdist_run
                                      or (peers_since is not None and start_ticks >= peers_since))


def sibling_claim(cookie: str, run: str | None, peer_cookie: str, xdist_run: str,
                  own_session_id: str) -> tuple[SessionRef, OwnerKind] | None:
    """The sibling worker's session ``cookie`` names, and the kind of owner there that started the process;
    None if it names no other worker of our run."""
    prefix = peer_cookie + "/"
    if not cookie.startswith(prefix) or run != xdist_run:
        return None
    own_id, sep, rest = cookie[len(prefix):].partition(":")
    token = rest.split("/", 1)[0]
    ref = innermost_session(f"{prefix}{own_id}:{token}") if sep and "/" not in own_id else None
    if ref is None or ref.session_id == own_session_id or not token:
        return None
    return ref, "session" if token == SESSION else _OWNER_KINDS.get(token[0], "unknown")


_Key = tuple[int, int]
FixtureValues = Callable[[], Iterable[tuple[str, object]]]
"""The values of the fixtures wider than a test that are set up now, each with its token."""
_PROTECTING_KINDS = ("fixture", "session")


class Managed:
    """What the census learnt of its direct children from the pytest process's objects (mutable, kept for
    the session)."""

    def __init__(self, ownership: Ownership, notices: list[str], command_line: Callable[[int], str]) -> None:
        self.ownership = ownership
        self.notices = notices
        self.command_line = command_line
        """For the notes."""
        self.fixture_values: FixtureValues | None = None
        """Set by the session layer."""
        self.suite_files: tuple[str, ...] = ()
        """File name patterns of the suite's own modules (``python_files``, ``conftest.py``): their globals
        keep nothing for the pytest process."""
        self.asked: set[_Key] = set()
        """Once per process."""
        self._first_asked: dict[str, int] = {}
        """Per owner's token, when its processes were first asked about (boot ticks)."""
        self.kept: dict[_Key, str] = {}
        """Direct children whose handle a module global keeps: the pytest process's helpers, with why."""
        self._born_bare: set[_Key] = set()
        """Owned by nothing but their birth in a test's window (no cookie of ours)."""
        self._bare: dict[_Key, bool] = {}
        """Whether a process carries no cookie of this session (read once, when it matters)."""

    def born_bare(self, key: _Key, token: str | None) -> None:
        """The census gave ``key`` (no cookie of ours) ``token`` by its birth alone."""
        self._bare[key] = True
        if token is not None and self.ownership.owner(token).kind == "test":
            self._born_bare.add(key)

    def born_since_asked(self, token: str, start_ticks: int) -> bool:
        """Whether a process of ``token``'s started a clock tick after that owner's processes were first
        asked about."""
        first = self._first_asked.get(token)
        return first is not None and start_ticks > first

    def ask(self, undecided: Sequence[CensusEntry], found: Sequence[CensusEntry],
            listed: AbstractSet[int] = frozenset()) -> dict[_Key, str] | None:
        """Whose are ``undecided`` (direct children that would be judged now), each asked once: the new
        token of each whose owner changed, None if none did; helpers go to ``kept``. For GPU holders
        (``listed``) only a live fixture's holding changes the verdict, so the modules are not walked."""
        now = procfs.boot_ticks_now()
        for f in undecided:
            if f.token is not None:
                self._first_asked.setdefault(f.token, now)
        values = list(self.fixture_values()) if self.fixture_values is not None else []
        held = holders([f.pid for f in undecided if f.pid not in listed], values, self.suite_files)
        held.update(holders([f.pid for f in undecided if f.pid in listed], values, modules=False))
        owners: dict[_Key, str] = {}
        changed = unmanaged = False
        for f in undecided:
            self.asked.add(f.key)
            holder = held.get(f.pid)
            if holder is not None and holder[0] == "module":
                self.kept[f.key] = f"its handle, a {holder[2]}, is kept in {holder[1]}"
                changed = True
            elif holder is not None and holder[0] == "fixture":
                owners[f.key] = holder[1]
                self.notices.append(
                    f"gpuclean: pid {f.pid} is {self.ownership.owner(holder[1])}'s, not "
                    f"{self.ownership.owner(f.token)}'s: the fixture's value holds its handle "
                    f"({holder[2]}); protected while the fixture is set up: {self._command(f.pid)}")
            elif holder is None and f.key in self._born_bare:
                token = self._ambiguous(f, found)
                if token is not None:
                    owners[f.key] = token
                else:
                    unmanaged = unmanaged or f.pid not in listed
            else:
                unmanaged = unmanaged or f.pid not in listed
        if unmanaged:
            # What nothing holds may be garbage in a cycle (a dropped multiprocessing Manager): collected now,
            # its finalizer ends the process, which then exits by itself. Not for a GPU holder: an engine
            # dropped unshut is the leak this plugin exists for; and collecting torch's heap is slow.
            gc.collect()
        return owners if owners or changed else None

    def _ambiguous(self, orphan: CensusEntry, found: Sequence[CensusEntry]) -> str | None:
        """The token of ``orphan`` (no cookie of ours, no handle, born in a test's window) if a protected
        process that could have started it is alive: then it is not surely the test's. None otherwise."""
        ownership = self.ownership
        protectors: list[CensusEntry] = []
        for f in found:
            if (f is orphan or not f.live or f.token is None or f.start_ticks > orphan.start_ticks
                    or f.debris_of is not None):
                continue
            if f.token != PREEXISTING and ownership.owner(f.token).kind not in _PROTECTING_KINDS:
                continue
            if self._carries_no_cookie(f):
                protectors.append(f)
        if not protectors:
            return None
        tokens = list(dict.fromkeys(str(f.token) for f in protectors))
        who = "; ".join(f"pid {f.pid} ({_owned_by(ownership, f.token)})" for f in protectors[:3])
        were = "was" if len(protectors) == 1 else "were"
        why = (f"no cookie of the session, born during {ownership.owner(orphan.token)} while {who}, whose "
               f"children carry no cookie of the session, {were} alive: either may have started it")
        token = ownership.ambiguous_token(str(orphan.token), tokens, why)
        until = ("never signalled: it may descend from a process older than the session"
                 if PREEXISTING in tokens else f"judged again when {ownership.owner(tokens[0])} ends")
        self.notices.append(
            f"gpuclean: pid {orphan.pid} left alone ({why}); {until}: {self._command(orphan.pid)}")
        return token

    def _carries_no_cookie(self, f: CensusEntry) -> bool:
        """Read once per process: its children then carry none either, unless it gives them one."""
        bare = self._bare.get(f.key)
        if bare is None:
            if f.token == PREEXISTING:
                bare = True
            else:
                value = procfs.read_environ_vars(f.pid, (COOKIE_VAR,)).get(COOKIE_VAR)
                bare = value is None or not value.startswith(self.ownership.session_id + ":")
            self._bare[f.key] = bare
        return bare


    def _command(self, pid: int) -> str:
        return one_line(self.command_line(pid), 80)


def _owned_by(ownership: Ownership, token: str | None) -> str:
    return "older than the session" if token == PREEXISTING else str(ownership.owner(token))
