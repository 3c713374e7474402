"""TP=2 through either front end: the same states as HF and as TP=1, one test for both.

- ``offline``: ``OfflineExtractor`` with the ids given unsorted, with a duplicate (``4,0,2,2,1,3``), in a
  batch of 4 then one of 2 (several generate calls, each with several requests);
- ``server``: ``vllm serve`` with the default (EAGLE-3) layer ids, every request in flight at once; and a
  repeated long prompt, served partly from the prefix cache, split over both ranks' KV blocks.

Each front end's engine is module-scoped and started only for its tests, after the TP=1 reference's engine
is gone (``tp1_reference`` first); pytest runs the tests of one parameter together, so the offline engine
has stopped before the server starts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.client import HiddenStatesClient
from example_suite.compare import (
    assert_close,
    assert_files_match,
    assert_files_match_hf,
    report_margins,
    tolerance,
)
from example_suite.hidden_states import default_layer_ids
from example_suite.offline import OfflineExtractor
from example_suite.reference import HfReference
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt, read_sample
from example_suite.server import VllmServer
from example_suite.settings import ALL_LAYERS, NUM_LAYERS, EngineSettings

pytestmark = pytest.mark.needs_clean_gpus

DEFAULT_LAYERS = default_layer_ids(NUM_LAYERS)  # [1, 2, 4]


@dataclass(frozen=True)
class Tp2Files:
    """What one front end at TP=2 extracted for the suite's prompts: a file per prompt, at ``layer_ids``."""

    front_end: str
    layer_ids: list[int]
    paths: list[Path]


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


def _offline_files(model: Path, settings: EngineSettings, prompts: list[Prompt], out: Path) -> Tp2Files:
    with OfflineExtractor(
        model, layer_ids=[4, 0, 2, 2, 1, 3], tensor_parallel_size=2, **settings.offline()
    ) as ex:
        assert ex.layer_ids == ALL_LAYERS  # sorted and de-duplicated, as vLLM does
        # A batch of 4, then one of 2: several generate calls, each with several requests.
        return Tp2Files("offline", ALL_LAYERS, ex.extract(prompts, out, batch_size=4))


def _server_files(server: VllmServer, prompts: list[Prompt], out: Path) -> Tp2Files:
    client = HiddenStatesClient(server.url, concurrency=len(prompts), layer_ids=DEFAULT_LAYERS)
    all_sent = threading.Barrier(len(prompts), timeout=120)  # all requests in flight at once
    client.after_send = lambda index: all_sent.wait()
    return Tp2Files("server", DEFAULT_LAYERS, client.extract(prompts, out))


@pytest.fixture(scope="module", params=["offline", "server"])
def tp2_files(
    request: pytest.FixtureRequest,
    tp1_reference: list[Any],  # first: a TP=1 engine this needs is gone before the TP=2 one starts
    tiny_model_dir: Path,
    engine_settings: EngineSettings,
    prompts: list[Prompt],
    tmp_path_factory: pytest.TempPathFactory,
) -> Tp2Files:
    out = tmp_path_factory.mktemp(f"{request.param}-tp2")
    if request.param == "offline":
        return _offline_files(tiny_model_dir, engine_settings, prompts, out)
    # The server only for its parameter: the offline tests run alone (-k offline) start none.
    return _server_files(request.getfixturevalue("server_tp2"), prompts, out)


def test_tp2_matches_hf(
    tp2_files: Tp2Files, hf: HfReference, vllm_runtime: VllmRuntime, request: pytest.FixtureRequest
) -> None:
    tol = tolerance(vllm_runtime.device)
    largest = assert_files_match_hf(tp2_files.paths, tp2_files.layer_ids, hf, tol)
    report_margins(request.node, f"{tp2_files.front_end} TP=2 vs HF on {vllm_runtime.device}", largest, tol)


def test_tp2_matches_tp1(
    tp2_files: Tp2Files, tp1_reference: list[Any], vllm_runtime: VllmRuntime, request: pytest.FixtureRequest
) -> None:
    tol = tolerance(vllm_runtime.device)
    expected = [states[:, tp2_files.layer_ids] for states in tp1_reference]  # the TP=1 reference: ids 0..4
    largest = assert_files_match(tp2_files.paths, expected, tol, f"{tp2_files.front_end} TP=2 vs TP=1")
    report_margins(request.node, f"{tp2_files.front_end} TP=2 vs TP=1 on {vllm_runtime.device}", largest, tol)


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
