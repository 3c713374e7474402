"""Which of a host's GPUs a Ray node checks (node.node_devices): several raylets can share one host, and
NVML shows each of them every GPU; a GPU must be checked by the node that owns it only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import exec_done

from pytest_gpuclean._model.records import DeviceInfo
from pytest_gpuclean.ray.node import node_devices

GPUS = tuple(DeviceInfo(i, f"GPU-{i}{i}{i}{i}aaaa-0000", "H200") for i in range(4))


@pytest.fixture
def raylet() -> Iterator[dict[str, int]]:
    """Real processes standing in for raylets, each started with the environment a test gives it."""
    started: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> int:
        clean = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        # (what /proc shows of its environment, once the exec has set it: that is what is read)
        proc = exec_done(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                          env={**clean, **env}))
        started.append(proc)
        return proc.pid

    yield {"without": start(), "gpu2": start(CUDA_VISIBLE_DEVICES="2"),
           "by_uuid": start(CUDA_VISIBLE_DEVICES="GPU-3333,GPU-1111"), "none": start(CUDA_VISIBLE_DEVICES="")}
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_node_owns_what_its_raylet_may_see(raylet: dict[str, int]) -> None:
    assert node_devices(GPUS, raylet["gpu2"], 1.0) == (GPUS[2],)
    assert node_devices(GPUS, raylet["by_uuid"], 2.0) == (GPUS[3], GPUS[1])
    # An empty list hides every GPU from the raylet's tasks: the node owns none.
    assert node_devices(GPUS, raylet["none"], 0.0) == ()


def test_without_the_variable_the_gpu_resource_counts_from_the_first_device(raylet: dict[str, int]) -> None:
    assert node_devices(GPUS, raylet["without"], 2.0) == GPUS[:2]
    # The CPU-only node of a one-host test cluster: it must not check (and blame) the GPU node's GPU.
    assert node_devices(GPUS, raylet["without"], 0.0) == ()


def test_unknown_resources_or_raylet_check_every_device(raylet: dict[str, int]) -> None:
    assert node_devices(GPUS, raylet["without"], None) == GPUS
    assert node_devices(GPUS, 0, None) == GPUS
