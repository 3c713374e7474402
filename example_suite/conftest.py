"""Fixtures of the example suite: the runtime (CUDA or CPU vLLM), a tiny on-disk Llama, prompts, HF
references.

Run with ``pytest -p gpuclean example_suite/``. Without vLLM installed every test is skipped with the reason.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from example_suite.runtime import (
    VLLM_MISSING,
    VllmRuntime,
    detect_runtime,
    vllm_environment,
    vllm_installed,
)

MARKER = "needs_clean_gpus"
MAX_MODEL_LEN = 128  # the longest test prompt has 41 tokens
# On a GPU, vLLM would otherwise reserve 92% of each card; the tiny model needs a few GB at most.
GPU_MEMORY_UTILIZATION = 0.1

SIMULATE_VAR = "GPUCLEAN_SIMULATE"
SIMULATED_GPUS = 2  # TP=2 "uses" two devices


def _simulated_gpus_for_cpu_runs() -> str | None:
    # gpuclean skips marked tests where it finds no GPUs. With CPU vLLM (or none) we give it simulated, idle
    # devices instead, so that the suite runs and the plugin still checks and reaps processes. This must
    # happen at import: this conftest is loaded before any plugin's pytest_configure, where gpuclean reads the
    # variable.
    if os.environ.get(SIMULATE_VAR) or (vllm_installed() and detect_runtime().device != "cpu"):
        return None
    root = tempfile.mkdtemp(prefix="gpuclean-simulated-")
    for index in range(SIMULATED_GPUS):
        os.mkdir(os.path.join(root, str(index)))
    os.environ[SIMULATE_VAR] = root
    return root


_SIMULATED_ROOT = _simulated_gpus_for_cpu_runs()


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("gpuclean"):
        # Developing without the plugin (-p no:gpuclean): keep the marker known so --strict-markers passes.
        config.addinivalue_line("markers", f"{MARKER}: assert clean GPUs, reap leaked processes (gpuclean)")
    if _SIMULATED_ROOT is not None:
        config.add_cleanup(lambda: _forget_simulated_gpus(_SIMULATED_ROOT))
    if vllm_installed():
        # vLLM starts its processes with multiprocessing's spawn method, whose first use starts the
        # interpreter-lifetime helper `python -B -c "from multiprocessing.resource_tracker import main..."`.
        # Start it now, outside any test, so that it is not counted as a process some test leaked.
        multiprocessing.resource_tracker.ensure_running()


def _forget_simulated_gpus(root: str) -> None:
    if os.environ.get(SIMULATE_VAR) == root:
        del os.environ[SIMULATE_VAR]
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_runtime() -> Iterator[VllmRuntime]:
    """CUDA or CPU vLLM, with the environment its engines need set for the session (and undone after)."""
    if not vllm_installed():
        pytest.skip(VLLM_MISSING)
    runtime = detect_runtime()
    with pytest.MonkeyPatch.context() as patch:
        # For the whole session, so that subprocesses (the CLI, inner pytest runs) inherit it too: LD_PRELOAD
        # only works if it is in a process's environment when it starts. HiddenStateExtractor adjusts the
        # thread binding to its TP size while it starts an engine.
        for name, value in vllm_environment(tensor_parallel_size=1).items():
            patch.setenv(name, value)
        yield runtime


@pytest.fixture(scope="session")
def engine_args(vllm_runtime: VllmRuntime) -> dict[str, Any]:
    """Keyword arguments for every ``HiddenStateExtractor`` / ``LLM`` of the suite (fp32: tight checks)."""
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN}
    if vllm_runtime.device == "cuda":
        args["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
    return args


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, vllm_runtime: VllmRuntime) -> Path:
    """A seeded random 4-layer Llama (hidden 128, head_dim 32) with a word-level tokenizer, saved to disk."""
    from example_suite.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Token-id prompts of different lengths, including a repeat and a prefix of another prompt (ids <
    256)."""
    long_prompt = [1] + [(7 * i + 11) % 250 + 4 for i in range(40)]
    return [
        [1, 17, 42, 99, 5],
        long_prompt,
        [1, 200],
        long_prompt[:9],  # a prefix of the long prompt: must not be confused with it in the flattened batch
        [1, 17, 42, 99, 5],  # identical to the first prompt: gets its own file
        [1] + [(13 * i + 3) % 250 + 4 for i in range(22)],
    ]


@pytest.fixture(scope="session")
def hf_hidden_states(tiny_model_dir: Path, prompts: list[list[int]]) -> list[Any]:
    """HF transformers' residual stream per prompt, ``[seq, N+1, hidden]`` fp32 on the CPU, for ids 0..N.

    HF's ``hidden_states[N]`` is after the final norm, while id N means the last decoder layer's output; that
    one
    is taken from a forward hook on the last decoder layer instead.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # float32, as saved
    last_layer_output: list[torch.Tensor] = []

    def keep_output(module: torch.nn.Module, args: Any, output: Any) -> None:
        last_layer_output.append(output[0] if isinstance(output, tuple) else output)

    handle = model.model.layers[-1].register_forward_hook(keep_output)
    references = []
    try:
        with torch.no_grad():
            for prompt in prompts:
                last_layer_output.clear()
                out = model(torch.tensor([prompt]), output_hidden_states=True)
                per_layer = [*out.hidden_states[:-1], last_layer_output[0]]
                references.append(torch.stack([h[0] for h in per_layer], dim=1))
    finally:
        handle.remove()
    return references
