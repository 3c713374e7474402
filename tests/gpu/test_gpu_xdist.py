"""xdist siblings on a real GPU (issue 27, item 1): an unmarked test's CUDA child, started while another
worker's marked test holds the GPU's lock, is that worker's to reap and its test's finding; the test that
meets it is neither failed nor kept waiting.

Two workers, one GPU, marked tests with ``count=1``. Figures (wall time, victims, what each check waited)
are printed before the assertions, so that a run of the old code gives the "before" figures too.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from gpu_helpers import alive, used_mib

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (a CUDA child)"),
]

# The unmarked test's child: 256 MiB of ones on the GPU, held until it is ended.
CUDA_CHILD = ("import os, sys, time, torch; x = torch.ones(64 << 20, device='cuda'); "
              "torch.cuda.synchronize(); open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(600)")

# CUDA_CHILD_SOURCE becomes CUDA_CHILD as a Python string literal.
LEAKER = '''
import os, subprocess, sys, time
from pathlib import Path
import pytest


def wait_for(name, timeout=180):
    deadline = time.monotonic() + timeout
    while not (Path(os.environ[name]).exists() and Path(os.environ[name]).read_text()):
        assert time.monotonic() < deadline, name
        time.sleep(0.05)


def test_unmarked_leak():
    # No lock taken: it starts its CUDA child while the other worker's marked test holds the GPU.
    wait_for("VICTIM_STARTED")
    subprocess.Popen([sys.executable, "-c", CUDA_CHILD_SOURCE, os.environ["LEAK_PIDFILE"]])
    wait_for("LEAK_PIDFILE")
    time.sleep(0.5)


@pytest.mark.needs_clean_gpus(count=1)
@pytest.mark.parametrize("i", range(2))
def test_after(i):
    time.sleep(0.2)
'''.replace("CUDA_CHILD_SOURCE", repr(CUDA_CHILD))

VICTIM = '''
import os, time
from pathlib import Path
import pytest


@pytest.mark.needs_clean_gpus(count=1)
@pytest.mark.parametrize("i", range(3))
def test_victim(i):
    # The first one holds the GPU's lock until the other worker's CUDA child holds memory there.
    Path(os.environ["VICTIM_STARTED"]).write_text(os.environ["PYTEST_XDIST_WORKER"])
    pidfile, deadline = Path(os.environ["LEAK_PIDFILE"]), time.monotonic() + 180
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
'''


def test_xdist_sibling_cuda_child_is_not_a_victims_finding(pytester: pytest.Pytester, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    for name in ("PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    pidfile = tmp_path / "holder.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))
    monkeypatch.setenv("VICTIM_STARTED", str(tmp_path / "victim_started"))
    pytester.makepyfile(test_a=LEAKER, test_b=VICTIM)
    report = tmp_path / "report.json"
    started = time.monotonic()
    # 20 s: a victim that waits for the sibling's child (the bug) fails in 20 s, not the default 60.
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", "-rA", "-n", "2",
                                           "--dist", "loadfile", "--gpuclean-timeout=20",
                                           f"--gpuclean-report={report}", timeout=600)
    wall = time.monotonic() - started
    out = result.stdout.str()
    print(out)
    holder = int(pidfile.read_text().split()[0])
    document = json.loads(report.read_text())
    tests = {t["nodeid"]: t for t in document["tests"]}
    victims = {n: t for n, t in tests.items() if n.startswith("test_b.py::")}
    dirty = sum(t["outcome"] != "clean" for t in victims.values())
    print(f"FIGURES: wall {wall:.1f}s, victims not clean {dirty}/{len(victims)}, "
          f"summary {document['summary']}")
    for nodeid, t in tests.items():
        waited = [f"{c['phase']} {c['waited_s']:.2f}s" for c in (t["before"], t["after"]) if c]
        print(f"FIGURES: {nodeid}: {t['outcome']}, checks {', '.join(waited) or '-'}, "
              f"gpu_without_lock {[u['lock_held_by'] for u in t.get('gpu_without_lock', [])]}")
    print(json.dumps(tests.get("test_a.py::test_unmarked_leak"), indent=1))
    result.assert_outcomes(passed=6)
    assert len(victims) == 3 and all(t["outcome"] == "clean" for t in victims.values()), victims
    notes = [n for t in victims.values() for c in (t["before"], t["after"]) for n in c["notes"]]
    assert any(n.startswith(f"pid {holder}: in use by gw") and "'s test test_a.py::test_unmarked_leak (GPU 0 "
               in n for n in notes), notes
    leaker = tests["test_a.py::test_unmarked_leak"]
    assert leaker["outcome"] == "leaked" and [p["pid"] for p in leaker["leaked"]] == [holder]
    (use,) = leaker["gpu_without_lock"]
    assert use["process"]["pid"] == holder and use["lock_held_by"]["nodeid"].startswith("test_b.py::")
    assert use["worker"] != use["lock_held_by"]["worker"]
    # Reaped by its own worker (at test_after's setup, or its final sweep), never by a victim.
    reapers = [n for n, t in tests.items() for c in (t["before"], t["after"]) if c for r in c["reaped"]
               if r["process"]["pid"] == holder]
    assert all(n.startswith("test_a.py::") for n in reapers), reapers
    assert document["summary"]["not_clean"] == 0 and document["summary"]["gpu_without_lock"] == 1
    assert not alive(holder)
    assert used_mib() < 100
