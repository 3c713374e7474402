"""The check's decisions over plain data, unit-tested without processes: ownership by birth
(``evidence.born_in``, ``older_than_session``), which processes of a census are judged, excused or of
unknown owner (``decisions.sort_census``), which xdist siblings and peers are excused (``census.is_peer``,
``sibling_claim``), which cookie carriers are a dead session's debris and which another session's
(``evidence.dead_session_of``), what memory is an offender (``decisions.excess_memory``, the context
overhead), what may be signalled at all (the signal gate, ``gate.refusal``), which owners replace themselves
(``decisions.self_replacing``) and when waiting is hopeless
(``decisions.hopeless``, with ``decisions.outside_of``: what cannot be the session's, and
``decisions.known_outside``: what an earlier check already waited out).

What needs the kernel (pids, pidfds, signals, /proc) stays in tests/test_checker.py, test_reaper.py and
test_faults.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pytest_gpuclean._check import decisions, gate
from pytest_gpuclean._check.decisions import OutsideState, known_outside, outside_of
from pytest_gpuclean._model.records import (
    MIB,
    Credentials,
    DeviceInfo,
    DeviceSnapshot,
    GpuProcess,
    Offender,
    Owner,
    ProcessInfo,
)
from pytest_gpuclean._ownership.census import CensusEntry, is_peer, sibling_claim
from pytest_gpuclean._ownership.evidence import (
    PREEXISTING,
    SESSION,
    Ownership,
    SessionRef,
    Window,
    born_in,
    dead_session_of,
    fixture_owner,
    older_than_session,
    owner_named,
    pid_between,
)

SPACE = 1 << 22  # pid_max on a 64-bit kernel
GPU0 = DeviceInfo(0, "GPU-0000", "Fake")
GPU1 = DeviceInfo(1, "GPU-1111", "Fake")
ME, PARENT = 100, 50
SESSION_ID = "gc.1.2.3.aa"

# ---- ownership by birth --------------------------------------------------------------------------------

# A fixture's window (pids 1000..2000, ticks 100..200) and, inside it, a test's (pids 1500..1600, ticks
# 150..160); the test's window is still open ("now": pid 1650, tick 165) in the OPEN cases.
FIXTURE = Window("f1", 1000, 100, 2000, 200)
TEST = Window("t2", 1500, 150, 1600, 160)
OPEN_TEST = Window("t2", 1500, 150)


@pytest.mark.parametrize(("windows", "pid", "start", "token"), [
    pytest.param([FIXTURE, TEST], 1550, 155, "t2", id="in the innermost window"),
    pytest.param([FIXTURE, TEST], 1200, 120, "f1", id="in the fixture's window, before the test's"),
    pytest.param([FIXTURE, TEST], 1200, 155, "f1", id="test's time, fixture's pid: not the test's"),
    pytest.param([FIXTURE, TEST], 2500, 250, SESSION, id="after every window: the session's"),
    pytest.param([FIXTURE, TEST], 900, 99, SESSION, id="before every window: the session's"),
    pytest.param([FIXTURE, TEST], 2500, 150, SESSION, id="test's time, a later pid: the session's"),
    pytest.param([FIXTURE, OPEN_TEST], 1620, 163, "t2", id="open window: up to now"),
    pytest.param([FIXTURE, OPEN_TEST], 1700, 163, "f1", id="open window: a pid after now is not its"),
    pytest.param([Window("t1", None, 100, None, 200)], 5, 150, "t1", id="no pid readings: strictly inside"),
    pytest.param([Window("t1", None, 100, None, 200)], 5, 200, None, id="no pid readings: a shared tick"),
    pytest.param([Window("t1", 10, 100, 10 + SPACE // 2 + 1, 200)], 5, 100, None,
                 id="a window through half the pid space proves nothing by pid"),
])
def test_born_in(windows: list[Window], pid: int, start: int, token: str | None) -> None:
    assert born_in(windows, pid, start, 1650, 165, SPACE) == token


@pytest.mark.parametrize(("pid", "start", "last_pid", "older"), [
    pytest.param(600, 999, 700, True, id="an earlier tick"),
    pytest.param(400, 1001, 700, False, id="a later tick"),
    pytest.param(501, 1000, 700, False, id="the same tick, a pid allocated since"),
    pytest.param(500, 1000, 700, True, id="the same tick, the export's own pid reading"),
    pytest.param(800, 1000, 700, True, id="the same tick, a pid not allocated since"),
    pytest.param(501, 1000, None, None, id="the same tick, no later reading"),
    pytest.param(501, 1000, 500 + SPACE // 2 + 1, None, id="the same tick, pids may have wrapped"),
])
def test_older_than_session(pid: int, start: int, last_pid: int | None, older: bool | None) -> None:
    assert older_than_session(pid, start, 1000, 500, last_pid, SPACE) is older


def test_pid_between_wraps_around_the_pid_space() -> None:
    assert pid_between(3, SPACE - 10, 5, SPACE) is True  # allocated after the wrap
    assert pid_between(SPACE - 5, SPACE - 10, 5, SPACE) is True
    assert pid_between(SPACE - 20, SPACE - 10, 5, SPACE) is False
    assert pid_between(3, None, 5, SPACE) is None


def test_ownership_asks_born_in_with_its_windows() -> None:
    ownership = Ownership(SESSION_ID, began_tick=100, began_pid=900)
    ownership.windows += [FIXTURE, TEST]
    assert ownership.token_by_birth(1550, 155) == "t2"
    assert ownership.existed_before(600, 99) is True and ownership.existed_before(600, 101) is False


# ---- the census sorted against a snapshot ---------------------------------------------------------------

DEAD = SessionRef("gc.9.8.3.dd", 9, 8, 3)


def found(pid: int, token: str | None, *, state: str = "S", debris: SessionRef | None = None) -> CensusEntry:
    return CensusEntry(pid, pid * 10, 1, "descendant", token, state, debris_of=debris)  # type: ignore[arg-type]


def protected_by(ownership: Ownership) -> Callable[[CensusEntry], bool]:
    """As ``Census.is_protected``: debris of a dead session never is; otherwise as the token says."""
    return lambda f: f.debris_of is None and ownership.is_protected(f.token)


@pytest.fixture
def ownership() -> Ownership:
    ownership = Ownership(SESSION_ID)
    for token in ("t1", "f2"):
        ownership.owners[token] = ownership.owner(None)  # (known tokens; whose does not matter here)
    ownership.active_fixtures.add("f2")
    return ownership


@pytest.mark.parametrize(("process", "judged", "excused", "unknown"), [
    pytest.param(found(201, "t1"), True, False, False, id="a test's: judged"),
    pytest.param(found(202, "f2"), False, True, False, id="a live fixture's: excused"),
    pytest.param(found(203, SESSION), False, True, False, id="the session set-up's: excused"),
    pytest.param(found(204, PREEXISTING), False, True, False, id="older than the session: excused"),
    pytest.param(found(205, None), False, False, True, id="unknown birth: reported, not excused"),
    pytest.param(found(206, None, state="Z"), False, False, False, id="unknown birth, exited: nothing"),
    pytest.param(found(207, None, debris=DEAD), True, False, False, id="a dead session's debris: judged"),
])
def test_sort_census(ownership: Ownership, process: CensusEntry, judged: bool, excused: bool,
                     unknown: bool) -> None:
    listed = {process.pid, 999}
    sort = decisions.sort_census([process], protected_by(ownership), {ME, PARENT}, {77}, listed)
    ours, unknowns, excused_pids, unexplained = sort.ours, sort.unknown, sort.excused, sort.unexplained
    assert (process in ours, process.pid in excused_pids, process in unknowns) == (judged, excused, unknown)
    # Each listed pid is judged, reported, excused or unexplained: never two of them, never none.
    assert unexplained == {999} | ({process.pid} - {p.pid for p in ours + unknowns} - excused_pids)
    assert {ME, PARENT, 77} <= excused_pids  # this process, its ancestors, multiprocessing's helpers


@pytest.mark.parametrize(("process", "at_session_end", "at_the_very_end"), [
    pytest.param(found(301, "t1"), True, True, id="a test's"),
    pytest.param(found(302, "f2"), True, True, id="a fixture's"),
    pytest.param(found(303, SESSION), False, True, id="the session set-up's: only at the very end"),
    pytest.param(found(304, PREEXISTING), False, False, id="older than the session: never"),
    pytest.param(found(305, None), False, False, id="unknown birth: never (reported, not signalled)"),
    pytest.param(found(306, "t1", state="Z"), False, False, id="exited: holds nothing"),
])
def test_of_the_sweep(process: CensusEntry, at_session_end: bool, at_the_very_end: bool) -> None:
    # The session-end sweep and, with reaping off, the closing note of what it would have ended: one rule.
    assert (process in decisions.of_the_sweep([process], (PREEXISTING, SESSION))) == at_session_end
    assert (process in decisions.of_the_sweep([process], (PREEXISTING,))) == at_the_very_end


def test_sort_census_once_the_session_is_over(ownership: Ownership) -> None:
    # The very last sweep: what the session set-up started is no longer protected; a live fixture's is.
    ownership.session_over = True
    sort = decisions.sort_census([found(203, SESSION), found(202, "f2")], protected_by(ownership), (), (),
                                 set())
    assert [f.pid for f in sort.ours] == [203] and sort.excused == {202}


@pytest.mark.parametrize(("cookie", "run", "start", "peer"), [
    pytest.param("C", "run1", 5, True, id="the controller's cookie and our run"),
    pytest.param("C", None, 50, True, id="run id not yet exported, started with the workers"),
    pytest.param("C", None, 5, False, id="run id not yet exported, started before the workers"),
    pytest.param("C", "run2", 50, True, id="another run id, started with the workers"),
    pytest.param("C/gc.4.5.3.bb:t7", "run1", 50, False, id="a worker's test's process: a leak, no peer"),
    pytest.param(None, "run1", 50, False, id="no cookie"),
])
def test_is_peer(cookie: str | None, run: str | None, start: int, peer: bool) -> None:
    assert is_peer(cookie, run, start, "C", "run1", peers_since=40) is peer


@pytest.mark.parametrize(("cookie", "run", "claim"), [
    pytest.param("C/gc.4.5.3.bb:t7", "run1", ("gc.4.5.3.bb", 4, "test"), id="a sibling's test"),
    pytest.param("C/gc.4.5.3.bb:f2/gc.6.7.3.cc:t1", "run1", ("gc.4.5.3.bb", 4, "fixture"),
                 id="nested under a sibling's fixture: that sibling's"),
    pytest.param("C/gc.4.5.3.bb:session", "run1", ("gc.4.5.3.bb", 4, "session"), id="a sibling's set-up"),
    pytest.param("C/gc.4.5.3.bb:t7", "run2", None, id="another run"),
    pytest.param("C/gc.1.2.3.aa:t7", "run1", None, id="our own session's"),
    pytest.param("C:t7", "run1", None, id="the controller's own test"),
    pytest.param("C/gc.4.5.3.bb:", "run1", None, id="no token"),
    pytest.param("C/nonsense:t7", "run1", None, id="no session id"),
    pytest.param("D/gc.4.5.3.bb:t7", "run1", None, id="another controller's"),
])
def test_sibling_claim(cookie: str, run: str, claim: tuple[str, int, str] | None) -> None:
    got = sibling_claim(cookie, run, "C", "run1", "C/gc.1.2.3.aa")
    assert (None if got is None else (got[0].session_id.rsplit("/", 1)[-1], got[0].pid, got[1])) == claim


# ---- memory ----------------------------------------------------------------------------------------------


def snap(device: DeviceInfo, used_mib: float, *processes: tuple[int, float | None]) -> DeviceSnapshot:
    listed = tuple(GpuProcess(pid, None if mib is None else int(mib * MIB)) for pid, mib in processes)
    return DeviceSnapshot(device, int(used_mib * MIB), 80 * 1024 * MIB, listed)


@pytest.mark.parametrize(("reading", "blamed", "extra_mib"), [
    pytest.param(snap(GPU0, 0), set(), None, id="idle"),
    pytest.param(snap(GPU0, 500, (ME, 500)), set(), None, id="all ours"),
    pytest.param(snap(GPU0, 500), set(), 470, id="held by no process we can see"),
    pytest.param(snap(GPU0, 10), set(), None, id="within the tolerance"),
    pytest.param(snap(GPU0, 530, (ME, 500)), set(), None, id="our context's overhead"),
    pytest.param(snap(GPU0, 800, (ME, 500), (300, 300)), {300}, None, id="explained by an offender"),
    pytest.param(snap(GPU0, 800, (ME, 500), (300, 300)), set(), 270, id="an unblamed holder's memory"),
])
def test_excess_memory(reading: DeviceSnapshot, blamed: set[int], extra_mib: float | None) -> None:
    excess = decisions.excess_memory([reading], {ME}, {GPU0.uuid: 30 * MIB}, 16 * MIB, blamed)
    assert [extra / MIB for _, extra in excess] == ([] if extra_mib is None else [extra_mib])


def test_listed_contexts_explain_unlisted_memory_up_to_their_overhead() -> None:
    readings = [snap(GPU0, 509, (ME, 500)), snap(GPU1, 600, (ME, 500))]
    overhead, short = decisions.listed_overhead(readings, {ME})
    assert overhead == {GPU0.uuid: 9 * MIB}  # one context's overhead: excused
    assert [(s.device, listed, unlisted / MIB) for s, listed, unlisted, _ in short] == [(GPU1, {ME}, 100)]
    # Not all listed processes excused: nothing is.
    assert decisions.listed_overhead([snap(GPU0, 509, (ME, 500), (300, None))], {ME}) == ({GPU0.uuid: 0}, [])


def test_unlisted_cuda_users_raise_the_excused_overhead() -> None:
    # GPU1: 100 MiB unlisted beside our listed context; the parent uses CUDA there without a context.
    _, short = decisions.listed_overhead([snap(GPU1, 600, (ME, 500))], {ME, PARENT})
    assert decisions.short_of_users(short, {})
    users = {PARENT: frozenset({GPU1.uuid})}
    assert not decisions.short_of_users(short, users)
    self_cuda: set[str] = set()
    assert decisions.context_overhead(short, users, ME, self_cuda) == {GPU1.uuid: 100 * MIB}
    assert self_cuda == set()
    # This process itself, on a device where it is not listed: named, as the check notes it.
    _, short = decisions.listed_overhead([snap(GPU1, 200, (PARENT, 64))], {ME, PARENT})
    users = {ME: frozenset({GPU1.uuid})}
    assert decisions.context_overhead(short, users, ME, self_cuda) == {GPU1.uuid: 128 * MIB}
    assert self_cuda == {GPU1.label}


def test_mib_of_lists_the_devices_a_process_is_on() -> None:
    readings = [snap(GPU0, 500, (ME, 500)), snap(GPU1, 0), snap(GPU1, 64, (ME, None))]
    assert decisions.mib_of(ME, readings) == ((GPU0.label, 500.0), (GPU1.label, 0.0))


# ---- what may be signalled, and when waiting is hopeless ----------------------------------------------


VICTIM_PROC = ProcessInfo(301, 3010, 300, 1001, "victim", "python3 logsig.py", "sleeping")
OTHER_PROC = ProcessInfo(302, 3020, 300, 1002, "other", "sleep 600", "sleeping")


@pytest.mark.parametrize(("credentials", "itself", "protected", "refused"), [
    pytest.param(Credentials(300, ((1000, "ci"),)), False, False, None, id="ours, this user's"),
    pytest.param(None, False, False, None, id="gone already: reported, no signal reaches anything"),
    pytest.param(Credentials(300, ((1001, "victim"),)), False, False, "another user's process",
                 id="another user's (setpriv'd: every uid is theirs)"),
    pytest.param(Credentials(300, ((0, "root"),)), False, False, "another user's process", id="root's"),
    pytest.param(Credentials(300, ((0, "root"), (1000, "ci"))), False, False,
                 "another user's process (it runs as root too)",
                 id="a setuid program, or a thread that changed its credentials"),
    pytest.param(Credentials(300, ((1000, "ci"),), (VICTIM_PROC,)), False, False,
                 "a signal to it may be relayed to pid 301 of user victim (python3 logsig.py), its "
                 "descendant: su, sudo and runuser pass signals on",
                 id="a relay (su, runuser): its descendant is theirs"),
    pytest.param(Credentials(300, ((1000, "ci"),), (VICTIM_PROC, OTHER_PROC)), False, False,
                 "a signal to it may be relayed to pid 301 of user victim (python3 logsig.py), its "
                 "descendant, and to 1 more descendant(s) of other users: su, sudo and runuser pass "
                 "signals on",
                 id="a relay to several"),
    pytest.param(Credentials(300, ((1000, "ci"),)), False, True,
                 "not provably ours now (a live fixture's, the session set-up's, or older than the session)",
                 id="protected (a live fixture's, the set-up's, older)"),
    pytest.param(Credentials(300, ((1000, "ci"),)), True, False, "gpuclean itself or one of its ancestors",
                 id="this process or an ancestor"),
])
def test_the_signal_gate(credentials: Credentials | None, itself: bool, protected: bool,
                         refused: str | None) -> None:
    assert gate.refusal(credentials, 1000, itself=itself, protected=protected) == refused


@pytest.mark.parametrize(("births", "older_alive", "chains"), [
    pytest.param({"t1": {(1, 1), (2, 2), (3, 3)}}, set(), {"t1"},
                 id="three born, nothing older left: a chain"),
    pytest.param({"t1": {(1, 1), (2, 2)}}, set(), set(), id="two born: a daemon's double fork, no chain"),
    pytest.param({"t1": {(1, 1), (2, 2), (3, 3)}}, {"t1"}, set(),
                 id="an older process of its owner lives on: a supervisor, reaped in order"),
    pytest.param({None: {(1, 1), (2, 2), (3, 3)}}, set(), set(), id="of unknown birth: never signalled"),
    pytest.param({"t1": {(1, 1), (2, 2), (3, 3)}, "t2": {(4, 4)}}, {"t3"}, {"t1"}, id="per owner"),
])
def test_self_replacing(births: dict[str | None, set[tuple[int, int]]], older_alive: set[str | None],
                        chains: set[str | None]) -> None:
    assert decisions.self_replacing(births, older_alive) == chains


@pytest.mark.parametrize(("uid", "reap", "detail"), [
    (1001, True, "belongs to another user (other): never killed"),
    (1000, False, "reaping is off"),
    (1000, True, "could not be reaped (stopped)"),
])
def test_leak_detail(uid: int, reap: bool, detail: str) -> None:
    assert decisions.leak_detail(uid, "other", "stopped", 1000, reap) == detail


def leak(pid: int) -> Offender:
    return Offender("leaked", ProcessInfo(pid, pid * 10, 1, 1000, "ci", "sleep 600", "sleeping"), None,
                    "descendant")


MEMORY = Offender("memory", None, None, "gpu", ((GPU0.label, 500.0),))


@pytest.mark.parametrize(("offenders", "unsignalled", "outside_on", "hopeless"), [
    pytest.param([], set(), set(), False, id="clean: nothing to wait for"),
    pytest.param([leak(300)], {(300, 3000)}, set(), True, id="a leak that survived SIGKILL"),
    pytest.param([leak(300)], set(), set(), False, id="a leak still ending"),
    pytest.param([leak(300)], {(300, 9999)}, set(), False, id="the pid reused: another process"),
    pytest.param([MEMORY], set(), {GPU0.uuid}, True, id="outside, waited out before"),
    pytest.param([MEMORY], set(), set(), False, id="outside, new"),
    pytest.param([MEMORY, leak(300)], {(300, 3000)}, {GPU0.uuid}, True, id="both hopeless"),
    pytest.param([MEMORY, leak(300)], set(), {GPU0.uuid}, False, id="one worth waiting for"),
])
def test_hopeless(offenders: list[Offender], unsignalled: set[tuple[int, int]], outside_on: set[str],
                  hopeless: bool) -> None:
    outside = {id(o): frozenset({GPU0.uuid}) for o in offenders if o.reason == "memory"}
    assert decisions.hopeless(offenders, unsignalled, outside, outside_on) is hopeless


def foreign(pid: int, *on: DeviceInfo) -> Offender:
    info = ProcessInfo(pid, pid * 10, 1, 1000, "ci", "sleep 600", "sleeping")
    return Offender("foreign", info, None, "gpu", tuple((d.label, 100.0) for d in on))


def test_outside_of_finds_what_cannot_be_the_sessions() -> None:
    stranger, sibling_run, ours = foreign(300, GPU0), foreign(400, GPU1), leak(500)
    memory = Offender("memory", None, None, "gpu", ((GPU1.label, 200.0),))
    readings = [snap(GPU0, 612, (300, 100), (ME, 500)), snap(GPU1, 800, (400, 100), (ME, 500))]
    found, states, clean = outside_of(
        [stranger, sibling_run, ours, memory], readings, (GPU0, GPU1), {ME}, [found_pid(500)], {300, 400},
        {}, 16 * MIB, of_our_run={400}, start_ticks={300: 3000, 400: 4000})
    # A stranger's process and memory nobody holds: outside. A sibling worker's: the run's. A leak: ours.
    assert found == {id(stranger): frozenset({GPU0.uuid}), id(memory): frozenset({GPU1.uuid})}
    # Each device with something from outside, as a later check compares it: the holders not ours (the
    # sibling's too: it is listed there, not ours), the memory not ours.
    assert states == {GPU0.uuid: (frozenset({(300, 3000)}), 112 * MIB),
                      GPU1.uuid: (frozenset({(400, 4000)}), 300 * MIB)}
    assert clean == []


def test_outside_of_a_clean_check_or_a_dirty_one_of_ours() -> None:
    readings = [snap(GPU0, 0), snap(GPU1, 600, (500, 100), (ME, 500))]
    assert outside_of([], readings, (GPU0, GPU1), {ME}, [], set(), {}, 0, set(), {}) == (
        {}, {}, [GPU0.uuid, GPU1.uuid])
    # Only a leak of ours: nothing from outside, and both devices clean from outside (the leak's memory is
    # ours); a sibling worker's process listed there keeps its device from being clean from outside.
    assert outside_of([leak(500)], readings, (GPU0, GPU1), {ME}, [found_pid(500)], set(), {}, 0, set(),
                      {}) == ({}, {}, [GPU0.uuid, GPU1.uuid])
    readings[0] = snap(GPU0, 100, (400, 100))
    assert outside_of([leak(500)], readings, (GPU0, GPU1), {ME}, [found_pid(500)], {400}, {}, 0, {400},
                      {400: 0}) == ({}, {}, [GPU1.uuid])


def found_pid(pid: int) -> CensusEntry:
    return found(pid, "t1")


HOLDER = frozenset({(300, 3000)})
EARLIER = OutsideState(HOLDER, 512 * MIB, "t.py::test_1", 1000.0)


@pytest.mark.parametrize(("holders", "used_mib", "now", "known"), [
    pytest.param(HOLDER, 512, 1010.0, True, id="the same, unchanged for the timeout: not waited for again"),
    pytest.param(HOLDER, 520, 1010.0, True, id="the memory moved within the slack"),
    pytest.param(HOLDER, 540, 1010.0, False, id="the memory moved beyond the slack: new"),
    pytest.param(frozenset({(300, 4000)}), 512, 1010.0, False, id="a new process on the same pid: new"),
    pytest.param(HOLDER, 512, 1005.0, False, id="the same, but for less than this check's timeout"),
])
def test_known_outside(holders: frozenset[tuple[int, int]], used_mib: int, now: float, known: bool) -> None:
    seen: dict[str, OutsideState] = {}
    got = known_outside({GPU0.uuid: (holders, used_mib * MIB)}, {GPU0.uuid: EARLIER}, seen, 16 * MIB, now,
                        timeout=10.0, where="t.py::test_2")
    assert (GPU0.uuid in got) is known
    # What this check has seen, and since when: the earlier state when it is the same, else its own, now.
    own = OutsideState(holders, used_mib * MIB, "t.py::test_2", now)
    assert seen[GPU0.uuid] == (EARLIER if EARLIER.same(holders, used_mib * MIB, 16 * MIB) else own)


def test_known_outside_keeps_since_when_this_check_has_seen_a_state() -> None:
    seen: dict[str, OutsideState] = {}
    states = {GPU0.uuid: (HOLDER, 512 * MIB)}
    assert known_outside(states, {}, seen, 16 * MIB, 1000.0, 10.0, "t.py::test_1") == set()
    # Nothing remembered (no earlier check waited it out): never known, however long this check looks.
    assert known_outside(states, {}, seen, 16 * MIB, 1020.0, 10.0, "t.py::test_1") == set()
    assert seen[GPU0.uuid].since == 1000.0  # unchanged since the first look, not the last


# ---- another session's, or a dead session's debris --------------------------------------------------------

OURS = "gc.1.2.3.aa"
OUTER = "gc.0.1.3.zz"  # a session we run inside (our cookie's prefix)
LIVE, DEAD, ELSEWHERE = "gc.4.5.3.bb", "gc.9.8.3.dd", "gc.6.7.99.ee"  # ELSEWHERE: another pid namespace
ALIVE = {0: True, 1: True, 4: True, 9: False, 6: None}  # by the leader's pid, as SessionRef.liveness says


@pytest.mark.parametrize(("cookie", "own", "dead"), [
    pytest.param(f"{DEAD}:t1", OURS, DEAD, id="a dead session's: debris"),
    pytest.param(f"{LIVE}:t1", OURS, None, id="a live session's: never ours"),
    pytest.param(f"{ELSEWHERE}:t1", OURS, None, id="another pid namespace's: no proof, never ours"),
    pytest.param(f"{LIVE}:t3/{DEAD}:t1", OURS, None, id="a dead session a live one's test ran: its"),
    pytest.param(f"{OURS}:t3/{DEAD}:t1", OURS, DEAD, id="a dead session our test ran: debris"),
    pytest.param(f"{OUTER}:t5/{DEAD}:t1", f"{OUTER}:t5/{OURS}", DEAD, id="under a session we run inside"),
    pytest.param(f"{OURS}:t1", OURS, None, id="our own"),
    pytest.param("ci-job-42", OURS, None, id="no session's"),
])
def test_dead_session_of(cookie: str, own: str, dead: str | None) -> None:
    got = dead_session_of(cookie, own, lambda ref: ALIVE[ref.pid])
    assert (None if got is None else got.session_id.rsplit("/", 1)[-1]) == dead


@pytest.mark.parametrize(("name", "kind"), [
    ("test_a.py::test_x", "test"),
    ("test_a.py::test_x[a (b)-c]", "test"),
    ("test_a.py::TestC::test_y", "test"),
    ("model_server (session-scoped)", "fixture"),
    ("db (module-scoped)", "fixture"),
    ("pytest session", "session"),
])
def test_a_dead_sessions_owner_is_read_back_with_its_kind(name: str, kind: str) -> None:
    # A dead session's process names its owner in GPUCLEAN_OWNER, the name only; a fixture's taken for a
    # test's made the next session report it as a test of its own that leaked.
    assert owner_named(name) == Owner(kind, name)
    assert fixture_owner("model_server", "session") == Owner("fixture", "model_server (session-scoped)")
