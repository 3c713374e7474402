""".ci/stages.py, which runs CI's parts side by side: every part runs, each one's output is shown whole in the
order given, and the run fails at the end if any part failed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

STAGES = Path(__file__).resolve().parent.parent / ".ci" / "stages.py"


def test_parts_run_side_by_side_are_shown_in_order_and_a_failure_fails_the_run_at_the_end() -> None:
    # b fails at once while a still runs; c (a full core) waits until a and b (half a core each) are done.
    done = subprocess.run([sys.executable, str(STAGES), "--jobs", "1", "a:0.5=sleep 1; echo out-a",
                           "b:0.5=echo out-b; exit 3", "c=echo out-c"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith(("== ", "-- "))]
    assert [lines[i] for i in heads][::2] == ["== a: sleep 1; echo out-a", "== b: echo out-b; exit 3",
                                            "== c: echo out-c"]
    assert [lines[i + 1] for i in heads[::2]] == ["out-a", "out-b", "out-c"]
    assert lines[heads[3]].startswith("-- b: FAILED (exit status 3), ")
    assert lines[-1] == "FAILED: b"
    # The scheduler's own log: c started only once a and b had ended.
    events = [line.split("] ", 1)[1] for line in done.stderr.splitlines() if line.startswith("[ci ")]
    ended = [i for i, event in enumerate(events) if event.startswith(("ok a ", "FAILED b "))]
    assert len(ended) == 2 and events.index("start c") > max(ended), events


def test_times_are_rounded_before_they_are_split_into_minutes() -> None:
    spec = importlib.util.spec_from_file_location("ci_stages", STAGES)
    assert spec is not None and spec.loader is not None
    stages = importlib.util.module_from_spec(spec)
    sys.modules["ci_stages"] = stages  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(stages)
    finally:
        del sys.modules["ci_stages"]
    assert [stages._minutes(s) for s in (0, 59.94, 59.96, 299.97, 61.25, 3600)] == [
        "0m00.0s", "0m59.9s", "1m00.0s", "5m00.0s", "1m01.2s", "60m00.0s"]
