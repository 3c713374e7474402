"""--gpuclean-ray on a real GPU (one H200): a one-node Ray cluster that owns the GPU; a test leaks a named
Ray actor holding CUDA memory (reaped through ``ray.kill``), another an anonymous one (reaped by the signal
ladder on the node); each is found on its node, attributed to its test, the GPU is back to what it was, the
release time is reported per node, and the next test is clean. Run by tests/gpu/ray_gpu.sh
(benchmarks/GPU-RUNS.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuclean._model.records import MIB
from pytest_gpuclean._reading.nvml import NvmlBackend

INNER = '''
import os
import pytest
import ray

KEEP = []

@ray.remote(num_gpus=1, num_cpus=0)
class CudaHolder:
    def hold(self, mib):
        import torch
        self.block = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        return os.getpid()

def setup_module():
    ray.init(address=os.environ["RAY_TEST_ADDRESS"], log_to_driver=False)

def teardown_module():
    ray.shutdown()

@pytest.mark.needs_clean_gpus
def test_a_named_actor_in_a_global():
    KEEP.append(CudaHolder.options(name="cuda-leak", namespace="gpuclean-gpu").remote())
    print("LEAKED_PID", ray.get(KEEP[-1].hold.remote(2048)))

@pytest.mark.needs_clean_gpus
def test_b_anonymous_actor_in_a_global():
    KEEP.append(CudaHolder.remote())
    print("LEAKED_PID", ray.get(KEEP[-1].hold.remote(1024)))

@pytest.mark.needs_clean_gpus
def test_c_clean():
    pass
'''


def _used_mib(backend: NvmlBackend) -> list[float]:
    return [backend.snapshot(d).used_bytes / MIB for d in backend.devices()]


def _inner_session(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, address: str,
                   source: str, grace: int, timeout: int) -> tuple[pytest.RunResult, dict[str, Any],
                                                                  list[float], list[float]]:
    """Run ``source`` as an inner session checked across the cluster on the real GPU; return its result, its
    JSON report's tests by name, and the GPU's used MiB before and after it."""
    monkeypatch.delenv("GPUCLEAN_SIMULATE", raising=False)
    monkeypatch.setenv("GPUCLEAN_LOCK_DIR", str(tmp_path / "locks"))
    backend = NvmlBackend()
    try:
        before = _used_mib(backend)
        pytester.makepyfile(test_inner=source)
        report_path = tmp_path / "report.json"
        try:
            # faulthandler: an inner session that hangs prints every thread's stack before the timeout
            # kills it (run 19 lost a hung session's output with the timeout).
            result = pytester.runpytest_subprocess(
                "-p", "gpuclean", f"--gpuclean-ray={address}", f"--gpuclean-grace={grace}",
                "--gpuclean-timeout=120", "-p", "no:cacheprovider", "-s", "-rA",
                "-o", f"faulthandler_timeout={max(30, timeout - 60)}",
                f"--gpuclean-report={report_path}", timeout=timeout)
        except pytester.TimeoutExpired:
            for name in ("stdout", "stderr"):
                text = (pytester.path / name).read_text(errors="replace")
                print(f"---- the inner session's {name}, cut off by the timeout ----\n{text[-30000:]}")
            raise
        after = _used_mib(backend)
    finally:
        backend.close()
    print(result.stdout.str())
    document = json.loads(report_path.read_text())
    return result, {t["nodeid"].split("::")[-1]: t for t in document["tests"]}, before, after


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[dict[str, Any]]:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # vLLM's processes take their IP from VLLM_HOST_IP, else from the route out (192.0.2.2 on the H200),
    # and vLLM requires each node's workers to agree with Ray's node IP (127.0.0.1 here): the raylets
    # started below pass this to every worker (H200 run 21: "Every node should have a unique IP address").
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    pytest.importorskip("ray", reason="Ray is not installed: tests/gpu/ray_gpu.sh installs it offline")
    from ray.cluster_utils import Cluster

    # Two nodes on one host, as the issue asks: the head owns the GPU, the second node has none (it must
    # neither check nor blame the head's GPU: node.node_devices). Drivers on this host attach to the
    # head (Ray prefers it among the host's raylets), where vLLM wants its first GPU bundle.
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, num_gpus=1, include_dashboard=False, node_ip_address="127.0.0.1"))
    cpu_node = cluster.add_node(num_cpus=2, num_gpus=0, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    try:
        yield {"address": cluster.address, "node": cluster.head_node.node_id, "cpu_node": cpu_node.node_id}
    finally:
        cluster.shutdown()


def test_cuda_actors_leaked_on_the_ray_node_are_found_attributed_and_reaped(
        pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        gpu_cluster: dict[str, Any]) -> None:
    monkeypatch.setenv("RAY_TEST_ADDRESS", gpu_cluster["address"])
    result, tests, before, after = _inner_session(pytester, tmp_path, monkeypatch, gpu_cluster["address"],
                                                  INNER, grace=5, timeout=600)
    out = result.stdout.str()
    node = gpu_cluster["node"]
    for name in tests:
        after_check = tests[name]["cluster_after"]
        print(f"FIGURES {name}: outcome {tests[name]['outcome']}, reaped "
              + json.dumps([{k: r[k] for k in ("node_id", "via", "ended_by", "exit_s", "release_s")}
                            | {"pid": r["process"]["pid"], "mib": r["mib_per_device"]}
                            for r in after_check["reaped"]])
              + f", releases {json.dumps(after_check['releases'])}, check {after_check['waited_s']:.3f}s")
    print(f"FIGURES GPU used MiB before the inner session {before}, after it {after}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors") == 2 and outcomes.get("passed") == 3, out
    named = tests["test_a_named_actor_in_a_global"]["cluster_after"]["reaped"]
    anonymous = tests["test_b_anonymous_actor_in_a_global"]["cluster_after"]["reaped"]
    assert [(r["node_id"], r["via"]) for r in named] == [(node, "ray.kill")]
    assert [(r["node_id"], r["via"]) for r in anonymous] == [(node, "ladder")]
    for reaped in (named, anonymous):
        assert reaped[0]["mib_per_device"] and reaped[0]["mib_per_device"][0]["mib"] >= 1024
        assert reaped[0]["release_s"] is not None
    assert tests["test_c_clean"]["outcome"] == "clean"
    # The GPU is back to what it held before (within what a CUDA context costs: none is left).
    assert all(a <= b + 64 for a, b in zip(after, before, strict=True)), (before, after)


ENGINE_INNER = """
import os
import pytest

ENGINES = []

@pytest.mark.needs_clean_gpus
def test_a_engine_on_ray_kept_in_a_global():
    from vllm import LLM, SamplingParams
    llm = LLM(model=os.environ["TINY_MODEL"], distributed_executor_backend="ray", tensor_parallel_size=1,
              enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=256)
    print("GENERATED", llm.generate(["the cat sat"], SamplingParams(max_tokens=4))[0].outputs[0].token_ids)
    ENGINES.append(llm)

@pytest.mark.needs_clean_gpus
def test_b_clean():
    pass
"""


def test_vllm_engine_on_ray_kept_alive_is_found_on_its_node_and_reaped(
        pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        gpu_cluster: dict[str, Any]) -> None:
    """vLLM at TP=1 with ``distributed_executor_backend="ray"``: its engine process (a child of the test)
    connects to the cluster as a driver of its own and places its GPU worker, a Ray actor, on the GPU node.
    Kept alive in a global, the worker is found through that job, reaped on its node, the engine process on
    this host; the GPU is back where it was and the next test is clean."""
    pytest.importorskip("vllm", reason="CUDA vLLM is not installed: example_suite/install_gpu_offline.sh")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from example_suite.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny")
    monkeypatch.setenv("TINY_MODEL", str(model))
    monkeypatch.setenv("RAY_ADDRESS", gpu_cluster["address"])  # vLLM's engine process connects here
    # vLLM asks for its first bundle on the resource "node:<its IP>", its IP taken from the route to the
    # internet unless VLLM_HOST_IP says otherwise: the cluster's nodes are 127.0.0.1, so without this the
    # placement group can never be placed and vLLM waits 1800 s for it (a likely cause of run 19's hang).
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    timeout = int(os.environ.get("RAY_GPU_ENGINE_TIMEOUT", "540"))
    result, tests, before, after = _inner_session(pytester, tmp_path, monkeypatch, gpu_cluster["address"],
                                                  ENGINE_INNER, grace=10, timeout=timeout)
    out = result.stdout.str()
    engine = tests["test_a_engine_on_ray_kept_in_a_global"]
    ray_reaped = engine["cluster_after"]["reaped"]
    print("FIGURES vLLM on Ray: cluster reaped " + json.dumps(
        [{k: r[k] for k in ("node_id", "via", "ended_by", "exit_s", "release_s")}
         | {"pid": r["process"]["pid"], "cmd": r["process"]["cmdline"][:60], "mib": r["mib_per_device"]}
         for r in ray_reaped]) + f", releases {json.dumps(engine['cluster_after']['releases'])}, "
          f"leaked {json.dumps([(e['pid'], (e['cmdline'] or '')[:60]) for e in engine['leaked']])}")
    print(f"FIGURES vLLM on Ray: GPU used MiB before {before}, after {after}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors") == 1 and outcomes.get("passed") == 2, out
    assert "GENERATED" in out
    # The GPU worker (and vLLM's compiled-graph driver proxy actor, H200 run 21): found on the GPU node,
    # through the engine process's job, attributed to the test; the worker held the GPU memory.
    assert ray_reaped and {r["node_id"] for r in ray_reaped} == {gpu_cluster["node"]}, ray_reaped
    assert all(r["owner"] == {"kind": "test", "name": "test_inner.py::test_a_engine_on_ray_kept_in_a_global"}
               for r in ray_reaped), ray_reaped
    holders = [r for r in ray_reaped if r["mib_per_device"]]
    assert holders and all(r["release_s"] is not None for r in holders), ray_reaped
    # The CPU node checks no GPU.
    for node in engine["cluster_after"]["nodes"]:
        if node["node_id"] == gpu_cluster["cpu_node"]:
            assert node["devices"] == [], node
    assert tests["test_b_clean"]["outcome"] == "clean"
    assert all(a <= b + 64 for a, b in zip(after, before, strict=True)), (before, after)
