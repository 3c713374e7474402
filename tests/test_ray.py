"""--gpuclean-ray: the check across a Ray cluster, on a local 3-node cluster (ray.cluster_utils) whose
nodes each have their own simulated devices. Skipped without Ray; install it with
``pip install ray==2.60.0`` and run ``python -m pytest tests/test_ray.py``."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # Loopback-only nodes: without this the driver rewrites 127.0.0.1 to the host's address and hangs.
    # Read when Ray is imported, so set first; the inner session's driver inherits it.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    from ray.cluster_utils import Cluster
    root = tmp_path_factory.mktemp("nodes")
    dirs = {}
    for name in ("head", "b", "c"):
        (root / name / "0").mkdir(parents=True)
        dirs[name] = root / name
    common = dict(num_cpus=1, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        include_dashboard=False, env_vars={"GPUCLEAN_SIMULATE": str(dirs["head"])}, **common))
    nodes = {name: cluster.add_node(env_vars={"GPUCLEAN_SIMULATE": str(dirs[name])}, **common)
             for name in ("b", "c")}
    cluster.wait_for_nodes()
    # This process is another job: its actor must survive every check of the inner session.
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield {"address": cluster.address, "dirs": dirs, "node_b": nodes["b"].node_id,
               "node_head": cluster.head_node.node_id,
               "node_c": nodes["c"].node_id, "ray": ray, "cluster": cluster}
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_leaks_across_nodes_are_found_attributed_and_reaped(
        pytester: pytest.Pytester, sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        ray_cluster: dict[str, Any]) -> None:
    ray = ray_cluster["ray"]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Bystander:
        def pid(self) -> int:
            return os.getpid()

    bystander = Bystander.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_cluster["node_b"], soft=False)).remote()
    bystander_pid = ray.get(bystander.pid.remote())
    pidfile = tmp_path / "leak.pids"
    monkeypatch.setenv("LEAK_PIDFILE", str(pidfile))
    monkeypatch.setenv("RAY_TEST_ADDRESS", ray_cluster["address"])
    monkeypatch.setenv("NODE_B", ray_cluster["node_b"])
    monkeypatch.setenv("NODE_C", ray_cluster["node_c"])
    monkeypatch.setenv("NODE_HEAD", ray_cluster["node_head"])
    # Each file defines its own actor class that "holds" simulated GPU memory on its node (Holder in
    # test_inner.py, SetupHolder in conftest.py, Worker in ray_engine.py): the report names them.
    pytester.copy_example("ray/cluster")
    report_path = tmp_path / "report.json"
    result = pytester.runpytest_subprocess("-p", "gpuclean", f"--gpuclean-ray={ray_cluster['address']}",
                                           "--gpuclean-grace=2", "--gpuclean-timeout=60", "-p",
                                           "no:cacheprovider", f"--gpuclean-report={report_path}",
                                           timeout=300)
    out = result.stdout.str()
    b, c = ray_cluster["node_b"][:8], ray_cluster["node_c"][:8]
    # Each leak fails the test that made it, on its node, and is reaped; the next test is clean.
    assert result.parseoutcomes().get("errors") == 5, out
    result.stdout.re_match_lines([
        r".*ERROR at teardown of test_b_handle_in_global.*",
        rf".*\[node {b}, actor Holder .*",
        r".*ERROR at teardown of test_b2_actor_on_the_drivers_node.*",
        rf".*\[node {ray_cluster['node_head'][:8]}, actor Holder .*ray::Holder.*",
        r".*ERROR at teardown of test_c_detached.*",
        rf".*\[node {c}, actor Holder .*",
        r".*ERROR at teardown of test_d_subprocess_on_other_node.*",
        rf".*\[node {c}, job .*pytest_gpuclean.simulate hold.*",
        r".*ERROR at teardown of test_d2_engine_process_drives_its_own_job.*",
        rf".*\[node {b}, actor Worker .*",
    ])
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 9, out  # a, e (fixture actor alive), f (clean after the reaping), z
    # The terminal summary names each node, how each thing ended, and the node's release time.
    result.stdout.re_match_lines([
        rf"test_inner.py::test_b_handle_in_global: .*Ray teardown on node {b}: reaped pid \d+ SIG\w+, "
        r"devices released in \d+\.\d\ds",
        rf"test_inner.py::test_c_detached: .*Ray teardown on node {c}: reaped pid \d+ by ray.kill, "
        r"devices released in \d+\.\d\ds",
        rf"test_inner.py::test_d_subprocess_on_other_node: .*Ray teardown on node {c}: reaped pid \d+ SIG\w+",
        r"test_inner.py::test_z_unchecked_leak_found_at_session_end: leaked 1 process\(es\) found by a later "
        r"check \(pid \d+ exited by itself\)",
    ])
    # The very last sweep (after pytest_unconfigure) ended the session set-up's detached actor.
    result.stderr.re_match_lines([r"gpuclean: the Ray cluster at the very end: reaped pid \d+ by ray.kill "
                                  rf"\(\[node {c}, actor SetupHolder .*"])
    _check_report(report_path, ray_cluster)
    # Nothing of the inner job holds simulated memory any more, on any node. The shared fixture's actor
    # was killed by its own finalizer, with ray.kill, which only asks the actor's node to end it: on a busy
    # box (CI, four stages at once) the session may end first, so its memory is given a while to go (a
    # process that stayed would hold it for ever).
    from pytest_gpuclean._reading.simulated import SimulatedBackend
    for node_dir in ray_cluster["dirs"].values():
        backend = SimulatedBackend(node_dir)
        deadline = time.monotonic() + 30
        while (used := [r.used_bytes for r in backend.readings(backend.devices())]) != [0] and (
                time.monotonic() < deadline):
            time.sleep(0.1)
        assert used == [0], node_dir
    # Another job's actor was never touched.
    assert ray.get(bystander.pid.remote()) == bystander_pid
    ray.kill(bystander)


def _check_report(path: Path, ray_cluster: dict[str, Any]) -> None:
    import json

    import jsonschema

    from pytest_gpuclean.report.jsonreport import load_schema

    document = json.loads(path.read_text())
    jsonschema.validate(document, load_schema())
    tests = {t["nodeid"].split("::")[-1]: t for t in document["tests"]}
    node_b, node_c = ray_cluster["node_b"], ray_cluster["node_c"]

    def leaked(name: str) -> list[tuple[str, str | None]]:
        return [(e.get("node_id"), e.get("via")) for e in tests[name]["leaked"]]

    assert leaked("test_b_handle_in_global") == [(node_b, "ladder")]  # anonymous: no ray.kill from our job
    assert leaked("test_c_detached") == [(node_c, "ray.kill")]
    assert leaked("test_d_subprocess_on_other_node") == [(node_c, "ladder")]
    head = ray_cluster["node_head"]
    assert leaked("test_b2_actor_on_the_drivers_node") == [(head, "ladder")]
    (on_head,) = tests["test_b2_actor_on_the_drivers_node"]["cluster_after"]["reaped"]
    assert "Holder" in on_head["process"]["cmdline"] and on_head["mib_per_device"], on_head
    # The engine-like child: its worker on node B through Ray's records, the child itself on this host.
    assert (node_b, "ladder") in leaked("test_d2_engine_process_drives_its_own_job")
    assert tests["test_a_fixture_actor_is_protected"]["outcome"] == "clean"
    assert tests["test_f_clean"]["outcome"] == "clean"
    for name, node in (("test_b_handle_in_global", node_b), ("test_c_detached", node_c)):
        after = tests[name]["cluster_after"]
        assert [r["node_id"] for r in after["reaped"]] == [node]
        assert after["reaped"][0]["owner"] == {"kind": "test", "name": f"test_inner.py::{name}"}
        (release,) = [r for r in after["releases"] if r["pids"]]
        assert release["node_id"] == node and release["release_s"] is not None
        # Every device of the check is named with its node.
        assert all(d["name"].startswith(f"node {n['node_id'][:8]}: ")
                   for n in after["nodes"] for d in n["devices"])
        assert {n["node_id"] for n in after["nodes"]} >= {node_b, node_c}
    assert tests["test_c_detached"]["cluster_after"]["reaped"][0]["actor_id"]
    # The unchecked test's detached actor: found by the session-end sweep, charged to it.
    ray = document["session"]["ray"]
    assert ray["address"] == ray_cluster["address"]
    (at_end,) = [c for c in ray["session_end"] if c["reaped"]]
    assert [(r["node_id"], r["via"], r["owner"]["name"]) for r in at_end["reaped"]] == [
        (node_b, "ray.kill", "test_inner.py::test_z_unchecked_leak_found_at_session_end")]
    assert tests["test_z_unchecked_leak_found_at_session_end"]["outcome"] == "leaked"
    assert document["summary"]["leaked"] == 6  # b, b2, c, d, d2 and z


def test_unreachable_cluster_is_a_usage_error(pytester: pytest.Pytester, sim: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    # A checked test: a session that checks nothing never starts (nor contacts the cluster).
    pytester.copy_example("test_marked.py")
    result = pytester.runpytest_subprocess("-p", "gpuclean", "--gpuclean-ray=127.0.0.1:9",
                                           "--gpuclean-timeout=30", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.re_match_lines([r".*--gpuclean-ray: cannot use the Ray cluster at 127.0.0.1:9: .*"
                                  r"\(from the command line\)"])


def test_off_never_imports_ray(pytester: pytest.Pytester, sim: Path) -> None:
    pytester.copy_example("ray/no_ray_off")
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_bad_address_names_the_option(pytester: pytest.Pytester, sim: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCLEAN_RAY", "nowhere")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("-p", "gpuclean")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpuclean-ray: 'nowhere' is not host:port, auto or off "
                                 "(from environment variable GPUCLEAN_RAY)*"])


# ---- gpuclean status|check|reap --ray ----------------------------------------------------------------

def _gpuclean(*args: str, timeout: float = 120) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_status_check_reap_across_the_cluster(tmp_path: Path, ray_cluster: dict[str, Any]) -> None:
    import json
    import subprocess
    import sys

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray = ray_cluster["ray"]
    address, node_b, node_c = ray_cluster["address"], ray_cluster["node_b"], ray_cluster["node_c"]
    b, c = node_b[:8], node_c[:8]
    clean = _gpuclean("check", "--ray", address)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "clean" in clean.stdout and f"Ray cluster at {address}" in clean.stdout

    # A job that ends and leaves on B a named detached actor, on C an anonymous one and an escaped process.
    from helpers import EXAMPLES

    leaker = EXAMPLES / "scripts" / "ray_leaker.py"
    done = subprocess.run([sys.executable, str(leaker), address, node_b, node_c, str(tmp_path / "esc.pid")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    named_pid, anonymous_pid, escaped_pid = map(int, done.stdout.split())

    # A running job's actor on a GPU (this process's job): never ended by reap.
    @ray.remote(num_cpus=0)
    class Busy:
        def hold(self) -> int:
            from pytest_gpuclean.simulate import allocate

            allocate(os.environ["GPUCLEAN_SIMULATE"], 0, 5)
            return os.getpid()

    busy = Busy.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_b, soft=False)).remote()
    busy_pid = ray.get(busy.hold.remote())

    status = _gpuclean("status", "--ray", address)
    assert status.returncode == 0, status.stderr
    for node in (node_b, node_c):
        assert f"node {node}: 1 device(s)" in status.stdout
    for pid in (named_pid, anonymous_pid, escaped_pid, busy_pid):
        assert f" {pid} " in status.stdout, status.stdout
    document = json.loads(_gpuclean("status", "--ray", address, "--json").stdout)
    on_devices = {(n["node_id"], p["pid"]) for n in document["nodes"] for d in n["devices"]
                  for p in d["processes"]}
    assert on_devices == {(node_b, named_pid), (node_c, anonymous_pid), (node_c, escaped_pid),
                          (node_b, busy_pid)}
    assert all(d["name"].startswith(f"node {n['node_id'][:8]}: ") for n in document["nodes"]
               for d in n["devices"])

    dirty = _gpuclean("check", "--ray", address, "--json")
    assert dirty.returncode == 1
    verdict = json.loads(dirty.stdout)
    assert not verdict["clean"]
    assert {(o["node_id"], o["process"]["pid"]) for o in verdict["offenders"]} == on_devices
    text = _gpuclean("check", "--ray", address)
    assert text.returncode == 1 and "NOT clean" in text.stdout and f"[node {b}]" in text.stdout

    dry = _gpuclean("reap", "--ray", address, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"node {b}: pid {named_pid} " in dry.stdout and "by ray.kill" in dry.stdout
    assert f"node {c}: pid {anonymous_pid} " in dry.stdout
    assert f"pid {busy_pid} " in dry.stdout and "is still running" in dry.stdout
    for pid in (named_pid, anonymous_pid, escaped_pid):
        assert os.path.exists(f"/proc/{pid}")  # --dry-run ended nothing

    reaped = _gpuclean("reap", "--ray", address, "--grace", "2")
    assert reaped.returncode == 0, reaped.stdout + reaped.stderr
    out = reaped.stdout
    assert f"left alone: node {b}: pid {busy_pid} " in out
    assert f"pid {named_pid}" in out and "[via ray.kill]" in out
    assert out.count("[via ladder]") == 2
    assert f"node {b}: its devices released the memory" in out and f"node {c}: its devices released" in out
    # Gone, or exiting (a zombie, or the kernel's X while it is being reaped: seen on a loaded box).
    from helpers import wait_dead

    assert wait_dead([named_pid, anonymous_pid, escaped_pid]) == []
    # The running job's actor and Ray itself are untouched.
    assert ray.get(busy.hold.remote()) == busy_pid
    still = json.loads(_gpuclean("check", "--ray", address, "--json").stdout)
    assert [o["process"]["pid"] for o in still["offenders"]] == [busy_pid]
    ray.kill(busy)
    after = _gpuclean("check", "--ray", address, "--wait", "10")
    assert after.returncode == 0, after.stdout


def test_cli_unreachable_cluster_is_a_usage_error_within_the_timeout() -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    # 127.0.0.1:9: nothing listens. Ray alone would retry for about 14 minutes.
    result = _gpuclean("check", "--ray", "127.0.0.1:9", "--timeout", "2", timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("gpuclean check: error: --ray: the Ray cluster at 127.0.0.1:9 did not "
                                    "answer (connect) within 2s (from the command line)"), result.stderr


def test_cli_without_ray_installed_is_a_usage_error() -> None:
    try:
        import ray  # noqa: F401
        pytest.skip("Ray is installed here; this checks the venv without it")
    except ImportError:
        pass
    result = _gpuclean("status", "--ray", "127.0.0.1:6379", timeout=60)
    assert result.returncode == 2
    assert "gpuclean status: error: --ray: cannot use the Ray cluster at 127.0.0.1:6379: Ray is not " \
           "installed for " in result.stderr, result.stderr


def test_cli_other_ray_version_is_a_usage_error(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    import json

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, node_ip_address="127.0.0.1"))
    address = cluster.address
    try:
        # What a cluster started by another Ray version records in its control store (Ray's own check
        # compares it with the driver's version when a driver connects).
        from ray._private import ray_constants
        from ray._raylet import GcsClient

        gcs = GcsClient(address=cluster.address)
        key = b"CLUSTER_METADATA"
        meta = json.loads(gcs.internal_kv_get(key, namespace=ray_constants.KV_NAMESPACE_CLUSTER))
        meta["ray_version"] = "2.59.0"
        gcs.internal_kv_put(key, json.dumps(meta).encode(), True,
                            namespace=ray_constants.KV_NAMESPACE_CLUSTER)
        result = _gpuclean("check", "--ray", address, "--timeout", "60", timeout=120)
    finally:
        cluster.shutdown()
    assert result.returncode == 2
    assert f"gpuclean check: error: --ray: cannot use the Ray cluster at {address}: RuntimeError: Version " \
           "mismatch" in result.stderr, result.stderr
    assert "2.59.0" in result.stderr


def test_cli_off_never_imports_ray(sim: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from pytest_gpuclean import _cli; assert _cli.main(['check', '--ray', 'off']) == 0; "
            "assert 'ray' not in sys.modules and 'pytest_gpuclean.ray.cluster' not in sys.modules, "
            "'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _node_processes(cluster: Any) -> list[Any]:
    """The head node's processes with their children: the agents a raylet starts (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``) carry neither a session path nor a Ray variable to find them by later."""
    import time

    import psutil

    raylet = psutil.Process(cluster.head_node.all_processes["raylet"][0].process.pid)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len([c for c in raylet.children() if "Agent" in c.name()]) < 2:
        time.sleep(0.1)
    procs = [psutil.Process(info.process.pid) for infos in cluster.head_node.all_processes.values()
             for info in infos]
    return procs + raylet.children(recursive=True)


def _end_stragglers(procs: list[Any]) -> None:
    """End what is left of a cluster whose GCS was killed: its agents outlive it for minutes, and in CI the
    next gpuclean session on the box reaped them as this session's debris (.ci/test, stage ray).
    ``psutil.Process`` remembers each one's start time, so a reused pid is never signalled."""
    import psutil

    _gone, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)


def test_a_cluster_that_goes_away_is_a_finding_not_a_stall(pytester: pytest.Pytester, sim: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The GCS dies under the session (a cluster shut down by someone else): the check after the test and
    # the session-end sweeps say so within seconds, instead of waiting out Ray's one-minute reconnect
    # for every request (that took 3 x (timeout + 1) s before the agent's reconnect timeout was set).
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, node_ip_address="127.0.0.1"))
    address = cluster.address
    node_processes = _node_processes(cluster)
    try:
        gcs = cluster.head_node.all_processes["gcs_server"][0].process.pid
        monkeypatch.setenv("GCS_PID", str(gcs))
        pytester.copy_example("ray/gcs_dies")  # its test kills the GCS ($GCS_PID)
        result = pytester.runpytest_subprocess("-p", "gpuclean", f"--gpuclean-ray={address}",
                                               "--gpuclean-timeout=60", "-p", "no:cacheprovider", timeout=150)
    finally:
        cluster.shutdown()
        _end_stragglers(node_processes)
    out = result.stdout.str()
    assert result.parseoutcomes().get("errors") == 1, out
    result.stdout.re_match_lines([r".*gpuclean: the Ray cluster is not clean after the test.*",
                                  rf".*lost the Ray cluster at {address} \(census\): gpuclean's agent for it "
                                  r"exited: the cluster shut down, or its GCS stopped answering.*"])
    result.stderr.re_match_lines([rf"gpuclean: the Ray cluster at the very end: .*{address}.*"])


# ---- --gpuclean-ray=auto: a cluster the session's own fixtures start ------------------------------------

def test_auto_finds_the_clusters_the_session_starts(pytester: pytest.Pytester, sim: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # --gpuclean-ray=auto without RAY_ADDRESS: a cluster a module fixture starts during a test's set-up is
    # found at the check after that test (whose leaked actor is blamed on it), goes away with its fixture
    # (no finding), and a second one, started later by a session fixture, is found the same way; each
    # fixture's own actor and another job's actor live on; the session ends without a finding or a stall.
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    import subprocess
    import sys

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback-only nodes
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    monkeypatch.setenv("NODE_DIRS", str(nodes))
    pytester.copy_example("ray/auto")  # conftest.py (the clusters' fixtures), test_1.py, test_2.py
    (nodes / "second").mkdir()
    bystander = subprocess.Popen([sys.executable, pytester.copy_example("scripts/ray_bystander.py"),
                                  str(nodes / "second" / "address"), str(nodes / "second" / "bystander")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result = pytester.runpytest_subprocess("-p", "gpuclean", "--gpuclean-ray=auto", "--gpuclean-grace=2",
                                               "--gpuclean-timeout=60", "-p", "no:cacheprovider", timeout=300)
    finally:
        bystander.kill()
        bystander.wait()
    out = result.stdout.str()
    first_b, second_b = ((nodes / name / "node_b").read_text()[:8] for name in ("first", "second"))
    first_at, second_at = ((nodes / name / "address").read_text() for name in ("first", "second"))
    # Two leaks, each on its cluster's node, blamed on the test that made it; every other test passes,
    # the fixtures' teardowns (their actors alive, the bystander alive) included.
    assert result.parseoutcomes() == {"passed": 4, "errors": 2}, out
    result.stdout.re_match_lines([
        r".*ERROR at teardown of test_a_leaks_while_the_cluster_appears.*",
        r".*leaked.* on the Ray cluster.*",
        rf".*\[node {first_b}, actor Holder .*",
        r".*ERROR at teardown of test_c_leaks_on_a_second_cluster.*",
        r".*leaked.* on the Ray cluster.*",
        rf".*\[node {second_b}, actor Holder .*",
    ])
    result.stdout.re_match_lines([
        rf"test_1.py::test_a_leaks_while_the_cluster_appears: .*Ray teardown on node {first_b}: "
        r"reaped pid \d+ SIG\w+",
        rf"test_2.py::test_c_leaks_on_a_second_cluster: .*Ray teardown on node {second_b}: reaped pid \d+ "
        r"by ray.kill",
    ])
    result.stdout.re_match_lines([
        rf".*checking the Ray cluster at {first_at} .* from the check after "
        r"test_1.py::test_a_leaks_while_the_cluster_appears on",
        rf".*the Ray cluster at {first_at} shut down .*watching for another",
        rf".*checking the Ray cluster at {second_at} .* from the check after "
        r"test_2.py::test_c_leaks_on_a_second_cluster on",
    ])
    assert "not clean" not in out and "lost the Ray cluster" not in out + result.stderr.str(), out


def test_auto_without_a_cluster_never_imports_ray(pytester: pytest.Pytester, sim: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # auto, no RAY_ADDRESS, no cluster started: the checks only look at the session's own processes.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    pytester.copy_example("ray/no_ray_auto")
    result = pytester.runpytest_subprocess("-p", "gpuclean", "--gpuclean-ray=auto", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_gcs_address_from_the_command_line(tmp_path: Path) -> None:
    # A GCS server started on a fixed port (`ray start --head --port=N`) names it on its command line; one
    # on port 0 publishes the port it bound in its session directory, once it listens.
    import subprocess
    import sys

    from helpers import exec_done

    from pytest_gpuclean.ray.hooks import GCS_SERVER, gcs_address
    fake = tmp_path / GCS_SERVER  # a Python named like Ray's GCS server
    fake.symlink_to(sys.executable)
    session = tmp_path / "session_x"
    session.mkdir()

    def started(*args: str) -> subprocess.Popen[bytes]:
        return exec_done(subprocess.Popen([str(fake), "-c", "import time; time.sleep(60)", *args]))

    fixed = started("--gcs_server_port=6390", "--node-ip-address=10.1.2.3")
    picked = started("--gcs_server_port=0", "--node-ip-address=127.0.0.1", f"--session-dir={session}",
                     "--node-id=abc123")
    try:
        assert gcs_address(fixed.pid) == "10.1.2.3:6390"
        assert gcs_address(picked.pid) is None  # not listening yet
        (session / "gcs_server_port_abc123").write_text("41234")
        assert gcs_address(picked.pid) == "127.0.0.1:41234"
    finally:
        for proc in (fixed, picked):
            proc.kill()
            proc.wait()
    assert gcs_address(fixed.pid) is None


def test_an_actor_started_in_a_windows_last_tick_is_its_owners() -> None:
    # Windows are read in clock ticks, truncated; the control store's start times in milliseconds. An
    # actor a fixture waits for before it returns (its start time comes a few ms before the first call
    # returns) often starts in the fixture's last tick, after its truncated end: still the fixture's.
    from pytest_gpuclean._model.records import Owner
    from pytest_gpuclean._ownership.evidence import Ownership, Window
    from pytest_gpuclean._reading import procfs
    from pytest_gpuclean.ray.cluster import ClusterChecker

    ownership = Ownership("gc.test")
    test = ownership.new_token(Owner("test", "t"))
    fixture = ownership.new_token(Owner("fixture", "f (module-scoped)"))
    now = procfs.boot_ticks_now()
    ownership.windows += [Window(test, None, now - 500), Window(fixture, None, now - 400, None, now - 100)]
    check = ClusterChecker("127.0.0.1:1", ownership)
    tick = 1 / procfs.CLOCK_TICKS
    end = procfs.ticks_to_wall(now - 100)
    assert check._token_at(end + 0.6 * tick) == fixture
    assert check._token_at(end + 2 * tick) == test
    assert check._token_at(procfs.ticks_to_wall(now - 450)) == test


def _census() -> Any:
    from pytest_gpuclean._model.records import DeviceInfo, DeviceSnapshot, GpuProcess, ProcessInfo
    from pytest_gpuclean.ray.messages import ActorRecord, Census, JobRecord, NodeProcess, NodeReport
    info = ProcessInfo(4242, 99, 1, 1000, "ci", "ray::Holder.hold", "sleeping")
    snap = DeviceSnapshot(DeviceInfo(0, "GPU-0000", "node 3f2a9c1b: H200"), 512, 1024,
                          (GpuProcess(4242, 512),))
    node = NodeReport("3f2a9c1b" * 7, 77, (snap,), (NodeProcess(info, "01000000", 1.5, True),))
    return Census((node, NodeReport("b" * 56, 0, (), (), "probe failed: boom")), (("a" * 56, "died"),),
                  (ActorRecord("a" * 32, "01000000", "3f2a9c1b" * 7, 4242, "ALIVE", 1.25, "holder", "ns",
                               True, "Holder"),), ("01000000",), 0.5, (JobRecord("01000000", 4241, False),))


# What the agent is sent (a request) and sends back (its answers), pickled: a child process reads each from a
# pipe and sends it back, as the agent's main loop does.
_ECHO = """
import sys
from multiprocessing.connection import Connection
inbox, outbox = Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
while True:
    try:
        outbox.send(inbox.recv())
    except EOFError:
        break
"""


def test_the_records_that_cross_the_ray_boundary_pickle() -> None:
    # Ray ships a node's answer (NodeReport, NodeEnd) with its cloudpickle; the agent's pipe pickles its
    # answers (Census, NodeEnd). The other way, the named actors to end (NamedActor) go over the pipe in a
    # request and to the node in the reaping task's arguments. Records with slots and no __dict__ must come
    # back whole, equal and usable.
    import pickle
    import subprocess
    from multiprocessing.connection import Connection

    from pytest_gpuclean.ray.messages import NamedActor, NodeEnd
    census = _census()
    end = NodeEnd(((4242, "ray.kill", "ray.kill", 0.01, ""), (4243, "ladder", "SIGTERM", None, "")), 0.41,
                  (4242,), ("an error",))
    actor = NamedActor("holder", "ns", "a" * 32, 4242, 99)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        node_process = census.nodes[0].processes[0]
        for record in (census, end, actor, *census.nodes, *census.actors, *census.jobs, node_process):
            back = pickle.loads(pickle.dumps(record, protocol))
            assert back == record and type(back) is type(record) and hash(back) == hash(record)
    back = pickle.loads(pickle.dumps(census))
    assert back._replace(took_s=1.0).took_s == 1.0 and back.nodes[0].devices[0].bytes_of({4242}) == 512
    assert pickle.loads(pickle.dumps(actor)).start_ticks == 99
    cloudpickles = [m for m in (_importable("ray.cloudpickle"), _importable("cloudpickle")) if m is not None]
    for cloudpickle in cloudpickles:
        assert cloudpickle.loads(cloudpickle.dumps(census)) == census
        assert cloudpickle.loads(cloudpickle.dumps(end)) == end
        assert cloudpickle.loads(cloudpickle.dumps([actor])) == [actor]
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", _ECHO, str(to_child_r), str(from_child_w)],
                             pass_fds=(to_child_r, from_child_w))
    os.close(to_child_r)
    os.close(from_child_w)
    outbox, inbox = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)
    try:
        request = ("end", ("3f2a9c1b" * 7, 77, [actor], [(4243, 98, "01000000")], 1.0, 1.0, 5.0))
        for message in (request, ("ok", census), ("ok", end)):
            outbox.send(message)
            assert inbox.poll(30) and inbox.recv() == message
    finally:
        outbox.close()
        assert child.wait(timeout=30) == 0
        inbox.close()


def _importable(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None



# ---- the plugin's own helper driver, its job and its workers are never a test's -------------------------

# On a node whose environment has it (PYTHONPATH): every Ray worker of a job starts a side process (a log
# shipper, a profiler) that carries the worker's RAY_JOB_ID, like whatever else a worker starts. So the
# workers Ray starts for the plugin's own helper driver (the probes) leave a visible process of that job.
def _side_node_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a node (no CPUs: Ray starts a worker there only when a task asks, during a check)
    whose workers start a side process; and the file their pids and jobs go to."""
    from helpers import copy_example

    site = tmp_path / "site"
    site.mkdir()
    copy_example("ray/site", site)  # sitecustomize.py
    pids = tmp_path / "side.pids"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "WORKER_SIDE_PIDS": str(pids)}
    return env, pids


def _end_side_processes(pids: Path) -> list[str]:
    """End the side processes (they outlive nothing of ours by design); the jobs they were of."""
    from helpers import kill_all, reap_orphans, wait_dead

    lines = [line.split() for line in pids.read_text().splitlines()] if pids.exists() else []
    started = [int(pid) for pid, _ in lines]
    kill_all(started)
    wait_dead(started)
    reap_orphans(started)
    return [job for _, job in lines]


def test_only_the_sessions_own_jobs_are_checked_on_a_cluster_started_outside(
        pytester: pytest.Pytester, sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        ray_cluster: dict[str, Any]) -> None:
    # Two drivers under pytest whose jobs are not the session's. The plugin's own helper driver: before,
    # the worker Ray started for its probe on a node during the first check (and what that worker started)
    # "was leaked by test_cluster.py::test_0_clean_first and reaped (SIGTERM) before" that very test. And
    # a driver that existed before pytest (`driver & exec pytest`): before, the actor it made while
    # test_0 ran was that test's leak, reaped.
    from helpers import alive, copy_example, kill_all, read_pids, reap_orphans

    env, side_pids = _side_node_env(tmp_path)
    (tmp_path / "side" / "0").mkdir(parents=True)
    cluster = ray_cluster["cluster"]
    node = cluster.add_node(num_cpus=0, node_ip_address="127.0.0.1",
                            env_vars={"GPUCLEAN_SIMULATE": str(tmp_path / "side"), **env})
    driver_pid, actor_pid = tmp_path / "driver.pid", tmp_path / "actor"
    driver_script = copy_example("scripts/ray_older_driver.py", tmp_path)
    monkeypatch.setenv("OLDER_GO", str(tmp_path / "go"))
    monkeypatch.setenv("OLDER_ACTOR", str(actor_pid))
    python, address = sys.executable, ray_cluster["address"]
    shell = (f"{python} {driver_script} {address} {ray_cluster['node_b']} {tmp_path / 'go'} {actor_pid} & "
             f"echo $! > {driver_pid}; exec {python} -m pytest -p gpuclean --gpuclean-ray={address} "
             "--gpuclean-timeout=60 -p no:cacheprovider -W always")
    driver: list[int] = []
    try:
        cluster.wait_for_nodes()
        pytester.copy_example("ray/outside")  # test_cluster.py
        result = pytester.run("sh", "-c", shell, timeout=300)
        driver = read_pids(driver_pid)
        out = result.stdout.str() + result.stderr.str()
        result.assert_outcomes(passed=2)
        assert "leaked" not in out and "reaped pid" not in out, out
        result.stdout.fnmatch_lines(["*2 checked test(s), 0 with findings, 0 process(es) reaped*"])
        # The older driver and its actor live on; the driver is named once, never signalled.
        assert alive(driver[0]) and alive(int(actor_pid.read_text()))
        assert "left alone 1 process(es) under pytest that are no part of the session" in out
    finally:
        kill_all(driver)
        reap_orphans(driver)
        cluster.remove_node(node)
        jobs = _end_side_processes(side_pids)
    assert jobs, "no worker started on the node: nothing was tested"


def test_the_plugins_own_job_is_never_a_tests_on_a_cluster_a_fixture_starts(
        pytester: pytest.Pytester, sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --gpuclean-ray=auto: the cluster appears during the first test's set-up; the helper driver starts at
    # the check after it, inside that test's window, and so does its probe's worker on node b. Before:
    # that test failed with the plugin's own process "leaked ... on the Ray cluster".
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray==2.60.0")
    env, side_pids = _side_node_env(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback-only nodes
    monkeypatch.setenv("NODE_DIRS", str(tmp_path / "nodes"))
    monkeypatch.setenv("SIDE_PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("WORKER_SIDE_PIDS", env["WORKER_SIDE_PIDS"])
    pytester.copy_example("ray/fixture_cluster")  # test_cluster.py
    try:
        result = pytester.runpytest_subprocess("-p", "gpuclean", "--gpuclean-ray=auto",
                                               "--gpuclean-timeout=60", "-p", "no:cacheprovider",
                                               "-W", "always", timeout=300)
    finally:
        jobs = _end_side_processes(side_pids)
    out = result.stdout.str() + result.stderr.str()
    assert jobs, "no worker started on node b: nothing was tested"
    result.assert_outcomes(passed=2)
    assert "checking the Ray cluster at" in out  # found, and checked from the first test's teardown on
    assert "leaked" not in out and "reaped pid" not in out, out
    # (The cluster's processes that exit after its fixture shut it down are the fixture's, collected.)
    result.stdout.fnmatch_lines(["*2 checked test(s), * 0 process(es) reaped*"])
