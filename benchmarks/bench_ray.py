"""Cost of ``--gpuclean-ray`` per test, on a local Ray cluster of 1, 2 and 3 nodes (one host).

Two measurements per cluster size:

* ``pair``: one checked test costs a cluster check before and one after it. The benchmark drives
  ``cluster.ClusterChecker`` (the plugin's own object, its agent in a process of its own) exactly as the
  plugin does, ``--rounds`` times, on a clean cluster with simulated devices per node; the median of a
  before+after pair is the per-test cost.
* ``session``: an inner pytest session of ``--tests`` trivial checked tests, run with the option and
  without it, interleaved (``--sessions`` of each); (median on - median off) / tests is the per-test cost
  as a user sees it, the agent's start-up spread over the tests included.

Run with a Python that has Ray: ``.venv-ray/bin/python benchmarks/bench_ray.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, summary, table, write_json

# Loopback-only nodes need this in every driver: without it, ray.init("127.0.0.1:PORT") rewrites loopback
# to the host's address, where no GCS listens, and the driver retries with no error after 240 s (Ray 2.60.0
# on the 2-core CI box, 2026-12-01); read when Ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

INNER = """
import pytest

@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("i", range({tests}))
def test_clean(i):
    pass
"""


def start_cluster(nodes: int, root: Path) -> Any:
    from ray.cluster_utils import Cluster

    def node_args(name: str) -> dict[str, Any]:
        (root / name / "0").mkdir(parents=True)
        return dict(num_cpus=1, node_ip_address="127.0.0.1", env_vars={"GPUCLEAN_SIMULATE": str(root / name)})

    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node_args("n0")))
    for i in range(1, nodes):
        cluster.add_node(**node_args(f"n{i}"))
    cluster.wait_for_nodes()
    return cluster


def bench_pairs(address: str, rounds: int) -> dict[str, Any]:
    from pytest_gpuclean._ownership.evidence import Ownership
    from pytest_gpuclean.ray.cluster import ClusterChecker

    check = ClusterChecker(address, Ownership("bench"))
    began = time.monotonic()
    check.start(60)
    start_s = time.monotonic() - began
    try:
        first = time.monotonic()
        check.check_cluster("setup", tolerance_mib=0, timeout=60)
        first_s = time.monotonic() - first  # the first probe per node starts a worker there
        pairs = []
        for _ in range(rounds):
            t = time.monotonic()
            before = check.check_cluster("setup", tolerance_mib=0, timeout=60)
            after = check.check_cluster("teardown", tolerance_mib=0, timeout=60)
            pairs.append(time.monotonic() - t)
            assert before.clean and after.clean, (before, after)
    finally:
        check.stop()
    return {"agent_start_s": start_s, "first_check_s": first_s, "pair_s": summary(pairs)}


def bench_sessions(address: str, root: Path, tests: int, sessions: int) -> dict[str, Any]:
    workdir = root / "suite"
    workdir.mkdir()
    (workdir / "test_clean.py").write_text(INNER.format(tests=tests))
    env = dict(os.environ, GPUCLEAN_SIMULATE=str(root / "local"))
    (root / "local" / "0").mkdir(parents=True)
    base = [sys.executable, "-m", "pytest", "-q", "-p", "gpuclean", "-p", "no:cacheprovider", str(workdir)]
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(sessions):
        for mode in ("off", "on"):
            cmd = base + ([f"--gpuclean-ray={address}"] if mode == "on" else [])
            t = time.monotonic()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            times[mode].append(time.monotonic() - t)
            if done.returncode != 0:
                raise SystemExit(f"inner session failed ({mode}):\n{done.stdout}\n{done.stderr}")
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"tests": tests, "off_s": summary(times["off"]), "on_s": summary(times["on"]),
            "per_test_s": (on - off) / tests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,3", help="cluster sizes (comma-separated)")
    parser.add_argument("--rounds", type=int, default=50, help="before+after pairs per cluster size")
    parser.add_argument("--tests", type=int, default=40, help="tests per inner session")
    parser.add_argument("--sessions", type=int, default=3, help="inner sessions per mode and cluster size")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ray_cpu.json"))
    args = parser.parse_args()
    import ray

    results: dict[str, Any] = {"machine": machine(), "ray": ray.__version__, "rounds": args.rounds,
                               "tests": args.tests, "sizes": {}}
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="bench_ray.") as tmp:
            root = Path(tmp)
            cluster = start_cluster(nodes, root)
            try:
                pairs = bench_pairs(cluster.address, args.rounds)
                sessions = bench_sessions(cluster.address, root, args.tests, args.sessions)
            finally:
                cluster.shutdown()
        results["sizes"][str(nodes)] = {"pairs": pairs, "sessions": sessions}
        rows.append([str(nodes), f"{pairs['agent_start_s']:.2f} s", f"{pairs['first_check_s'] * 1000:.0f} ms",
                     f"{pairs['pair_s']['median'] * 1000:.1f} ms "
                     f"({pairs['pair_s']['min'] * 1000:.1f}-{pairs['pair_s']['max'] * 1000:.1f})",
                     f"{sessions['off_s']['median']:.2f} s", f"{sessions['on_s']['median']:.2f} s",
                     f"{sessions['per_test_s'] * 1000:.0f} ms"])
        print(rows[-1], flush=True)
    print(table(rows, ["nodes", "agent start", "first check", "per test (before+after), median (min-max)",
                       f"session off ({args.tests} tests)", "session on", "per test, session"]))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
