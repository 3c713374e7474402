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

from example_suite.reference import HfReference, Tp1Reference
from example_suite.runtime import (
    VLLM_MISSING,
    VllmRuntime,
    detect_runtime,
    vllm_environment,
    vllm_installed,
)
from example_suite.samples import Prompt, read_sample
from example_suite.settings import ALL_LAYERS, LONG_PROMPT, EngineSettings

MARKER = "needs_clean_gpus"

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
        # only works if it is in a process's environment when it starts. OfflineExtractor and VllmServer
        # adjust the thread binding to their TP size when they start an engine.
        for name, value in vllm_environment(tensor_parallel_size=1).items():
            patch.setenv(name, value)
        yield runtime


@pytest.fixture(scope="session")
def engine_settings(vllm_runtime: VllmRuntime) -> EngineSettings:
    """The engine and server settings of the whole suite."""
    return EngineSettings(vllm_runtime.device)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, vllm_runtime: VllmRuntime) -> Path:
    """A seeded random 4-layer Llama (hidden 128, head_dim 32) with a word-level tokenizer, saved to disk."""
    from example_suite.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def prompts() -> list[Prompt]:
    """Prompts of different lengths: token ids and a text, one spanning 4 KV blocks, a repeat, a prefix."""
    return [
        [1, 17, 42, 99, 5],
        LONG_PROMPT,
        "w5 w17 w42 w99 w200 w7",  # text: the word-level tokenizer makes it [5, 17, 42, 99, 200, 7]
        LONG_PROMPT[:9],  # a prefix of the long prompt
        [1, 17, 42, 99, 5],  # identical to the first prompt: gets its own file
        [1] + [(13 * i + 3) % 250 + 4 for i in range(22)],
    ]


@pytest.fixture(scope="session")
def hf(tiny_model_dir: Path) -> HfReference:
    """HF transformers on the CPU in fp32: the reference every extraction is compared with."""
    return HfReference(tiny_model_dir)


@pytest.fixture(scope="session")
def tp1_reference_cache() -> Tp1Reference:
    """Filled by the offline TP=1 module's engine; TP=2 tests use it instead of starting a TP=1 engine."""
    return Tp1Reference()


@pytest.fixture(scope="module")
def tp1_reference(
    tp1_reference_cache: Tp1Reference,
    tiny_model_dir: Path,
    engine_settings: EngineSettings,
    prompts: list[Prompt],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[Any]:
    """vLLM's TP=1 states per prompt, [tokens, len(ALL_LAYERS), hidden], from the cache or a new engine.

    The engine of test_offline.py fills the cache when that module ran first (a full run); a TP=2 module run
    alone starts its own TP=1 engine here, and shuts it down before its TP=2 engine starts.
    """
    if tp1_reference_cache.states is None:
        from example_suite.offline import OfflineExtractor

        with OfflineExtractor(tiny_model_dir, layer_ids=ALL_LAYERS, **engine_settings.offline()) as ex:
            paths = ex.extract(prompts, tmp_path_factory.mktemp("tp1-reference"))
        tp1_reference_cache.states = [read_sample(p).hidden_states for p in paths]
    return tp1_reference_cache.states
