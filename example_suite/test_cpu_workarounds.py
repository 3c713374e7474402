"""CPU vLLM only: ``vllm serve`` needs the distribution-name shim (runtime.vllm_metadata_shim).

The other CPU workaround, the connector of example_suite/cpu_connector.py, is needed by every extraction on
CPU: without it the first request kills the engine ("pin_memory=True requires a CUDA or other accelerator
backend"), so every offline and server test here would fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from example_suite.runtime import VLLM_MISSING, VllmRuntime, vllm_metadata_shim

pytest.importorskip("vllm", reason=VLLM_MISSING)

pytestmark = pytest.mark.needs_clean_gpus


def vllm_version_command(tmp_path: Path, python_path: list[str]) -> subprocess.CompletedProcess[str]:
    # `vllm --version`: the same entry point as `vllm serve`, and the same importlib.metadata call.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path)}
    with (tmp_path / "out.log").open("w") as log:
        completed = subprocess.run(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=False,
        )  # fmt: skip
    return subprocess.CompletedProcess(
        completed.args, completed.returncode, (tmp_path / "out.log").read_text()
    )


def test_vllm_command_needs_the_distribution_shim_on_cpu(vllm_runtime: VllmRuntime, tmp_path: Path) -> None:
    if vllm_runtime.device != "cpu":
        pytest.skip("CUDA vLLM is installed as the distribution `vllm`: no shim needed or applied")
    without = vllm_version_command(tmp_path, [p for p in [os.environ.get("PYTHONPATH")] if p])
    assert without.returncode != 0 and "PackageNotFoundError" in without.stdout, without.stdout[-2000:]
    shim = vllm_metadata_shim(tmp_path / "shim")
    with_shim = vllm_version_command(tmp_path, [str(shim)])
    assert with_shim.returncode == 0, with_shim.stdout[-2000:]
    assert f"{vllm_runtime.vllm_version}+cpu" in with_shim.stdout
