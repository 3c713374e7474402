"""Benchmark (issue 16): what gpuclean costs a whole pytest process, and what one check costs.

Whole-process part: real ``python -m pytest -q`` runs of generated suites in subprocesses, timed from
outside (wall clock of the subprocess, and its CPU time), configurations interleaved in rounds so that
drift on a shared machine hits them all alike:

* **idle**: a small suite of unmarked tests (``--idle-tests``, default 50), ``pytest -q`` and
  ``pytest -q --co``, with the plugin loaded vs ``-p no:gpuclean``. Added cost = difference of the
  medians (and the median of the per-round differences).
* **checked**: N and M marked tests (``--tests``, default 100; ``--big-tests``, default 4N) on 8 simulated
  devices, locks on and off (``--kinds``; and real NVML, every GPU, when pynvml finds one), vs the same
  suites with ``-p no:gpuclean``. With d(n) = T(n) - T_off(n): slope per checked test = (d(M) - d(N)) /
  (M - N), fixed cost = d(N) - N * slope; both from wall time and from CPU time (user + sys of the pytest
  process and of the children it waited for, from its own ``wait4``: what other processes of a shared
  machine do is not in it), as medians, as per-round paired differences (p25..p75, p10..p90), and from
  each configuration's minimum over the rounds (interference on a shared machine only ever adds time to a
  run, so the minima are the robust floor, the least disturbed of the three on a busy box). How busy
  the machine was during the rounds (load average, the share of its CPU time others used) is recorded.
* **shell**: the seeds' check, ``ps aux | grep python3 | grep -v grep; nvidia-smi
  --query-gpu=index,memory.used --format=csv`` before and after each of N unmarked tests (an autouse
  fixture, ``subprocess.run(shell=True)``), ``-p no:gpuclean``; per test = (T - T_off(N)) / N. Without
  ``nvidia-smi`` on the machine only the ``ps`` half runs (said in the output).

Per-check part (``Checker.check`` in a process of its own over 8 simulated devices, default session
scope): a check with 1 thread vs 64 threads in the process; on an idle host vs with 1000 sleeping
processes of the same user that are not ours; and the first check of a session (its dead-session scan
of this user's processes) in both cases.

``--trees REV,...`` runs every gpuclean configuration once per tree in each round (git revisions or
``WORKTREE``, exported as ``ab_trees.py`` does): a before/after from one run.

    python benchmarks/bench_session.py --json benchmarks/results/session_cpu.json
    python benchmarks/bench_session.py --trees ece7ae6,WORKTREE --json benchmarks/results/session_ab.json
    # issue 29's figure: CPU time, 50 vs 650 marked tests, 8 simulated devices, locks on, 15 rounds
    python benchmarks/bench_session.py --trees e6a9461,WORKTREE --tests 50 --big-tests 650 --rounds 15 \
        --kinds locks --skip idle,shell,attribution,per-check \
        --json benchmarks/results/session_issue29_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

SHELL = "ps aux | grep python3 | grep -v grep; nvidia-smi --query-gpu=index,memory.used --format=csv"
SHELL_PS_ONLY = "ps aux | grep python3 | grep -v grep"
PER_MODULE = 50
DEVICES = 8


# ---- generated suites ------------------------------------------------------------------------------

def write_suite(root: str, tests: int, marked: bool, shell: str | None = None) -> str:
    os.makedirs(root)
    with open(os.path.join(root, "pytest.ini"), "w") as f:
        # Its own rootdir and ini; the marker is declared so that -p no:gpuclean warns about nothing.
        f.write("[pytest]\nmarkers =\n    needs_clean_gpus: gpuclean's marker\n")
    if shell is not None:
        with open(os.path.join(root, "conftest.py"), "w") as f:
            f.write("import subprocess\nimport pytest\n\n\n@pytest.fixture(autouse=True)\n"
                    "def seeds_check():\n"
                    f"    subprocess.run({shell!r}, shell=True, stdout=subprocess.DEVNULL, "
                    "stderr=subprocess.DEVNULL)\n    yield\n"
                    f"    subprocess.run({shell!r}, shell=True, stdout=subprocess.DEVNULL, "
                    "stderr=subprocess.DEVNULL)\n")
    for m in range((tests + PER_MODULE - 1) // PER_MODULE):
        count = min(PER_MODULE, tests - m * PER_MODULE)
        with open(os.path.join(root, f"test_gen_{m:03d}.py"), "w") as f:
            f.write("import pytest\n\n")
            if marked:
                f.write("pytestmark = pytest.mark.needs_clean_gpus\n\n")
            for i in range(count):
                f.write(f"\ndef test_{i:03d}():\n    assert {i} + 1 == {i + 1}\n\n")
    return root


def make_sim(root: str, devices: int) -> str:
    for index in range(devices):
        os.makedirs(os.path.join(root, str(index)))
    return root


def has_nvml_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


# ---- trees -----------------------------------------------------------------------------------------

def export_tree(rev: str, dest: str) -> str:
    """A directory whose ``pytest_gpuclean`` shadows the installed one (PYTHONPATH). ``WORKTREE`` is this
    checkout's package, copied too: the environment's editable install may be another checkout's (a git
    worktree shares the main checkout's venv), and would be measured in its place."""
    import ab_trees

    ab_trees.export(rev, dest)
    return dest


# ---- one timed pytest run ---------------------------------------------------------------------------

def timed_run(cmd: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run. The CPU time is the child's own rusage from ``wait4``:
    user + sys of the pytest process and of the children it waited for, whatever else the machine runs."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        killer = threading.Timer(900, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if proc.returncode not in (0, 5):
            out.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} in {cwd} failed ({proc.returncode}):\n{out.read()[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine since boot, from /proc/stat (iowait counts as idle)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


class Load:
    """How busy the machine was while a part ran: load averages after each round, and its CPU time split
    into ours (the timed children) and everyone else's (other users' work, this script's own)."""

    def __init__(self) -> None:
        self.loadavg: list[float] = []
        self.busy0, self.all0 = machine_cpu()
        self.wall0 = time.monotonic()
        self.ours = 0.0

    def summary(self) -> dict[str, Any]:
        busy, total = machine_cpu()
        wall = time.monotonic() - self.wall0
        cpus = (total - self.all0) / wall if wall else 0.0
        return {"wall_s": wall, "cpus_seen": cpus,
                "busy_cpus": (busy - self.busy0) / wall, "ours_cpus": self.ours / wall,
                "others_cpus": max(0.0, (busy - self.busy0 - self.ours) / wall),
                "loadavg_1min": _common.summary(self.loadavg) if self.loadavg else None}


class Config:
    def __init__(self, name: str, suite: str, args: list[str], env: dict[str, str], tree: str | None) -> None:
        self.name = name
        self.suite = suite
        self.args = args
        self.env = env
        self.tree = tree
        self.wall: list[float] = []
        self.cpu: list[float] = []


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GPUCLEAN_", "PYTEST_")) and k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # every tree's bytecode is compiled once, before the rounds
    return env


def with_tree(env: dict[str, str], tree_dir: str) -> dict[str, str]:
    return {**env, "PYTHONPATH": tree_dir} if tree_dir else dict(env)


# ---- attribution: gpuclean's share of each phase, timed inside the pytest process ----------------------

TIMER_PLUGIN = '''
"""Times every phase of a pytest run from the outermost hook wrappers (benchmarks/bench_session.py)."""
import atexit, json, os, time
import pytest

_spent = {}
_tests = {"setup": [], "teardown": []}
_marks = {}


def _wrap(name, bucket=None):
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def hook(**kwargs):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            took = time.perf_counter() - start
            if bucket is not None:
                _tests[bucket].append(took)
            else:
                _spent[name] = _spent.get(name, 0.0) + took
            if name == "unconfigure":
                _marks["unconfigured"] = time.perf_counter()
    hook.__name__ = "pytest_" + name
    return hook


pytest_collection_finish = _wrap("collection_finish")
pytest_sessionstart = _wrap("sessionstart")
pytest_sessionfinish = _wrap("sessionfinish")
pytest_unconfigure = _wrap("unconfigure")
pytest_runtest_setup = _wrap("setup", "setup")
pytest_runtest_teardown = _wrap("teardown", "teardown")


def _bracket(name):
    @pytest.hookimpl(tryfirst=True, specname="pytest_" + name)
    def first():
        _marks[name] = time.perf_counter()

    @pytest.hookimpl(trylast=True, specname="pytest_" + name)
    def last():
        _spent[name] = time.perf_counter() - _marks[name]

    return first, last


pytest_load_initial_conftests_first, pytest_load_initial_conftests_last = _bracket("load_initial_conftests")


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")
def pytest_configure_first(config):
    # Cleanups run last-registered first: this one runs after gpuclean's (its final sweep, close).
    config.add_cleanup(lambda: _spent.__setitem__("after_unconfigure",
                                                  time.perf_counter() - _marks["unconfigured"]))
    _marks["configure"] = time.perf_counter()


@pytest.hookimpl(trylast=True, specname="pytest_configure")
def pytest_configure_last(config):
    _spent["configure"] = time.perf_counter() - _marks["configure"]


@atexit.register
def _write():
    with open(os.environ["BENCH_TIMER_OUT"], "w") as f:
        json.dump({"spent": _spent, "tests": _tests}, f)
'''

IMPORT_PROBE = ("import time, pytest, _pytest.pytester, _pytest.tmpdir, _pytest.junitxml, _pytest.python\n"
                "c = time.process_time(); w = time.perf_counter()\n"
                "import pytest_gpuclean.plugin\n"
                "print(time.process_time() - c, time.perf_counter() - w)")


def attribution(configs: dict[str, Config], rounds: int, timer_dir: str, pytest_cmd: list[str]
                ) -> dict[str, Any]:
    """Per configuration: medians of each phase's time and of a test's setup+teardown hooks."""
    found: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    order = list(configs.values())
    for r in range(rounds):
        shift = r % len(order)
        for c in order[shift:] + order[:shift]:
            out = os.path.join(timer_dir, "timer.json")
            env = {**c.env, "BENCH_TIMER_OUT": out,
                   "PYTHONPATH": os.pathsep.join(filter(None, [c.env.get("PYTHONPATH"), timer_dir]))}
            timed_run([*pytest_cmd, "-p", "gpuclean_bench_timer", *c.args], c.suite, env)
            with open(out) as f:
                data = json.load(f)
            into = found[c.name]
            for phase, spent in data["spent"].items():
                into.setdefault(phase, []).append(spent)
            setups, teardowns = data["tests"]["setup"], data["tests"]["teardown"]
            if setups:
                per_test = [a + b for a, b in zip(setups, teardowns, strict=False)]
                into.setdefault("first_test", []).append(per_test[0])
                into.setdefault("other_tests", []).append(statistics.median(per_test[1:] or per_test))
        print(f"attribution: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    medians: dict[str, Any] = {name: {phase: statistics.median(v) for phase, v in phases.items()}
                               for name, phases in found.items()}
    medians["rounds"] = found  # every round's figures, for paired (same-round) differences
    return medians


PHASES = ("load_initial_conftests", "configure", "sessionstart", "collection_finish", "sessionfinish",
          "unconfigure", "after_unconfigure")


Rounds = dict[str, dict[str, list[float]]]
"""Per configuration, per phase, every round's figure."""


def paired_fixed(rounds: Rounds, on: str, off: str) -> tuple[float, float, float]:
    """The fixed cost as the median of per-round differences of the whole session outside tests (all
    phases summed, with the first test's extra, then on minus off in the same round): the phases' own
    noise (pytest's final garbage collections vary by milliseconds) is not summed eight times over.
    (median, p10, p90)."""
    def totals(name: str) -> list[float]:
        series = [rounds[name][p] for p in PHASES] + [rounds[name]["first_test"]]
        minus = rounds[name]["other_tests"]
        return [sum(values) - m for *values, m in zip(*series, minus, strict=True)]

    return _spread([a - b for a, b in zip(totals(on), totals(off), strict=True)])


def paired_per_test(rounds: Rounds, on: str, off: str) -> tuple[float, float, float]:
    """A checked test's hooks, on minus off in the same round (each round's median test): (median, p10,
    p90). The H200's VM runs some rounds a third slower than others; pairing takes that out."""
    on_tests, off_tests = rounds[on]["other_tests"], rounds[off]["other_tests"]
    return _spread([a - b for a, b in zip(on_tests, off_tests, strict=True)])


def _spread(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return (statistics.median(ordered), ordered[int(0.1 * (len(ordered) - 1))],
            ordered[int(0.9 * (len(ordered) - 1))])


def import_cost(env: dict[str, str], cwd: str, runs: int = 21) -> dict[str, float]:
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, cwd=cwd, capture_output=True,
                             text=True, check=True).stdout.split()
        cpu.append(float(out[0]))
        wall.append(float(out[1]))
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}


# ---- the per-check part (runs in a process of its own, per tree) -----------------------------------

def per_check(rounds: int, sleepers: int) -> dict[str, Any]:
    """Median cost of one clean ``Checker.check`` on 8 simulated devices, by situation."""
    from pytest_gpuclean._check.checker import Checker, CheckSettings
    from pytest_gpuclean._reading.simulated import SimulatedBackend
    tmp = tempfile.mkdtemp(prefix="gpuclean-check-")
    backend = SimulatedBackend(make_sim(os.path.join(tmp, "sim"), DEVICES))
    devices = backend.devices()

    def first_check() -> float:
        checker = Checker(backend, CheckSettings(grace=1.0, settle=0.0))
        start = time.perf_counter()
        checker.check("setup", devices, tolerance_mib=0, timeout=5.0)
        elapsed = time.perf_counter() - start
        checker.close()
        return elapsed

    checker = Checker(backend, CheckSettings(grace=1.0, settle=0.0))

    def checks(n: int = 200, repeat: int = rounds) -> float:
        per: list[float] = []
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(n):
                result = checker.check("setup", devices, tolerance_mib=0, timeout=5.0)
                assert result.clean, result
            per.append((time.perf_counter() - start) / n)
        return statistics.median(per)

    out: dict[str, Any] = {"first_check_s": statistics.median(first_check() for _ in range(5))}
    checker.check("setup", devices, tolerance_mib=0, timeout=5.0)  # the dead-session scan, once
    # An idle host vs 1000 sleepers of this user, in the order idle, sleepers, sleepers, idle. Before the
    # threads: the walk picks its method from the thread count it last saw (DescendantWalk), and both
    # sides of this comparison must be walked alike.
    idle = [checks()]
    out["files_per_check_idle_host"] = files_touched(lambda: checks(50, 1), 50)
    pids = start_sleepers(sleepers)
    try:
        checks(20, 1)  # the walk that sees their pids once
        busy = [checks(), checks()]
        # What the timings cannot show on a noisy machine: whether a check touches more of /proc.
        out["files_per_check_with_sleepers"] = files_touched(lambda: checks(50, 1), 50)
        out["sleepers"] = len(pids)
        out["first_check_with_sleepers_s"] = statistics.median(first_check() for _ in range(5))
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        gone_by = time.monotonic() + 30  # until init has collected them: they would weigh on what follows
        while time.monotonic() < gone_by and any(os.path.exists(f"/proc/{pid}") for pid in pids[-20:]):
            time.sleep(0.05)
    idle.append(checks())
    out["check_idle_host_s"] = statistics.median(idle)
    out["check_with_sleepers_s"] = statistics.median(busy)
    # 1 vs 64 threads, alternating round by round (this box's speed drifts).
    one: list[float] = []
    many: list[float] = []
    for _ in range(rounds):
        checks(20, 1)
        one.append(checks(200, 1))
        stop = threading.Event()
        threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(63)]
        for t in threads:
            t.start()
        out["threads"] = threading.active_count()
        checks(20, 1)  # the walk that sees the new thread ids
        many.append(checks(200, 1))
        stop.set()
        for t in threads:
            t.join()
    out["check_1_thread_s"] = statistics.median(one)
    out["check_64_threads_s"] = statistics.median(many)
    checker.close()
    shutil.rmtree(tmp, ignore_errors=True)
    out["ratio_64_threads"] = out["check_64_threads_s"] / out["check_1_thread_s"]
    out["ratio_sleepers"] = out["check_with_sleepers_s"] / out["check_idle_host_s"]
    return out


def files_touched(run: Any, n: int) -> dict[str, float]:
    """Calls per check of the os functions that reach /proc and the devices, counted while ``run`` runs."""
    counts: dict[str, int] = {}
    names = ("open", "listdir", "scandir", "stat", "readlink")
    real = {name: getattr(os, name) for name in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)
        return call

    for name in names:
        setattr(os, name, counting(name))
    try:
        run()
    finally:
        for name in names:
            setattr(os, name, real[name])
    return {name: count / n for name, count in sorted(counts.items())}


def start_sleepers(n: int) -> list[int]:
    """``n`` sleeping processes of this user that are not ours: started by a shell that exits at once,
    so they are re-parented away from us (this process is no subreaper)."""
    script = f"for i in $(seq {n}); do sleep 600 </dev/null >/dev/null 2>&1 & echo $!; done"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    pids = [int(p) for p in out.split()]
    me = os.getpid()
    assert all(_ppid(p) not in (me, None) for p in pids[:10]), "sleepers are our children"
    return pids


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rfind(b")") + 2:].split()[1])


# ---- main ------------------------------------------------------------------------------------------

def derive(configs: dict[str, Config], trees: list[str], n: int, m: int, rounds: int, shell_label: str,
           kinds: list[str], shell_tests: int) -> dict[str, Any]:
    def med(name: str, field: str = "wall") -> float:
        return statistics.median(getattr(configs[name], field))

    def least(name: str, field: str = "wall") -> float:
        return min(getattr(configs[name], field))

    def paired(a: str, b: str, field: str = "wall") -> dict[str, float]:
        pa, pb = getattr(configs[a], field), getattr(configs[b], field)
        return _common.summary([x - y for x, y in zip(pa, pb, strict=False)])

    out: dict[str, Any] = {"raw": {name: {"wall": _common.summary(c.wall), "cpu": _common.summary(c.cpu)}
                                   for name, c in configs.items()},
                           "runs": {name: {"wall": c.wall, "cpu": c.cpu} for name, c in configs.items()}}
    for tree in trees:
        t: dict[str, Any] = {}
        for mode in ("q", "co") if "off/idle/q" in configs else ():
            t[f"idle_{mode}_added_s"] = med(f"{tree}/idle/{mode}") - med(f"off/idle/{mode}")
            t[f"idle_{mode}_added_paired"] = paired(f"{tree}/idle/{mode}", f"off/idle/{mode}")
            t[f"idle_{mode}_added_cpu_s"] = med(f"{tree}/idle/{mode}", "cpu") - med(f"off/idle/{mode}", "cpu")
        for kind in kinds:
            if f"{tree}/{kind}/N" not in configs:
                continue
            t[kind] = {}
            for field in ("wall", "cpu"):
                d1 = med(f"{tree}/{kind}/N", field) - med("off/N", field)
                dm = med(f"{tree}/{kind}/M", field) - med("off/M", field)
                slope = (dm - d1) / (m - n)
                # Paired: each round's own differences (its four runs ran back to back), then the
                # spread of those per-round figures over the rounds.
                per_round = []
                for i in range(rounds):
                    r1 = getattr(configs[f"{tree}/{kind}/N"], field)[i] - getattr(configs["off/N"], field)[i]
                    rm = getattr(configs[f"{tree}/{kind}/M"], field)[i] - getattr(configs["off/M"], field)[i]
                    per_round.append(((rm - r1) / (m - n), r1 - n * (rm - r1) / (m - n)))
                # Minima: each configuration's fastest round. Interference on a shared machine (other
                # users' work, a CPU frequency dip, a page-cache miss) only ever adds time to a run, never
                # takes any away, so the minimum over the rounds is the robust floor of each configuration,
                # and the slope and fixed part from those floors are the least disturbed estimates (at the
                # price of resting on four single runs: compare them with the medians and the paired ones).
                low1 = least(f"{tree}/{kind}/N", field) - least("off/N", field)
                lowm = least(f"{tree}/{kind}/M", field) - least("off/M", field)
                low_slope = (lowm - low1) / (m - n)
                t[kind][field] = {"slope_s": slope, "fixed_s": d1 - n * slope,
                                  "slope_paired": _common.summary([p[0] for p in per_round]),
                                  "fixed_paired": _common.summary([p[1] for p in per_round]),
                                  "slope_min_s": low_slope, "fixed_min_s": low1 - n * low_slope}
        out[tree] = t
    if "shell/N" not in configs:
        return out
    shell_per_test = (med("shell/N") - med("off/shell")) / shell_tests
    out["shell"] = {"what": shell_label, "per_test_s": shell_per_test}
    for tree in trees:
        for kind in kinds:
            if kind in out[tree] and out[tree][kind]["wall"]["slope_s"] > 0:
                out[tree][kind]["shell_ratio"] = shell_per_test / out[tree][kind]["wall"]["slope_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", type=int, default=100, help="N: marked tests in the small checked suite")
    parser.add_argument("--big-tests", type=int, default=0, help="M: marked tests in the large one (4N)")
    parser.add_argument("--kinds", default="", help="checked configurations, comma-separated: locks, "
                        "nolocks (default both) and nvml (default when a GPU is found)")
    parser.add_argument("--idle-tests", type=int, default=50)
    parser.add_argument("--shell-tests", type=int, default=50,
                        help="tests of the suite that runs the seeds' shell check around each test")
    parser.add_argument("--idle-rounds", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the checked configurations")
    parser.add_argument("--check-rounds", type=int, default=9)
    parser.add_argument("--sleepers", type=int, default=1000)
    parser.add_argument("--trees", default="WORKTREE")
    parser.add_argument("--attribution-rounds", type=int, default=9)
    parser.add_argument("--skip", default="",
                        help="comma-separated parts to skip: idle,checked,shell,attribution,per-check")
    parser.add_argument("--no-autoload", action="store_true",
                        help="PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 in every run and gpuclean loaded with "
                             "-p gpuclean: other installed plugins (a GPU image has many) stay out of both "
                             "sides")
    parser.add_argument("--json")
    parser.add_argument("--per-check-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.per_check_only:
        print(json.dumps(per_check(args.check_rounds, args.sleepers)))
        return 0
    skip = set(filter(None, args.skip.split(",")))
    trees = args.trees.split(",")
    tmp = tempfile.mkdtemp(prefix="gpuclean-session-")
    env = base_env()
    if args.no_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    on = ["-p", "gpuclean"] if args.no_autoload else []
    tree_dirs = {rev: export_tree(rev, os.path.join(tmp, f"tree{i}")) for i, rev in enumerate(trees)}
    for tree_dir in tree_dirs.values():  # compile once, outside the timed runs
        subprocess.run([sys.executable, "-m", "compileall", "-q", tree_dir or os.path.join(_common.REPO,
                                                                                           "pytest_gpuclean")],
                       check=True, stdout=subprocess.DEVNULL)
    n = args.tests
    nvml = has_nvml_gpu()
    if nvml:
        # As pip leaves an installed module: compiled. (The GPU image ships pynvml's 8000 lines without
        # bytecode and sets PYTHONDONTWRITEBYTECODE: every process there compiled it, ~50 ms on an H200.)
        import pynvml

        subprocess.run([sys.executable, "-m", "compileall", "-q", pynvml.__file__], check=False,
                       stdout=subprocess.DEVNULL)
    shell = SHELL if shutil.which("nvidia-smi") else SHELL_PS_ONLY
    shell_label = "ps + nvidia-smi" if shell == SHELL else "ps only (no nvidia-smi on this machine)"
    sim = make_sim(os.path.join(tmp, "sim"), DEVICES)
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    off = ["-p", "no:gpuclean"]
    off_env = env
    if args.no_autoload:
        # `-p gpuclean` makes pytest look the name up among every installed distribution's entry points
        # (importlib.metadata, tens of ms in an image with many packages), which an autoload run does
        # with or without the plugin: the plugin-off side pays that lookup too, through `-p` of an
        # empty module, so the difference is the plugin's own cost.
        noop_dir = os.path.join(tmp, "noop")
        os.makedirs(noop_dir)
        with open(os.path.join(noop_dir, "gpuclean_bench_noop.py"), "w") as f:
            f.write('"""An empty pytest plugin (bench_session.py --no-autoload)."""\n')
        off = [*off, "-p", "gpuclean_bench_noop"]
        off_env = {**env, "PYTHONPATH": noop_dir}
    idle = write_suite(os.path.join(tmp, "idle"), args.idle_tests, marked=False)
    suite_n = write_suite(os.path.join(tmp, "n"), n, marked=True)
    m = args.big_tests or 4 * n
    suite_m = write_suite(os.path.join(tmp, "m"), m, marked=True)
    kinds = (args.kinds.split(",") if args.kinds else ["locks", "nolocks"] + (["nvml"] if nvml else []))
    if "nvml" in kinds and not nvml:
        parser.error("--kinds: nvml asked for, but pynvml finds no GPU on this machine")

    idle_configs: dict[str, Config] = {}
    checked_configs: dict[str, Config] = {}
    for mode, extra in (("q", []), ("co", ["--co"])):
        idle_configs[f"off/idle/{mode}"] = Config(f"off/idle/{mode}", idle, off + extra, off_env, None)
        for rev in trees:
            idle_configs[f"{rev}/idle/{mode}"] = Config(f"{rev}/idle/{mode}", idle, on + extra,
                                                        with_tree(env, tree_dirs[rev]), rev)
    checked_configs["off/N"] = Config("off/N", suite_n, off, off_env, None)
    checked_configs["off/M"] = Config("off/M", suite_m, off, off_env, None)
    if "shell" not in skip:
        shell_suite = write_suite(os.path.join(tmp, "shell"), args.shell_tests, marked=False, shell=shell)
        checked_configs["shell/N"] = Config("shell/N", shell_suite, off, off_env, None)
        checked_configs["off/shell"] = Config("off/shell", idle if args.shell_tests == args.idle_tests else
                                              write_suite(os.path.join(tmp, "noshell"), args.shell_tests,
                                                          False), off, off_env, None)
    for rev in trees:
        for kind in kinds:
            kenv = with_tree(env, tree_dirs[rev])
            kenv["GPUCLEAN_LOCK_DIR"] = os.path.join(tmp, "locks")
            if kind != "nvml":
                kenv["GPUCLEAN_SIMULATE"] = sim
            kenv["GPUCLEAN_LOCK"] = "off" if kind == "nolocks" else "on"
            for size, suite in (("N", suite_n), ("M", suite_m)):
                checked_configs[f"{rev}/{kind}/{size}"] = Config(f"{rev}/{kind}/{size}", suite, on, kenv, rev)

    loads: dict[str, Any] = {}

    def run_rounds(configs: dict[str, Config], rounds: int, label: str) -> None:
        order = list(configs.values())
        for c in order:  # warm-up: caches, bytecode
            timed_run(pytest_cmd + c.args, c.suite, c.env)
        load = Load()
        for r in range(rounds):
            shift = r % len(order)
            for c in order[shift:] + order[:shift]:
                wall, cpu = timed_run(pytest_cmd + c.args, c.suite, c.env)
                c.wall.append(wall)
                c.cpu.append(cpu)
                load.ours += cpu
            load.loadavg.append(os.getloadavg()[0])
            print(f"{label}: round {r + 1}/{rounds} (load average {load.loadavg[-1]:.2f})", file=sys.stderr,
                  flush=True)
        loads[label] = load.summary()

    results: dict[str, Any] = {"machine": _common.machine(), "trees": trees, "tests": n, "big_tests": m,
                               "load": loads,
                               "idle_tests": args.idle_tests, "devices": DEVICES, "nvml_gpu": nvml,
                               "autoload": not args.no_autoload}
    if "idle" not in skip:
        run_rounds(idle_configs, args.idle_rounds, "idle")
        # Printed at once: a run cut short by a time limit still leaves this part behind.
        idle_only = derive(idle_configs, trees, n, m, args.rounds, shell_label, [], args.shell_tests)
        for rev in trees:
            print(f"idle [{rev}]: pytest -q added {_common.fmt_time(idle_only[rev]['idle_q_added_s'])}, "
                  f"--co added {_common.fmt_time(idle_only[rev]['idle_co_added_s'])}", flush=True)
    if "checked" not in skip:
        run_rounds(checked_configs, args.rounds, "checked")
    if "idle" not in skip or "checked" not in skip:
        ran = {**({} if "idle" in skip else idle_configs), **({} if "checked" in skip else checked_configs)}
        results["whole_process"] = derive(ran, trees, n, m, args.rounds, shell_label, kinds, args.shell_tests)
    if "attribution" not in skip:
        timer_dir = os.path.join(tmp, "timer")
        os.makedirs(timer_dir)
        with open(os.path.join(timer_dir, "gpuclean_bench_timer.py"), "w") as f:
            f.write(TIMER_PLUGIN)
        # Idle (the small unmarked suite) and one checked configuration per tree, against the plugin off.
        # With a GPU, the checked suite on real NVML too (every GPU, locks on).
        chosen = {name: c for name, c in {**idle_configs, **checked_configs}.items()
                  if name == "off/idle/q" or name == "off/N"
                  or name.endswith(("/idle/q", "/locks/N", "/nvml/N"))}
        phases = attribution(chosen, args.attribution_rounds, timer_dir, pytest_cmd)
        results["attribution"] = {"phases": phases, "import": {
            rev: import_cost(with_tree(env, tree_dirs[rev]), tree_dirs[rev] or tmp) for rev in trees}}
    if "per-check" not in skip:
        results["per_check"] = {}
        for rev in trees:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--per-check-only",
                                  "--check-rounds", str(args.check_rounds), "--sleepers", str(args.sleepers)],
                                 env=with_tree(env, tree_dirs[rev]), cwd=tree_dirs[rev] or _common.REPO,
                                 capture_output=True, text=True, check=True).stdout
            results["per_check"][rev] = json.loads(out.strip().splitlines()[-1])
            print(f"per-check: {rev} done", file=sys.stderr, flush=True)
    report(results, trees, kinds)
    if args.json:
        _common.write_json(args.json, results)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def attributed(phases: dict[str, dict[str, float]], on: str, off: str) -> dict[str, float]:
    """gpuclean's share of each phase: the phase with the plugin minus without (medians)."""
    a, b = phases[on], phases[off]
    share = {phase: a.get(phase, 0.0) - b.get(phase, 0.0) for phase in PHASES}
    share["per_test"] = a["other_tests"] - b["other_tests"]
    share["first_test_extra"] = (a["first_test"] - a["other_tests"]) - (b["first_test"] - b["other_tests"])
    return share


def report(results: dict[str, Any], trees: list[str], kinds: list[str]) -> None:
    ms = _common.fmt_time
    attr = results.get("attribution")
    if attr:
        for tree in trees:
            imp = attr["import"][tree]
            idle = attributed(attr["phases"], f"{tree}/idle/q", "off/idle/q")
            checked = attributed(attr["phases"], f"{tree}/locks/N", "off/N")
            idle_total = sum(v for k, v in idle.items() if k not in ("per_test", "first_test_extra"))
            checked_fixed = sum(v for k, v in checked.items() if k != "per_test")
            paired = paired_fixed(attr["phases"]["rounds"], f"{tree}/locks/N", "off/N")
            paired_test = paired_per_test(attr["phases"]["rounds"], f"{tree}/locks/N", "off/N")
            attr.setdefault("derived", {})[tree] = {"idle": idle, "checked": checked,
                                                    "idle_hooks_s": idle_total,
                                                    "checked_fixed_s": checked_fixed,
                                                    "checked_fixed_paired_s": paired,
                                                    "checked_per_test_paired_s": paired_test}
            start = sum(checked[p] for p in ("load_initial_conftests", "configure", "sessionstart",
                                             "collection_finish"))
            end = checked["sessionfinish"] + checked["unconfigure"] + checked["after_unconfigure"]
            print(f"in-process [{tree}]: plugin import {ms(imp['cpu_s'])} CPU ({ms(imp['wall_s'])} wall); "
                  f"idle: hooks outside tests {ms(idle_total)}, per test {ms(idle['per_test'])}; "
                  f"checked (8 sim devices, locks): fixed {ms(checked_fixed)} "
                  f"(start {ms(start)}, first check extra {ms(checked['first_test_extra'])}, end {ms(end)}), "
                  f"per test {ms(checked['per_test'])}; paired per round: fixed {ms(paired[0])} "
                  f"(p10..p90 {ms(paired[1])}..{ms(paired[2])}), per test {ms(paired_test[0])} "
                  f"(p10..p90 {ms(paired_test[1])}..{ms(paired_test[2])})")
            if f"{tree}/nvml/N" in attr["phases"]:
                nvml = attributed(attr["phases"], f"{tree}/nvml/N", "off/N")
                nvml_fixed = paired_fixed(attr["phases"]["rounds"], f"{tree}/nvml/N", "off/N")
                nvml_test = paired_per_test(attr["phases"]["rounds"], f"{tree}/nvml/N", "off/N")
                attr["derived"][tree].update({"nvml": nvml, "nvml_fixed_paired_s": nvml_fixed,
                                              "nvml_per_test_paired_s": nvml_test})
                print(f"in-process [{tree}]: checked (real NVML, every GPU, locks): paired per round: fixed "
                      f"{ms(nvml_fixed[0])} (p10..p90 {ms(nvml_fixed[1])}..{ms(nvml_fixed[2])}), per test "
                      f"{ms(nvml_test[0])} (p10..p90 {ms(nvml_test[1])}..{ms(nvml_test[2])})")
    whole = results.get("whole_process")
    if whole:
        n = results["tests"]
        rows = []
        for tree in trees:
            t = whole[tree]
            for mode, what in (("q", "pytest -q"), ("co", "pytest --co")):
                if f"idle_{mode}_added_s" in t:
                    spread = t[f"idle_{mode}_added_paired"]
                    rows.append([tree, f"idle: {what}, added", ms(t[f"idle_{mode}_added_s"]),
                                 f"paired p10..p90 {ms(spread['p10'])}..{ms(spread['p90'])}; CPU "
                                 f"{ms(t[f'idle_{mode}_added_cpu_s'])}"])
            for kind in kinds:
                if kind not in t:
                    continue
                for field in ("cpu", "wall"):
                    k = t[kind][field]
                    fixed, slope = k["fixed_paired"], k["slope_paired"]
                    rows.append([tree, f"{kind}, {field}: fixed (start+end)", ms(k["fixed_s"]),
                                 ms(k["fixed_min_s"]), ms(fixed["median"]),
                                 f"{ms(fixed['p25'])}..{ms(fixed['p75'])}",
                                 f"{ms(fixed['p10'])}..{ms(fixed['p90'])}"])
                    versus = (f"; shell check / this = {t[kind]['shell_ratio']:.1f}x"
                              if field == "wall" and "shell_ratio" in t[kind] else "")
                    rows.append([tree, f"{kind}, {field}: per checked test", ms(k["slope_s"]),
                                 ms(k["slope_min_s"]), ms(slope["median"]),
                                 f"{ms(slope['p25'])}..{ms(slope['p75'])}",
                                 f"{ms(slope['p10'])}..{ms(slope['p90'])}{versus}"])
        m = results.get("big_tests", 4 * n)
        print(_common.table(rows, ["tree", f"whole process (N={n}, M={m})", "of medians", "of minima",
                                   "paired median",
                                   "p25..p75", "p10..p90"]))
        for part, load in results.get("load", {}).items():
            la = load["loadavg_1min"]
            print(f"load during {part}: the machine's {load['cpus_seen']:.1f} CPUs were busy "
                  f"{load['busy_cpus']:.2f} on average, the timed runs {load['ours_cpus']:.2f}, others "
                  f"{load['others_cpus']:.2f}; 1-min load average after each round median {la['median']:.2f} "
                  f"(min {la['min']:.2f}, max {la['max']:.2f})")
        if "shell" in whole:
            print(f"shell check ({whole['shell']['what']}) before+after each test: "
                  f"{ms(whole['shell']['per_test_s'])} per test")
    for tree, pc in results.get("per_check", {}).items():
        print(f"per check [{tree}] 8 simulated devices: 1 thread {ms(pc['check_1_thread_s'])}, "
              f"{pc['threads']} threads {ms(pc['check_64_threads_s'])} (ratio {pc['ratio_64_threads']:.2f}); "
              f"idle host {ms(pc['check_idle_host_s'])}, {pc['sleepers']} sleepers "
              f"{ms(pc['check_with_sleepers_s'])} (ratio {pc['ratio_sleepers']:.2f}); first check "
              f"{ms(pc['first_check_s'])}, with the sleepers {ms(pc['first_check_with_sleepers_s'])}")
        if "files_per_check_idle_host" in pc:
            print(f"per check [{tree}] os calls per check: idle host {pc['files_per_check_idle_host']}, "
                  f"{pc['sleepers']} sleepers {pc['files_per_check_with_sleepers']}")


if __name__ == "__main__":
    sys.exit(main())
