"""A stray is what nothing manages: whose a direct child of the pytest process is, once it would be judged.

The census (``census.py``) gives each process a token by ancestry, cookie or birth. For a direct child of the
pytest process that would now be judged (a test's or a fixture's that ended), two more facts decide, read
once per process (pid and start time), off the clean path:

- **who holds its handle** (``handles.holders``): one a module global keeps is the pytest process's helper
  (a library's reusable pool, a cached executor, a service kept for the process's life), whichever test's
  call started it; one a live fixture's value holds (a factory's closure included) is that fixture's,
  protected while it is set up and judged as its leak when it ends. One that only the standard library's
  bookkeeping holds (a ``Popen`` dropped while it runs, a dropped executor's workers) is the pytest
  process's own child that nothing manages: its birth decides, as before.
- **parentage and timing are not ownership**: one that nothing holds and that carries no cookie of ours
  (born in a test's window) may be an orphan that the subreaper adopted from a protected process whose
  children carry no cookie of ours (a live fixture's server with a scrubbed environment, a process older
  than the session), its middle process gone before any walk. Where such a process was alive, born before
  it, the orphan is neither's for sure (``Ownership.ambiguous_token``): left alone, named once, protected
  while that process's owner is (judged as the fixture's when it ends; never, beside a process older than
  the session). Its GPU memory is excused like the fixture's own: later tests do not wait for it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from pytest_gpuclean.core.ownership.cookie import COOKIE_VAR
from pytest_gpuclean.core.ownership.cookie import PREEXISTING_TOKEN as PREEXISTING
from pytest_gpuclean.core.ownership.handles import holders
from pytest_gpuclean.core.reading import procfs
from pytest_gpuclean.model.records import CensusEntry, Owner
from pytest_gpuclean.model.text import one_line

__all__ = [
    "FixtureValues",
    "Managed",
    "Owners",
]

_Key = tuple[int, int]
FixtureValues = Callable[[], Iterable[tuple[str, object]]]
"""The values of the fixtures wider than a test that are set up now, each with its token (the session
layer's ``ItemChecks.live_fixture_values``)."""
_PROTECTING_KINDS = ("fixture", "session")


class Owners(Protocol):
    """What of ``evidence.Ownership`` this module uses (a protocol: importing it would add a floor under the
    census, ``tests/test_layers.py``)."""

    @property
    def session_id(self) -> str: ...
    def owner(self, token: str | None) -> Owner: ...
    def ambiguous_token(self, test: str, protectors: Iterable[str], why: str) -> str: ...


class Managed:
    """What the census learnt of its direct children from the pytest process's objects (no record: the
    census's mutable state, kept for the session)."""

    def __init__(self, ownership: Owners, notices: list[str], command_line: Callable[[int], str]) -> None:
        self.ownership = ownership
        self.notices = notices
        self.command_line = command_line
        """A process's command line (``processes.command_line``), for the notes."""
        """The census's notes (one line per decision, once)."""
        self.fixture_values: FixtureValues | None = None
        """Where the live fixtures' values are read (set by the session layer)."""
        self.suite_files: tuple[str, ...] = ()
        """File name patterns of the suite's own modules (pytest's ``python_files`` and ``conftest.py``; set
        by the session layer): their globals keep nothing for the pytest process."""
        self.asked: set[_Key] = set()
        """Direct children asked about: once per process."""
        self._first_asked: dict[str, int] = {}
        """Per owner's token, when its processes were first asked about (boot ticks)."""
        self.kept: dict[_Key, str] = {}
        """Direct children whose handle a module global keeps: the pytest process's helpers, with why."""
        self._born_bare: set[_Key] = set()
        """Processes owned by nothing but their birth in a test's window (no cookie of ours)."""
        self._bare: dict[_Key, bool] = {}
        """Whether a process's environment carries no cookie of this session (read once, when it matters)."""

    def born_bare(self, key: _Key, token: str | None) -> None:
        """The census gave ``key``, which carries no cookie of ours, ``token`` by its birth alone."""
        self._bare[key] = True
        if token is not None and self.ownership.owner(token).kind == "test":
            self._born_bare.add(key)

    def born_since_asked(self, token: str, start_ticks: int) -> bool:
        """Whether a process of ``token``'s started (``start_ticks``) a clock tick after that owner's
        processes were first asked about."""
        first = self._first_asked.get(token)
        return first is not None and start_ticks > first

    def ask(self, undecided: Sequence[CensusEntry], found: Sequence[CensusEntry],
            listed: AbstractSet[int] = frozenset()) -> dict[_Key, str] | None:
        """Whose are ``undecided`` (direct children of the pytest process that would be judged now; ``found``:
        the whole census), each asked once: the new token of each whose owner changed (a live fixture's,
        an ambiguous one's); None if nothing changed. A helper is added to ``kept``. ``listed``: the pids the
        driver lists on the checked GPUs: a helper that holds GPU memory is judged like any process, so for
        those only a live fixture's holding can change the verdict, and the heap's modules are not walked (a
        leak of GPU memory is then reaped as soon as it is at rest, not after a walk of the heap)."""
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
            # What nothing holds may be garbage in a reference cycle that the collector has not reached yet (a
            # dropped multiprocessing Manager, an executor in a cycle): collected now, its library's finalizer
            # ends the process as it would at the next collection, and the settle time sees it exit by itself.
            # (Not for a process that holds GPU memory: an engine dropped unshut, waiting for a collection
            # that may never come, is the leak this plugin exists for, and a collection of a torch process's
            # heap costs a tenth of a second.)
            gc.collect()
        return owners if owners or changed else None

    def _ambiguous(self, orphan: CensusEntry, found: Sequence[CensusEntry]) -> str | None:
        """The token of ``orphan`` (no cookie of ours, no handle in the pytest process, born in a test's
        window) if a protected process that could have started it was alive: one of our tree, of a fixture,
        the session set-up or older than the session, whose children carry no cookie of ours, born no
        later than the orphan and alive now. None where there is none: the orphan is the test's."""
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
        """Whether ``f``'s environment carries no cookie of this session (read once per process): its
        children then carry none either, unless it gives them one."""
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


def _owned_by(ownership: Owners, token: str | None) -> str:
    return "older than the session" if token == PREEXISTING else str(ownership.owner(token))
