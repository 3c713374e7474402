"""Run CI stages side by side and report them one after the other (called by .ci/test and .ci/setup).

    python3 .ci/stages.py [--jobs N] NAME[:SHARE]=COMMAND ...

Each COMMAND is a bash command line, run from the checkout's root with its output (stdout and stderr) in a
file of its own. Stages start in the order given (the callers list the longest first) while the CPU shares
of those running add up to at most N (default 2: the box's cores). A stage's SHARE (default 1) is how much
of a core it keeps busy: a stage that mostly waits (for a Ray cluster to start, for a test's timeout) says
0.5, and two such run beside one that computes. When the next stage does not fit, a later one that does
starts first. Each stage's output is printed whole, in the order given, as soon as it and every stage
before it have ended: the log reads as if the stages had run one after the other, each under its heading
with its wall time, its CPU time (user + system of every process below it that was waited for) and its exit
status. The first stage not yet printed is shown as its output comes (the one a reader waits for). A table of
all stages, with when each started and ended, closes the log. The exit status is 1 if any stage failed,
after every stage has run (a failure does not stop the others: one CI run shows every failure).

Stdlib only: it runs before and apart from the project's venvs.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Stage:
    name: str
    command: str
    log: Path
    share: float = 1.0
    proc: subprocess.Popen[bytes] | None = None
    started: float | None = None
    ended: float | None = None
    status: int | None = None
    cpu_s: float = 0.0
    headed: bool = False  # its heading printed
    shown: int = 0  # bytes of its log printed


def _minutes(seconds: float) -> str:
    tenths = round(seconds * 10)  # (rounded first: 299.97 s is 5m00.0s, not 4m60.0s)
    return f"{tenths // 600}m{tenths % 600 / 10:04.1f}s"


def _show_new(stage: Stage) -> None:
    """Print what the stage's log gained since last time (under its heading)."""
    if not stage.headed:
        print(f"== {stage.name}: {stage.command}", flush=True)
        stage.headed = True
    with stage.log.open("rb") as f:
        f.seek(stage.shown)
        data = f.read()
    stage.shown += len(data)
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", "-j", type=int, default=2,
                        help="the CPU shares of the stages running at once add up to at most this "
                        "(default 2)")
    parser.add_argument("stages", nargs="+", metavar="NAME[:SHARE]=COMMAND")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs} is less than 1")
    logs = Path(tempfile.mkdtemp(prefix="ci-stages-"))
    stages: list[Stage] = []
    for spec in args.stages:
        head, sep, command = spec.partition("=")
        name, colon, share_text = head.partition(":")
        if not sep or not name or not command:
            parser.error(f"{spec!r} is not NAME[:SHARE]=COMMAND")
        try:
            share = float(share_text) if colon else 1.0
        except ValueError:
            share = -1.0
        if not 0 < share <= args.jobs:
            parser.error(f"{spec!r}: SHARE {share_text!r} is not a number above 0 and at most --jobs")
        stages.append(Stage(name, command, logs / f"{len(stages):02d}-{name.replace('/', '_')}.log", share))
    t0 = time.monotonic()
    pending = list(stages)
    running: dict[int, Stage] = {}
    printed = 0
    # Our own SIGINT/SIGTERM reach the stages too (they are in our process group); wait for them to end.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    while pending or running:
        while True:
            busy = sum(s.share for s in running.values())
            # (The first pending stage that fits: in the order given, unless a later, lighter one fits now.)
            fits = [s for s in pending if busy + s.share <= args.jobs + 1e-9]
            if not fits:
                break
            stage = fits[0]
            pending.remove(stage)
            with stage.log.open("wb") as out:
                stage.proc = subprocess.Popen(["bash", "-c", f"set -euo pipefail; {stage.command}"], cwd=ROOT,
                                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            stage.started = time.monotonic()
            running[stage.proc.pid] = stage
            print(f"[ci {_minutes(stage.started - t0)}] start {stage.name}", file=sys.stderr, flush=True)
        # The first stage not yet printed streams its output while we wait (polling: stdlib only).
        live = stages[printed] if printed < len(stages) else None
        while True:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid:
                break
            if live is not None and live.started is not None:
                _show_new(live)
            time.sleep(0.5)
        if pid not in running:
            continue
        stage = running.pop(pid)
        stage.status = os.waitstatus_to_exitcode(status)
        stage.cpu_s = usage.ru_utime + usage.ru_stime
        stage.ended = time.monotonic()
        print(f"[ci {_minutes(stage.ended - t0)}] {'ok' if stage.status == 0 else 'FAILED'} {stage.name} "
              f"({_minutes(stage.ended - (stage.started or t0))})", file=sys.stderr, flush=True)
        while printed < len(stages) and stages[printed].status is not None:
            done = stages[printed]
            _show_new(done)
            verdict = "ok" if done.status == 0 else f"FAILED (exit status {done.status})"
            print(f"-- {done.name}: {verdict}, {_minutes((done.ended or 0) - (done.started or 0))} wall, "
                  f"{_minutes(done.cpu_s)} CPU", flush=True)
            printed += 1
    total = time.monotonic() - t0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\n{'stage':<16} {'status':<7} {'start':>9} {'end':>9} {'wall':>9} {'CPU':>9}")
    for s in stages:
        print(f"{s.name:<16} {'ok' if s.status == 0 else 'FAILED':<7} {_minutes((s.started or t0) - t0):>9} "
              f"{_minutes((s.ended or t0) - t0):>9} {_minutes((s.ended or 0) - (s.started or 0)):>9} "
              f"{_minutes(s.cpu_s):>9}")
    print(f"{'all':<16} {'':<7} {'':>9} {_minutes(total):>9} {_minutes(total):>9} "
          f"{_minutes(children.ru_utime + children.ru_stime):>9}  (CPU shares up to {args.jobs} at a time)")
    failed = [s.name for s in stages if s.status != 0]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    for s in stages:
        s.log.unlink(missing_ok=True)
    logs.rmdir()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
