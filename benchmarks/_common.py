"""Shared helpers of the benchmark scripts: machine description, statistics, JSON output.

Benchmarks compare methods measured side by side in one run (interleaved rounds) and report ratios of
medians: this CPU box is noisy, so absolute times from it mean little; ratios from one run do.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_this_tree() -> str:
    """Make ``import pytest_gpuclean`` find the package of the tree this script runs from (``REPO``: this
    checkout, or a tree ``ab_trees.export`` made), not an editable install's: its finder on
    ``sys.meta_path`` would answer first, whatever ``sys.path`` says. Returns the package's path."""
    sys.path.insert(0, REPO)
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    import pytest_gpuclean

    where = os.path.dirname(os.path.abspath(pytest_gpuclean.__file__))
    if where != os.path.join(REPO, "pytest_gpuclean"):
        raise SystemExit(f"imported {where}, not this tree's pytest_gpuclean ({REPO})")
    return where


def machine() -> dict[str, Any]:
    """What ran the benchmark: host, CPU, Python, kernel, date; GPU fields are added by callers."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    with contextlib.suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "git_commit": git_commit(),
    }


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no",
                            "pytest_gpuclean"], capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("+dirty(pytest_gpuclean)" if dirty else "")


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median and spread of one method's per-round values."""
    ordered = sorted(values)
    n = len(ordered)

    def q(frac: float) -> float:
        return ordered[min(n - 1, max(0, round(frac * (n - 1))))]

    return {"median": statistics.median(ordered), "p10": q(0.1), "p25": q(0.25), "p75": q(0.75),
            "p90": q(0.9), "min": ordered[0], "max": ordered[-1], "n": n}


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    print(f"wrote {path}")


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    # (a row may have fewer cells than the header: the idle rows of bench_session.py)
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=False)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)) for r in rows]
    return "\n".join(lines)


VLLM_POLL_S = 5.0


def vllm_style_wait(read: Callable[[int], tuple[int, int]], devices: list[int], threshold_bytes: int,
                    out: Any, timeout_s: float = 120.0, poll_s: float = VLLM_POLL_S,
                    on_poll: Callable[[dict[int, tuple[float, float]]], None] | None = None) -> float:
    """Our equivalent of vLLM's ``tests/utils.py::wait_for_gpu_memory_to_clear(threshold_bytes=...)``.

    Reads used/total memory of every device (``read``: NVML v1 in vLLM), prints one line per poll,
    returns once every device uses <= ``threshold_bytes``, else sleeps ``poll_s`` (5 s in vLLM) and
    polls again; raises ``ValueError`` after ``timeout_s``. It never looks at processes.
    """
    start = time.time()
    while True:
        raw: dict[int, tuple[float, float]] = {}
        for device in devices:
            used, total = read(device)
            raw[device] = (used / 2**30, total / 2**30)
        if on_poll is not None:
            on_poll(raw)
        print("gpu memory used/total (GiB): "
              + "".join(f"{k}={u:.02f}/{t:.02f}; " for k, (u, t) in raw.items()), file=out)
        waited = time.time() - start
        if all(u <= threshold_bytes / 2**30 for u, _ in raw.values()):
            print(f"Done waiting for free GPU memory on devices {devices=} ({waited=:.02f})", file=out)
            return waited
        if waited >= timeout_s:
            raise ValueError(f"memory of devices {devices} not free after {waited:.02f} s")
        time.sleep(poll_s)
