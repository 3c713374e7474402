"""The server at TP=2, with the default (EAGLE-3) layer ids: the same states as HF and as TP=1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.checks import (
    EngineSettings,
    HfReference,
    assert_close,
    assert_files_match,
    assert_files_match_hf,
    report_margins,
    tolerance,
)
from example_suite.client import HiddenStatesClient
from example_suite.hidden_states import default_layer_ids
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt, read_sample
from example_suite.server import VllmServer

pytestmark = pytest.mark.needs_clean_gpus

DEFAULT_LAYERS = default_layer_ids(4)  # [1, 2, 4]


@pytest.fixture(scope="module", autouse=True)
def two_gpus_if_cuda(vllm_runtime: VllmRuntime) -> None:
    if vllm_runtime.device == "cuda" and vllm_runtime.gpus < 2:
        pytest.skip(f"TP=2 needs 2 GPUs, {vllm_runtime.gpus} visible (CUDA_VISIBLE_DEVICES)")


@pytest.fixture(scope="module")
def server_tp2(
    tp1_reference: list[Any],  # first: a TP=1 engine this may need is gone before the server starts
    tiny_model_dir: Path,
    engine_settings: EngineSettings,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("server-tp2") / "server.log"
    server = VllmServer(tiny_model_dir, tensor_parallel_size=2, log_path=log, **engine_settings.server())
    assert server.layer_ids == DEFAULT_LAYERS
    with server:
        yield server
    assert server.process is not None and server.process.returncode == 0, server.log_tail()


@pytest.fixture(scope="module")
def tp2_files(
    server_tp2: VllmServer, prompts: list[Prompt], tmp_path_factory: pytest.TempPathFactory
) -> list[Path]:
    client = HiddenStatesClient(server_tp2.url, concurrency=len(prompts), layer_ids=DEFAULT_LAYERS)
    all_sent = threading.Barrier(len(prompts), timeout=120)  # all requests in flight at once
    client.after_send = lambda index: all_sent.wait()
    return client.extract(prompts, tmp_path_factory.mktemp("server-tp2-out"))


def test_tp2_server_matches_hf(
    tp2_files: list[Path], hf: HfReference, vllm_runtime: VllmRuntime, request: pytest.FixtureRequest
) -> None:
    tol = tolerance(vllm_runtime.device)
    largest = assert_files_match_hf(tp2_files, DEFAULT_LAYERS, hf, tol)
    report_margins(request.node, f"server TP=2 vs HF on {vllm_runtime.device}", largest, tol)


def test_tp2_server_matches_tp1(
    tp2_files: list[Path], tp1_reference: list[Any], vllm_runtime: VllmRuntime, request: pytest.FixtureRequest
) -> None:
    tol = tolerance(vllm_runtime.device)
    expected = [states[:, DEFAULT_LAYERS] for states in tp1_reference]  # the TP=1 reference has ids 0..4
    largest = assert_files_match(tp2_files, expected, tol, "server TP=2 vs TP=1")
    report_margins(request.node, f"server TP=2 vs TP=1 on {vllm_runtime.device}", largest, tol)


def test_tp2_server_repeated_long_prompt(
    server_tp2: VllmServer, prompts: list[Prompt], vllm_runtime: VllmRuntime, tmp_path: Path
) -> None:
    # The long prompt again, now partly from the prefix cache, split over both ranks' KV blocks.
    long_prompt = prompts[1]
    client = HiddenStatesClient(server_tp2.url)
    (first,) = client.extract([long_prompt], tmp_path / "first")
    (again,) = client.extract([long_prompt], tmp_path / "again")
    assert_close(
        read_sample(again).hidden_states,
        read_sample(first).hidden_states,
        tolerance(vllm_runtime.device),
        "repeat vs first",
    )
