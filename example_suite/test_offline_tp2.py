"""The offline form at TP=2: the same states as HF and as TP=1 (ids given unsorted, with a duplicate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.checks import (
    ALL_LAYERS,
    EngineSettings,
    HfReference,
    assert_files_match,
    assert_files_match_hf,
    report_margins,
    tolerance,
)
from example_suite.offline import OfflineExtractor
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt

pytestmark = pytest.mark.needs_clean_gpus


@pytest.fixture(scope="module", autouse=True)
def two_gpus_if_cuda(vllm_runtime: VllmRuntime) -> None:
    if vllm_runtime.device == "cuda" and vllm_runtime.gpus < 2:
        pytest.skip(f"TP=2 needs 2 GPUs, {vllm_runtime.gpus} visible (CUDA_VISIBLE_DEVICES)")


@pytest.fixture(scope="module")
def tp2_files(
    tp1_reference: list[Any],  # first: a TP=1 engine this needs is gone before the TP=2 one starts
    tiny_model_dir: Path,
    engine_settings: EngineSettings,
    prompts: list[Prompt],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[Path]:
    with OfflineExtractor(
        tiny_model_dir, layer_ids=[4, 0, 2, 2, 1, 3], tensor_parallel_size=2, **engine_settings.offline()
    ) as ex:
        assert ex.layer_ids == ALL_LAYERS  # sorted and de-duplicated, as vLLM does
        # A batch of 4, then one of 2: several generate calls, each with several requests.
        return ex.extract(prompts, tmp_path_factory.mktemp("offline-tp2"), batch_size=4)


def test_tp2_matches_hf(
    tp2_files: list[Path], hf: HfReference, vllm_runtime: VllmRuntime, request: pytest.FixtureRequest
) -> None:
    tol = tolerance(vllm_runtime.device)
    largest = assert_files_match_hf(tp2_files, ALL_LAYERS, hf, tol)
    report_margins(request.node, f"offline TP=2 vs HF on {vllm_runtime.device}", largest, tol)


def test_tp2_matches_tp1(
    tp2_files: list[Path], tp1_reference: list[Any], vllm_runtime: VllmRuntime, request: pytest.FixtureRequest
) -> None:
    tol = tolerance(vllm_runtime.device)
    largest = assert_files_match(tp2_files, tp1_reference, tol, "TP=2 vs TP=1")
    report_margins(request.node, f"offline TP=2 vs TP=1 on {vllm_runtime.device}", largest, tol)
