"""Output equivalence of package trees: the same inner sessions and ``gpuclean`` commands, on simulated
devices, run with each tree's ``pytest_gpuclean``; what they print and write, normalised, must be the same.

For a restructuring: behaviour must not change. Each tree is a git revision (exported with ``git archive``),
``WORKTREE`` (this checkout) or a directory holding a ``pytest_gpuclean`` package; the scenarios and the
inner suites (tests/examples) are this checkout's, so only the package differs. Every tree runs in the same
directory (``--work``), one after the other, so that paths and the simulated devices' UUIDs (derived from
their directory) are the same; what still varies from run to run is normalised: pids, clock ticks, session
ids, times, durations and dates.

    python benchmarks/equivalence.py --trees 86ad68d,WORKTREE            # diff, exit 1 on a difference
    python benchmarks/equivalence.py --trees WORKTREE,WORKTREE --only leak  # the harness's own noise

What is compared per scenario: pytest's terminal output, the JSON report, the JUnit XML, the GitHub step
summary, and the commands' output (text and ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common
from ab_trees import export

EXAMPLES = Path(_common.REPO) / "tests" / "examples"
INNER = ["-p", "gpuclean", "-p", "no:cacheprovider", "-rA"]
OUTPUTS = ["--gpuclean-report=report.json", "--junitxml=junit.xml"]
COLLECTED = ("report.json", "junit.xml", "summary.md")


@dataclass(frozen=True)
class Scenario:
    """One inner session (``args``), or a list of ``gpuclean`` commands (``commands``), in a fresh directory
    holding ``examples`` (tests/examples paths) and prelude.py."""

    name: str
    examples: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    outside: int = 0
    """Holders started before the run, outside it (foreign to the inner session)."""
    debris: bool = False
    """A holder that carries the cookie of a provably dead session, and dead-session reaping on."""
    commands: tuple[tuple[str, ...], ...] = ()
    """``gpuclean`` commands (``python -m pytest_gpuclean ...``) instead of an inner session."""
    github: bool = False
    unordered: bool = False
    """The order of tests varies from run to run (xdist): lines are compared as a sorted list."""
    files: tuple[tuple[str, str], ...] = field(default=())
    """(name, text) of files written into the directory."""


SCENARIOS = (
    Scenario("clean", ("test_marked.py", "core/clean_session_passes_and_shows_devices"), tuple(OUTPUTS)),
    Scenario("leak", ("core/leak_is_a_teardown_error",), (*OUTPUTS, "--gpuclean-grace=2")),
    Scenario("leaks_and_clean", ("outputs/leaks_and_clean",), (*OUTPUTS, "--gpuclean-grace=2"),
             github=True),
    Scenario("github", ("outputs/github_annotations_and_job_summary",), (*OUTPUTS, "--gpuclean-grace=2"),
             github=True),
    Scenario("fixture_leak", ("outputs/engine",),
             (*OUTPUTS, "--gpuclean-timeout=0.5", "--gpuclean-grace=2"), github=True),
    Scenario("fixture_leak_reap_off", ("outputs/engine",),
             (*OUTPUTS, "--gpuclean-reap=off", "--gpuclean-timeout=0.5", "--gpuclean-grace=2"), github=True),
    Scenario("reap_off", ("outputs/report_with_reaping_off_shows",), (*OUTPUTS, "--gpuclean-reap=off")),
    Scenario("not_clean", ("outputs/report_records_gpus_that_were_not_clean",), tuple(OUTPUTS)),
    Scenario("xdist", ("outputs/report_under_xdist_is_merged",), (*OUTPUTS, "-n", "2", "--gpuclean-grace=2"),
             unordered=True),
    Scenario("foreign", ("core/foreign_holder_errors_in_setup",), tuple(OUTPUTS), outside=1, github=True),
    Scenario("outside_skip", ("outside/marked",), (*OUTPUTS, "--gpuclean-outside=skip"),
             env=(("MARK_TIMEOUT", "0.5"), ("MARKED_TESTS", "3")), outside=1),
    Scenario("outside_fail", ("outside/marked",), tuple(OUTPUTS), env=(("MARK_TIMEOUT", "0.5"),
                                                                         ("MARKED_TESTS", "2")), outside=1),
    Scenario("dead_session", (), (*OUTPUTS, "--gpuclean-timeout=1"), debris=True, files=(("test_inner.py", (
        "import pytest\n\n\n@pytest.mark.needs_clean_gpus(timeout=1)\ndef test_first():\n    pass\n")),)),
    Scenario("health", ("health/gpu_health.py", "health/xid_faults"), tuple(OUTPUTS), github=True),
    Scenario("victims", ("outputs/victims",), tuple(OUTPUTS)),
    Scenario("fixture_and_count", (), tuple(OUTPUTS), files=(("test_inner.py", (
        "import os\n\nimport pytest\n\n\n@pytest.mark.needs_clean_gpus(count=1, tolerance_mib=8)\n"
        "def test_count(clean_gpus):\n"
        "    print(clean_gpus.uuids, [(d.index, d.name, d.used_bytes) for d in clean_gpus.devices],\n"
        "          os.environ['CUDA_VISIBLE_DEVICES'])\n\n\n"
        "def test_unmarked_with_fixture(clean_gpus):\n    print(clean_gpus)\n")),)),
    Scenario("idle", ("test_marked.py",), ("-k", "nothing", "--gpuclean-report=report.json")),
    Scenario("bad_option", ("test_marked.py",), ("--gpuclean-timeout=abc",)),
    Scenario("unknown_variable", ("test_marked.py",), tuple(OUTPUTS), env=(("GPUCLEAN_TIMOUT", "5"),)),
    Scenario("commands_idle", commands=(
        ("status",), ("status", "--json"), ("check",), ("check", "--json"), ("reap", "--dry-run"),
        ("reap", "--json"))),
    Scenario("commands_busy", outside=1, commands=(
        ("status",), ("status", "--json"), ("check", "--wait", "0.3"), ("check", "--wait", "0.3", "--json"),
        ("reap", "--dry-run"), ("reap", "--dry-run", "--json"), ("reap", "--json"), ("status", "--json"))),
)


# ---- normalisation: what legitimately varies from one run to the next ----------------------------------

_TEXT = [
    (re.compile(r"gc\.\d+\.\d+\.\d+\.[0-9a-f]+"), "gc.SESSION"),
    (re.compile(r"\b(pids?|pid\(s\)|workers|process(?:es)?) \[[\d, ]+\]"), r"\1 [PIDS]"),
    (re.compile(r"(?<![a-z_])(pids?|pid\(s\)) \d+(?:, \d+)*"), r"\1 N"),
    (re.compile(r"\b\d+(?:\.\d+)?(?: ?s|ms)\b"), "T"),
    (re.compile(r"\b\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?"), "DATE"),
    (re.compile(r"\bstarted \d\d:\d\d:\d\d\b"), "started TIME"),
    (re.compile(r"gpuclean_(\w+_s)\" value=\"[\d.]+\""), r'gpuclean_\1" value="T"'),
    (re.compile(r"(time|timestamp)=\"[^\"]*\""), r'\1="T"'),
    (re.compile(r"(hostname)=\"[^\"]*\""), r'\1="HOST"'),
    (re.compile(r"gpuclean_reaped_pids\" value=\"[\d,]*\""), 'gpuclean_reaped_pids" value="PIDS"'),
    (re.compile(r"/proc/\d+/"), "/proc/N/"),
    (re.compile(r"^=+ (.+ in T) =+$", re.M), r"= \1 ="),  # (pytest pads the line to its width)
]
_TIMES = re.compile(r"(_s|_at)$|^(since|start|end)$")


def _pids_in(value: Any, key: str = "") -> set[int]:
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in _pids_in(v, k)}
    if isinstance(value, list):
        return {p for v in value for p in _pids_in(v, key)}
    return {value} if key in ("pid", "ppid") and isinstance(value, int) and value > 1 else set()


def known_pids(outputs: dict[str, str], pidfiles: Sequence[Path]) -> set[int]:
    """The pids a run named: in its pid files and in its JSON outputs (also a command's ``--json``)."""
    pids: set[int] = set()
    for pidfile in pidfiles:
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(p) for p in pidfile.read_text().split())
    for content in outputs.values():
        body = content.split("--- stdout\n", 1)[-1].split("--- stderr\n", 1)[0]
        with contextlib.suppress(ValueError):
            pids |= _pids_in(json.loads(body))
    return pids


def _json(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _json(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v, key) for v in value]
    if key in ("pid", "ppid", "start_ticks", "pids", "reaped_pids") and isinstance(value, (int, list)):
        return "N"
    if _TIMES.search(key) and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return "T"
    if key in ("host", "python", "hostname", "date"):
        return "H"
    if isinstance(value, str):
        return text(value)
    return value


def text(value: str, pids: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    if pids:
        value = re.sub(r"(?<![\w.-])(" + "|".join(map(str, sorted(pids, reverse=True))) + r")(?![\w.-])", "N",
                       value)
    for pattern, replacement in _TEXT:
        value = pattern.sub(replacement, value)
    return value


def normalised(content: str, pids: set[int]) -> str:
    """``content`` (an output file, or a command's exit status, stdout and stderr) normalised."""
    head, sep, rest = content.partition("--- stdout\n")
    body, sep2, tail = rest.partition("--- stderr\n") if sep else (head, "", "")
    head = head if sep else ""
    with contextlib.suppress(ValueError):
        body = json.dumps(_json(json.loads(body)), indent=1) + "\n"
    return text(head + sep + body + sep2 + tail, pids)


# ---- running a scenario ------------------------------------------------------------------------------

def _env(tree: str, work: Path, scenario: Scenario) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GPUCLEAN_", "PYTEST_", "GITHUB_")) and k not in ("CUDA_VISIBLE_DEVICES",
                                                                               "PYTHONPATH", "CI")}
    env.update(PYTHONPATH=tree, GPUCLEAN_SIMULATE=str(work / "sim"), GPUCLEAN_LOCK_DIR=str(work / "locks"),
               GPUCLEAN_DEAD_SESSIONS="on" if scenario.debris else "off",
               LEAK_PIDFILE=str(work / "run" / "leak.pids"), PYTHONDONTWRITEBYTECODE="1",
               COLUMNS="110", PYTEST_ADDOPTS="-p no:randomly")
    if scenario.github:
        env.update(GITHUB_ACTIONS="true", GITHUB_STEP_SUMMARY=str(work / "run" / "summary.md"),
                   GITHUB_WORKSPACE=str(work))
    env.update(scenario.env)
    return env


def _start_holder(env: dict[str, str], work: Path, name: str, extra: dict[str, str] | None = None
                  ) -> subprocess.Popen[bytes]:
    pidfile = work / f"{name}.pid"
    proc = subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir",
                             str(work / "sim"), "--device", "0", "--mib", "100", "--pidfile", str(pidfile)],
                            env={**env, **(extra or {})}, cwd=work)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"holder {name} did not start")
        time.sleep(0.01)
    return proc


def _dead_cookie() -> str:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is certainly gone now
    namespace = os.stat("/proc/self/ns/pid").st_ino
    return f"gc.{dead.pid}.1.{namespace}.0badc0de:t3"


@contextlib.contextmanager
def _dead_sessions_lock(on: bool) -> Iterator[None]:
    # As tests/conftest.py's dead_sessions_on: no other run of this user reaps this run's debris meanwhile,
    # nor this one theirs.
    if not on:
        yield
        return
    lock = Path(tempfile.gettempdir()) / f"gpuclean-tests-dead-sessions-{os.getuid()}.lock"
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _kill_leftovers(work: Path, holders: Sequence[subprocess.Popen[bytes]]) -> None:
    pids: list[int] = []
    for pidfile in [work / "run" / "leak.pids", *work.glob("*.pid"), *(work / "run").glob("*.pid")]:
        with contextlib.suppress(OSError, ValueError):
            pids += [int(p) for p in pidfile.read_text().split()]
    pids += [h.pid for h in holders]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for holder in holders:
        holder.wait()
    for pid in pids:  # (orphans re-parented to this process, a subreaper's child's)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def run_scenario(tree: str, work: Path, scenario: Scenario) -> dict[str, str]:
    """Run ``scenario`` with ``tree``'s package in ``work``; its outputs by name, normalised."""
    shutil.rmtree(work, ignore_errors=True)
    run = work / "run"
    run.mkdir(parents=True)
    env = _env(tree, work, scenario)
    subprocess.run([sys.executable, "-m", "pytest_gpuclean.simulate", "init", str(work / "sim"), "--devices",
                    "2"], env=env, check=True, capture_output=True)
    for name in ("prelude.py", *scenario.examples):
        source = EXAMPLES / name
        if source.is_dir():
            shutil.copytree(source, run, dirs_exist_ok=True)
        else:
            shutil.copy(source, run / source.name)
    for name, content in scenario.files:
        (run / name).write_text(content)
    holders = [_start_holder(env, work, f"outside-{i}") for i in range(scenario.outside)]
    outputs: dict[str, str] = {}
    with _dead_sessions_lock(scenario.debris):
        try:
            if scenario.debris:
                holders.append(_start_holder(env, work, "debris", {"GPUCLEAN_TEST": _dead_cookie(),
                                                                   "GPUCLEAN_OWNER": "tests/x.py::test_x"}))
            if scenario.commands:
                for i, command in enumerate(scenario.commands):
                    done = subprocess.run([sys.executable, "-m", "pytest_gpuclean", *command], env=env,
                                          cwd=run, capture_output=True, text=True, timeout=300)
                    outputs[f"{i:02d} gpuclean {' '.join(command)}"] = (
                        f"exit {done.returncode}\n--- stdout\n{done.stdout}--- stderr\n{done.stderr}")
            else:
                done = subprocess.run([sys.executable, "-m", "pytest", *INNER, *scenario.args], env=env,
                                      cwd=run, capture_output=True, text=True, timeout=600)
                outputs["pytest"] = (f"exit {done.returncode}\n--- stdout\n{done.stdout}"
                                     f"--- stderr\n{done.stderr}")
                for name in COLLECTED:
                    if (run / name).exists():
                        outputs[name] = (run / name).read_text()
        finally:
            pids = known_pids(outputs, [run / "leak.pids", *work.glob("*.pid"), *run.glob("*.pid")])
            _kill_leftovers(work, holders)
    found = {name: normalised(content, pids) for name, content in outputs.items()}
    if scenario.unordered:
        found = {name: "\n".join(sorted(content.replace("<testcase", "\n<testcase").splitlines())) + "\n"
                 for name, content in found.items()}
    return found


def _check_tree(tree: str) -> None:
    where = subprocess.run([sys.executable, "-c", "import pytest_gpuclean; print(pytest_gpuclean.__file__)"],
                           env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True,
                           cwd=tempfile.gettempdir()).stdout.strip()
    if not where.startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"tree {tree}: imports {where}, not its own package")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="WORKTREE,WORKTREE",
                        help="two trees: git revisions, WORKTREE or dirs")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(),
                                                       f"gpuclean-equivalence-{os.getuid()}"))
    parser.add_argument("--out", help="keep each tree's normalised outputs here")
    args = parser.parse_args()
    trees = args.trees.split(",")
    wanted = {n for n in args.only.split(",") if n}
    scenarios = [s for s in SCENARIOS if not wanted or s.name in wanted]
    tmp = Path(tempfile.mkdtemp(prefix="gpuclean-equivalence-trees-"))
    dirs: list[str] = []
    for i, rev in enumerate(trees):
        dest = tmp / f"tree{i}"
        export(rev, str(dest))
        dirs.append(str(dest))
        _check_tree(str(dest))
    work = Path(args.work)
    differ = 0
    for scenario in scenarios:
        results = []
        for tree in dirs:
            results.append(run_scenario(tree, work, scenario))
            if args.out:
                folder = Path(args.out) / f"tree{dirs.index(tree)}" / scenario.name
                folder.mkdir(parents=True, exist_ok=True)
                for name, content in results[-1].items():
                    (folder / name.replace(" ", "_").replace("/", "_")).write_text(content)
        first, second = results
        names = sorted(first.keys() | second.keys())
        diff = [line for name in names for line in difflib.unified_diff(
            first.get(name, "").splitlines(), second.get(name, "").splitlines(),
            f"{trees[0]}/{scenario.name}/{name}", f"{trees[1]}/{scenario.name}/{name}", lineterm="", n=1)]
        print(f"{scenario.name}: {'same' if not diff else 'DIFFERENT'} ({len(names)} outputs)", flush=True)
        if diff:
            differ += 1
            print("\n".join(diff[:80]))
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{len(scenarios) - differ} of {len(scenarios)} scenarios the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
