"""The do-no-harm contract (issue 37): what a test and its children can observe of their process is the same
with gpuclean as without it, but for a short documented list (docs/guest.md).

``test_what_a_test_observes_is_as_without_the_plugin`` runs the probe (tests/examples/guest/probe/) plain
(``-p no:gpuclean``) and under the plugin, in four modes: a session that checks nothing, one that checks
(marked tests, an unmarked one among them, under ``-W error::DeprecationWarning``), ``--gpuclean-all`` and
xdist. Each test of the probe records its body's process, its children's (``os.fork``, a double fork, a
child that calls ``setsid``, a fork from C, multiprocessing's fork and spawn, ``subprocess``, ``env -i``,
``close_fds=False``) and how a forked child dies of SIGTERM. Every difference must be on ``EXCEPTIONS``,
each with its reason and the test here that shows what it changes for the user; the rest are breaks. The
entries marked ``known_break`` are breaks being fixed (none now): a strict xfail test holds each.
"""

from __future__ import annotations

import collections
import fnmatch
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest
from helpers import INNER_TIMEOUT, reap_orphans, wait_dead

ABSENT = "<absent>"
"""A key one of the two snapshots lacks (an environment variable the plugin exports, for one)."""

FORKED = ("fork", "mp_fork", "grandchild", "setsid", "rawfork")
"""Children that are copies of the test's process: they inherit its memory, handlers, descriptors."""
EXECED = ("mp_spawn", "subprocess", "nocloexec")
"""Children that run a new program: they inherit the environment, and descriptors without close-on-exec."""
ENV_ROLES = ("body", *FORKED, *EXECED)
"""Everything but ``scrubbed`` (``env -i``), which inherits no environment at all."""
PYTHON_FORKS = ("fork", "mp_fork", "grandchild", "setsid")
"""Forks through Python (``os.fork``, multiprocessing): Python's at-fork hooks run in the child."""

REAL_GPU = os.environ.get("GUEST_REAL_GPU") == "1"
"""The plugin's runs read NVML on a GPU box (benchmarks/GPU-RUNS.md), not simulated devices."""

IDLE, CHECKING, ALL, XDIST = "idle", "checking", "all", "xdist"
STARTED = frozenset({CHECKING, ALL, XDIST})
"""Modes in which the plugin's session starts (a collected test is checked)."""
MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # mode: (arguments of both runs, arguments of the plugin's run only)
    IDLE: (("-k", "unmarked"), ()),  # no checked test collected: the plugin stays idle
    CHECKING: (("-W", "error::DeprecationWarning"), ()),
    ALL: ((), ("--gpuclean-all",)),
    XDIST: (("-n", "2"), ()),
}
CHECKED = {CHECKING: {"test_a_marked", "test_c_count"}, XDIST: {"test_a_marked", "test_c_count"},
           ALL: {"test_a_marked", "test_b_unmarked", "test_c_count"}}
"""The probe's tests that the plugin checks, by mode (they hold GPU locks while they run)."""

SESSION_ID = r"gc\.<session>"  # (the probe masks the pid and random parts of a session id)
PLAIN_IMPORTS = "pytest_gpuclean._imports._PlainImports"
ON_SIGTERM = "pytest_gpuclean._session.signals.SigtermAsInterrupt._on_sigterm"
SAME_EVERYWHERE = ("threads", "os_threads", "excepthook", "threading_excepthook", "unraisablehook", "atexit",
                   "warning_filters", "gc", "rlimits", "sigmask", "umask", "cwd", "nice", "affinity",
                   "path_hooks", "faulthandler", "switchinterval", "recursionlimit", "flags")
"""What no exception covers, in any mode or role: asserted equal one by one, besides the diff."""
THIRD_PARTY = {"pytest_gpuclean", "psutil", "pynvml"}
"""What the plugin may import into the test's process besides the standard library: itself and its two
dependencies (psutil only when a finding names a process, pynvml only on real GPUs)."""


class Diff(NamedTuple):
    mode: str
    test: str
    key: str
    """``<role>.<key>[.<subkey>]``: ``body.env.GPUCLEAN_TEST``, ``fork.signals.SIGTERM``, ..."""
    plain: Any
    plugin: Any

    def added(self) -> tuple[list[Any], list[Any]]:
        """For list values: (items only in the plain run, items only under the plugin), as multisets."""
        plain = collections.Counter(json.dumps(v) for v in self.plain or [])
        plugin = collections.Counter(json.dumps(v) for v in self.plugin or [])
        return ([json.loads(v) for v in (plain - plugin).elements()],
                [json.loads(v) for v in (plugin - plain).elements()])


class Exception_(NamedTuple):
    """A difference the contract allows: where it shows, why, and the test that shows what it changes."""

    keys: tuple[str, ...]
    why: str
    shown_by: str
    modes: frozenset[str] = frozenset(MODES)
    fits: Callable[[Diff], bool] = lambda diff: True
    known_break: str = ""
    """Not an exception: a break being fixed, held by the strict xfail test ``shown_by``."""

    def allows(self, diff: Diff) -> bool:
        return (diff.mode in self.modes and any(fnmatch.fnmatchcase(diff.key, k) for k in self.keys)
                and self.fits(diff))


def _keys(roles: tuple[str, ...], key: str) -> tuple[str, ...]:
    return tuple(f"{role}.{key}" for role in roles)


def _only_added(allowed: Callable[[Any], bool]) -> Callable[[Diff], bool]:
    """Fits a list the plugin only added to, with items that are all ``allowed``."""

    def fits(diff: Diff) -> bool:
        removed, added = diff.added()
        return not removed and all(allowed(item) for item in added)

    return fits


def _plugin_fd(item: str) -> bool:
    # The plugin's own descriptors: the kept-open ns_last_pid, the lock directory, its lock files and this
    # user's holder records (sim fixture: <tmp>/locks), all close-on-exec.
    return re.fullmatch(r"(/proc/sys/kernel/ns_last_pid|/.*/locks(/GPU-[^/]+\.(lock|holder))?) cloexec",
                        item) is not None


def _driver_fd(item: str) -> bool:
    # With NVML open (real GPUs): the driver's device files, its thread's eventfds and pipes.
    return _plugin_fd(item) or re.fullmatch(r"(/dev/nvidia[-\w/]*|anon_inode:\[eventfd\]|pipe:\[N\]) cloexec",
                                            item) is not None


def _plugin_module(name: str) -> bool:
    top = name.split(".")[0]
    return top in THIRD_PARTY or top in sys.stdlib_module_names


def _checked(diff: Diff) -> bool:
    return diff.test in CHECKED.get(diff.mode, set())


EXCEPTIONS: tuple[Exception_, ...] = (
    Exception_(_keys(ENV_ROLES, "env.GPUCLEAN_TEST") + _keys(ENV_ROLES, "env.GPUCLEAN_OWNER"),
               "the cookie: every process the test starts carries the session's id and the test's token "
               "(GPUCLEAN_TEST) and the test's node id (GPUCLEAN_OWNER), which prove that an escaped "
               "process is the test's (docs/ownership.md); exported before the conftests, also by a "
               "session that checks nothing",
               "test_the_cookie_names_the_test_in_what_it_starts",
               # (a test's token and node id; in a session that checks nothing, the session's own; under xdist
               # the controller's session id prefixes the worker's)
               fits=lambda d: d.plain == ABSENT and (
                   re.fullmatch(f"({SESSION_ID}:session/)?{SESSION_ID}" + r":([a-z]+\d+|session)",
                                str(d.plugin)) is not None
                   or d.plugin in (f"test_inner.py::{d.test}", "pytest session"))),
    Exception_(_keys(ENV_ROLES, "env.GPUCLEAN_HELD_LOCKS"),
               "while a checked test holds GPU locks: which, so that a gpuclean session the test starts "
               "(a nested pytest) takes those GPUs instead of waiting for its parent's locks "
               "(docs/sharing.md)",
               "test_nested_session_uses_the_gpu_its_test_holds (tests/test_sharing.py)",
               modes=STARTED, fits=lambda d: d.plain == ABSENT and _checked(d)),
    Exception_(_keys(ENV_ROLES, "env.CUDA_VISIBLE_DEVICES"),
               "a count= marker: the test gets exactly the GPUs it locked, restored after it",
               "test_a_count_marker_shows_the_test_only_its_gpus",
               modes=STARTED, fits=lambda d: d.test == "test_c_count"
               and re.fullmatch(r"GPU-[0-9a-f-]+", str(d.plugin)) is not None),
    Exception_(_keys(ENV_ROLES, "env.GPUCLEAN_XDIST_WORKERS_SINCE")
               + _keys(ENV_ROLES, "env.GPUCLEAN_OUTSIDE_STATE"),
               "xdist: the controller hands its workers what they need through their environment (when "
               "it started them, to tell its workers from a test's processes; the file where workers "
               "share what held a GPU from outside); the workers' tests and children inherit it",
               "test_crashed_xdist_worker_leak_is_reaped_and_blamed (tests/test_faults.py), "
               "test_xdist_workers_share_what_one_of_them_waited_out (tests/test_outside.py)",
               modes=frozenset({XDIST}), fits=lambda d: d.plain == ABSENT),
    Exception_(("body.subreaper",),
               "a checking session's pytest process is a child subreaper: orphans of the test (a double "
               "fork, a setsid daemon, workers whose parent died) are re-parented to it instead of init, "
               "so they stay in its tree to be found and reaped",
               "test_orphans_of_the_test_come_back_to_pytest",
               modes=STARTED, fits=lambda d: (d.plain, d.plugin) == (0, 1)),
    Exception_(("grandchild.parent", "grandchild.process_group.*", "experiments.orphan.waitable_by_the_test"),
               "the subreaper, seen from the orphan (its parent is now the test's process, hence its group "
               "and session relative to that parent) and from the test (it can wait for the orphan, and "
               "os.wait() collects it)",
               "test_orphans_of_the_test_come_back_to_pytest",
               modes=STARTED),
    Exception_(("body.signals.SIGTERM",),
               "a checking session takes SIGTERM in the pytest process (a cancelled CI job) like Ctrl-C: "
               "the sweep runs and the reports are written, then pytest dies of SIGTERM; a handler the "
               "suite installed is left alone",
               "test_the_pytest_process_takes_sigterm_as_an_interrupt; "
               "test_signal_to_pytest_runs_the_sweep_and_writes_the_reports (tests/test_faults.py)",
               modes=STARTED, fits=lambda d: (d.plain, d.plugin) == ("SIG_DFL", ON_SIGTERM)),
    Exception_(("rawfork.signals.SIGTERM",),
               "a child forked from C runs none of Python's at-fork hooks, so it still shows the pytest "
               "process's SIGTERM handler; the handler acts in the pytest process only: in that child it "
               "puts the default back and re-sends the signal, so the child dies of SIGTERM as POSIX says "
               "(children forked through Python get the default back right after the fork)",
               "test_forked_children_die_of_sigterm_as_posix_says",
               modes=STARTED, fits=lambda d: (d.plain, d.plugin) == ("SIG_DFL", ON_SIGTERM)),
    Exception_(("body.fds", "rawfork.fds"),
               "the plugin's own descriptors in the pytest process (ns_last_pid kept open; in a checking "
               "session the lock directory, the GPU lock files and this user's holder records), all "
               "close-on-exec. A fork through Python closes the lock descriptors (an at-fork hook); a fork "
               "from C runs no Python hook and keeps them until it execs, but holds none of the GPU locks "
               "(POSIX locks are the pytest process's)",
               "test_lock_descriptors_reach_no_child",
               fits=_only_added(_plugin_fd)),
    Exception_(_keys(("body", *FORKED), "fds"),
               "real GPUs only (GUEST_REAL_GPU=1): NVML, open in the pytest process once the session checks, "
               "keeps the driver's device files open (/dev/nvidiactl, /dev/nvidiaN, /dev/nvidia-uvm, "
               "/dev/nvidia-caps/*) and the driver thread's eventfds and pipes, all close-on-exec: forked "
               "children have them until they exec, as they would after the test's own CUDA use; no exec'ed "
               "child gets them",
               "benchmarks/nvml_threads.py (6 descriptors after nvmlInit, none "
               "after nvmlShutdown)",
               modes=STARTED, fits=lambda d: REAL_GPU and _only_added(_driver_fd)(d)),
    Exception_(("body.os_threads", "experiments.threads_at_fork.os_threads"),
               "real GPUs only (GUEST_REAL_GPU=1): nvmlInit starts one thread of the driver's (cuda0000...) "
               "that stays for the process's life, even after nvmlShutdown; Python 3.12 then warns at each "
               "fork() of a test (a DeprecationWarning, as after any CUDA use in the process)",
               "benchmarks/nvml_threads.py",
               modes=STARTED, fits=lambda d: REAL_GPU and d.plugin == d.plain + 1),
    Exception_(("rawfork.lock_owners",),
               "a child forked from C sees the GPU lock files it inherited: held by the test's process, "
               "free, or held by another process (under xdist, the sibling worker whose test holds them), "
               "never by itself",
               "test_lock_descriptors_reach_no_child",
               fits=_only_added(lambda owner: owner in ("the test's process", "free", "another process"))),
    Exception_(_keys(("body", *FORKED), "meta_path"),
               "_PlainImports, first on sys.meta_path from the plugin's import on: imports of "
               "pytest_gpuclean's own modules skip pytest's assertion rewriting (which re-did them in every "
               "run without a writable bytecode cache); it finds nothing else, so the user's imports go "
               "where they went",
               "test_the_plugins_import_finder_leaves_user_imports_alone",
               fits=lambda d: d.plugin == [PLAIN_IMPORTS, *d.plain]),
    Exception_(_keys(("body", *FORKED), "modules"),
               "the plugin's own modules and the standard library modules they import (psutil when a "
               "finding names a process, pynvml on real GPUs); nothing else, and no module the plain run "
               "has is missing",
               "test_what_a_test_observes_is_as_without_the_plugin (prints them)",
               fits=_only_added(_plugin_module)),
)


def differences(mode: str, test: str, plain: dict[str, Any], plugin: dict[str, Any]) -> list[Diff]:
    """Every key (nested dicts flattened) whose value differs between the plain and the plugin's run."""
    def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, dict) and value:
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    a, b = flat(plain), flat(plugin)
    return [Diff(mode, test, key, a.get(key, ABSENT), b.get(key, ABSENT))
            for key in sorted(a.keys() | b.keys()) if a.get(key, ABSENT) != b.get(key, ABSENT)]


class Guest:
    """Runs an inner suite of tests/examples/guest plain or under the plugin; each run's files apart."""

    def __init__(self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.pytester = pytester
        self.monkeypatch = monkeypatch
        self.tmp_path = tmp_path
        self.runs = 0

    def run(self, plugin: bool, *args: str, passed: int) -> tuple[pytest.RunResult, dict[str, Any]]:
        """An inner session; what its tests recorded (``<test>.json``), by test name. Every test passes."""
        self.runs += 1
        out = self.tmp_path / f"out-{self.runs}-{'plugin' if plugin else 'plain'}"
        out.mkdir()
        self.monkeypatch.setenv("GUEST_OUT", str(out))
        before = {child.pid for child in psutil.Process().children()}
        try:
            result = self.pytester.runpytest_subprocess(
                "-p", "gpuclean" if plugin else "no:gpuclean", "-p", "no:cacheprovider", "-p", "no:randomly",
                "-rA", *args, timeout=INNER_TIMEOUT)
        finally:
            _collect_orphans(before)
        result.assert_outcomes(passed=passed)
        if plugin and "with findings" in result.stdout.str():
            result.stdout.fnmatch_lines(["*checked test(s), 0 with findings, 0 process(es) reaped"])
        found = {}
        for path in out.glob("*.json"):
            if path.name.count(".") == 1:  # <test>.json, not a child's <test>.<role>.json
                found[path.stem] = json.loads(path.read_text())
        return result, found

    def both(self, *args: str, passed: int, plugin_args: tuple[str, ...] = ()
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The same inner session plain, then under the plugin."""
        return (self.run(False, *args, passed=passed)[1],
                self.run(True, *args, *plugin_args, passed=passed)[1])


def _collect_orphans(before: set[int]) -> None:
    # Orphans of the plain runs' tests (a double fork's grandchild) are re-parented to this process when it
    # is a subreaper (an outer gpuclean session that checks): collect them once they have exited.
    new = [child.pid for child in psutil.Process().children() if child.pid not in before]
    wait_dead(new, timeout=5)
    reap_orphans(new)


@pytest.fixture
def guest(pytester: pytest.Pytester, sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Guest:
    # The inner sessions' baseline is a plain process: no cookie of this (outer) session, whose plugin
    # exports one in every run, and no xdist run of the outer session (were it run under -n).
    for name in ("GPUCLEAN_TEST", "GPUCLEAN_OWNER", "GPUCLEAN_HELD_LOCKS", "GPUCLEAN_XDIST_WORKERS_SINCE",
                 "GPUCLEAN_OUTSIDE_STATE", "CUDA_VISIBLE_DEVICES", "PYTEST_XDIST_TESTRUNUID",
                 "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    if REAL_GPU:
        # On a GPU box (benchmarks/GPU-RUNS.md): the plugin's runs read NVML, which opens the driver's device
        # files and may start threads in the pytest process, neither of which simulated devices show.
        monkeypatch.delenv("GPUCLEAN_SIMULATE")
    return Guest(pytester, monkeypatch, tmp_path)


@pytest.fixture
def effects(guest: Guest) -> Guest:
    """The effects suite (one effect per test, selected with -k), next to the probe module it uses."""
    guest.pytester.copy_example("guest/effects")
    guest.pytester.copy_example("guest/probe/probe.py")
    return guest


# ---- the contract ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
def test_what_a_test_observes_is_as_without_the_plugin(guest: Guest, mode: str) -> None:
    guest.pytester.copy_example("guest/probe")
    both, plugin_only = MODES[mode]
    tests = 1 if mode == IDLE else 3
    plain, plugin = guest.both(*both, passed=tests, plugin_args=plugin_only)
    assert sorted(plain) == sorted(plugin) and len(plain) == tests, (sorted(plain), sorted(plugin))
    breaks: list[str] = []
    table: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for test in sorted(plain):
        roles = set(plain[test]) - {"experiments"}
        assert roles == {"body", *FORKED, *EXECED, "scrubbed"} == set(plugin[test]) - {"experiments"}
        for diff in differences(mode, test, plain[test], plugin[test]):
            allowed = next((e for e in EXCEPTIONS if e.allows(diff)), None)
            if allowed is None:
                breaks.append(f"{test} {diff.key}: plain {diff.plain!r}, under the plugin {diff.plugin!r}")
            else:
                table[(allowed.known_break and "KNOWN BREAK") or "exception", allowed.shown_by].add(diff.key)
    for (kind, shown_by), keys in sorted(table.items()):
        print(f"{mode}: {kind}: {', '.join(sorted(keys))} -> {shown_by}")
    added = sorted(set(plugin["test_b_unmarked"]["body"]["modules"])
                   - set(plain["test_b_unmarked"]["body"]["modules"]))
    print(f"{mode}: modules the plugin imported into the test's process: {', '.join(added)}")
    assert not breaks, "differences on no list (breaks of the contract):\n" + "\n".join(breaks)
    # What the plugin must not bring at all, stated once more where a reader looks for it: no thread (Python
    # 3.12 warns at every fork() of a process with more than one OS thread; this venv is 3.11, so the count
    # is read at the fork: field 20 of /proc/self/stat, what 3.12 reads), no hook, no atexit, no limit.
    for test in plain:
        if REAL_GPU and mode in STARTED:  # (the driver's thread: EXCEPTIONS, asserted there)
            continue
        assert plugin[test]["experiments"]["threads_at_fork"] == plain[test]["experiments"]["threads_at_fork"]
        # (xdist's own execnet thread is there with or without the plugin; the H200 image's libraries start 16
        # in every pytest process, plugin or not: benchmarks/GPU-RUNS.md)
        if mode != XDIST and not REAL_GPU:
            assert plugin[test]["experiments"]["threads_at_fork"] == {"python_threads": 1, "os_threads": 1}
        for role in ("body", *FORKED, *EXECED, "scrubbed"):
            for key in SAME_EVERYWHERE:
                assert plugin[test][role][key] == plain[test][role][key], (test, role, key)
        if mode in STARTED:  # the exceptions are there where they are said to be
            assert plugin[test]["body"]["subreaper"] == 1
            assert plugin[test]["body"]["signals"]["SIGTERM"] == ON_SIGTERM
        else:
            assert plugin[test]["body"]["subreaper"] == 0
            assert plugin[test]["body"]["signals"]["SIGTERM"] == "SIG_DFL"


# ---- each exception, what it changes for the user -------------------------------------------------------

def test_the_cookie_names_the_test_in_what_it_starts(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_a_checked or test_cookie", passed=2)
    assert plain["test_cookie"] == {"child": [None, None], "scrubbed": [None, None]}
    cookie, owner = plugin["test_cookie"]["child"]
    assert re.fullmatch(r"gc\.\d+\.\d+\.\d+\.[0-9a-f]+:[a-z]+\d+", cookie), cookie  # <session>:<test token>
    assert owner == "test_inner.py::test_cookie"
    # A child started with a scrubbed environment carries no cookie: it is the test's by ancestry alone.
    assert plugin["test_cookie"]["scrubbed"] == [None, None]
    # A session that checks nothing exports its own cookie only: what its tests start is the session's.
    _, idle = effects.run(True, "-k", "test_cookie", passed=1)
    cookie, owner = idle["test_cookie"]["child"]
    assert re.fullmatch(r"gc\.\d+\.\d+\.\d+\.[0-9a-f]+:session", cookie) and owner == "pytest session"


def test_a_count_marker_shows_the_test_only_its_gpus(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_count or test_after_count", passed=2)
    assert plain["test_count"] == plain["test_after_count"] == {"visible": None}
    assert re.fullmatch(r"GPU-[0-9a-f-]+", plugin["test_count"]["visible"])  # one GPU, by UUID
    assert plugin["test_after_count"] == {"visible": None}  # restored after the test


def test_orphans_of_the_test_come_back_to_pytest(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_a_checked or test_orphan", passed=2)
    assert plain["test_orphan"] == {"parent": "another process", "wait_any": "nothing (no child)"}
    # The pytest process adopted the double fork's grandchild: a test's os.wait() / waitpid(-1) now
    # collects an orphan it never started (and a SIGCHLD handler of the test hears of it).
    assert plugin["test_orphan"] == {"parent": "pytest", "wait_any": "the orphan"}
    # Only a session that checks becomes a subreaper.
    _, idle = effects.run(True, "-k", "test_orphan", passed=1)
    assert idle["test_orphan"] == plain["test_orphan"]


def test_the_pytest_process_takes_sigterm_as_an_interrupt(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_a_checked or test_sigterm_handler", passed=2)
    assert plain["test_sigterm_handler"] == {"handler": "SIG_DFL"}
    # A test that looks finds gpuclean's handler (what it does: test_faults.py's
    # test_signal_to_pytest_runs_the_sweep_and_writes_the_reports); a session that checks nothing sets none.
    assert plugin["test_sigterm_handler"] == {"handler": ON_SIGTERM}
    _, idle = effects.run(True, "-k", "test_sigterm_handler", passed=1)
    assert idle["test_sigterm_handler"] == {"handler": "SIG_DFL"}


def test_forked_children_die_of_sigterm_as_posix_says(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_a_checked or test_forked_sigterm", passed=2)
    posix = {"fork": [15, False], "rawfork": [15, False], "mp_exitcode": -15}  # [killed by, finally ran]
    assert plain["test_forked_sigterm"] == posix
    # An unmarked test, in a session that checks another one.
    assert plugin["test_forked_sigterm"] == posix


def test_lock_descriptors_reach_no_child(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_lock_fds", passed=1)

    def of_locks(fds: list[str]) -> list[str]:
        return [fd for fd in fds if "/locks" in fd]

    for role in ("body", "fork", "rawfork", "nocloexec"):
        seen = plain["test_lock_fds"][role]
        assert not of_locks(seen if role == "body" else seen["fds"])
    found = plugin["test_lock_fds"]
    # The test's process holds the lock directory, two lock files and two holder records (two GPUs), all
    # close-on-exec: no exec'ed child gets them, even with close_fds=False.
    held = of_locks(found["body"])
    assert len(held) == 5 and all(fd.endswith(" cloexec") for fd in held), held
    assert not of_locks(found["nocloexec"]["fds"]) and found["nocloexec"]["owners"] == []
    # os.fork (and multiprocessing's fork): the at-fork hook closed them in the child.
    assert not of_locks(found["fork"]["fds"]) and found["fork"]["owners"] == []
    # A fork from C runs no Python hook: the child has the descriptors until it execs, but the GPU locks
    # stay the test's process's (a POSIX lock is never inherited): the child cannot keep a GPU locked.
    assert of_locks(found["rawfork"]["fds"]) == of_locks(found["body"])
    assert found["rawfork"]["owners"] == ["the test's process", "the test's process"]


def test_forked_children_inherit_no_descriptor_of_the_plugin(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_fork_fds", passed=1)  # (a session that checks nothing)
    assert plugin["test_fork_fds"]["child"] == plain["test_fork_fds"]["child"]


def test_the_plugins_import_finder_leaves_user_imports_alone(effects: Guest) -> None:
    plain, plugin = effects.both("-k", "test_imports", passed=1)
    seen, under = plain["test_imports"], plugin["test_imports"]
    # The finder is there, first, from the plugin's import on (in a session that checks nothing too) ...
    assert under["meta_path"] == [PLAIN_IMPORTS, *seen["meta_path"]]
    # ... and finds no module of the user's: a helper registered for rewriting is still rewritten.
    assert under["finds_user_module"] == seen["finds_user_module"]
    assert under["loader"] == seen["loader"] == "AssertionRewritingHook"
    assert under["message"] == seen["message"] == "assert 2 == 1"


# ---- a hostile user --------------------------------------------------------------------------------------

def test_a_test_may_setsid_the_pytest_process(effects: Guest) -> None:
    # A checked test moves the pytest process into a session of its own, then starts a child; the next
    # test runs in that session. Same outcome and nothing found (Guest.run checks the summary line).
    plain, plugin = effects.both("-k", "setsid", passed=2)
    assert plain["test_setsid"] == plugin["test_setsid"] == {"setsid": True, "sid_is_own": True}
    assert plain["test_after_setsid"] == plugin["test_after_setsid"] == {"sid_is_own": True}

