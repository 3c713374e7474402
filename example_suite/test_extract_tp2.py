"""TP=2 gives the same hidden states as TP=1 (and as HF), with the default EAGLE-3 layer selection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.checks import assert_close, load_checked, report_margins, tolerance
from example_suite.extract import HiddenStateExtractor
from example_suite.hidden_states import default_layer_ids
from example_suite.runtime import VllmRuntime
from example_suite.tiny_model import TinyLlamaSpec

pytestmark = pytest.mark.needs_clean_gpus

SPEC = TinyLlamaSpec()
DEFAULT_LAYERS = default_layer_ids(SPEC.num_layers)  # [1, 2, 4]


@pytest.fixture(scope="module", autouse=True)
def two_gpus_if_cuda(vllm_runtime: VllmRuntime) -> None:
    if vllm_runtime.device == "cuda" and vllm_runtime.gpus < 2:
        pytest.skip(f"TP=2 needs 2 GPUs, {vllm_runtime.gpus} visible (CUDA_VISIBLE_DEVICES)")


@pytest.fixture(scope="module")
def tp1_files(
    tiny_model_dir: Path,
    engine_args: dict[str, Any],
    prompts: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[Path]:
    # The TP=1 reference: a short-lived engine, shut down before the TP=2 one starts (on the CPU they would
    # share the same 2 cores; on a GPU the same card).
    with HiddenStateExtractor(tiny_model_dir, tensor_parallel_size=1, **engine_args) as ex:
        assert ex.layer_ids == DEFAULT_LAYERS
        return ex.extract(prompts, tmp_path_factory.mktemp("tp1"))


@pytest.fixture(scope="module")
def extractor_tp2(
    tp1_files: list[Path], tiny_model_dir: Path, engine_args: dict[str, Any]
) -> Iterator[HiddenStateExtractor]:
    with HiddenStateExtractor(tiny_model_dir, tensor_parallel_size=2, **engine_args) as ex:
        yield ex


def test_tp2_matches_tp1(
    extractor_tp2: HiddenStateExtractor,
    tp1_files: list[Path],
    prompts: list[list[int]],
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    assert extractor_tp2.layer_ids == DEFAULT_LAYERS
    tp2_files = extractor_tp2.extract(prompts, tmp_path)  # several prompts of different lengths, one call
    assert [p.name for p in tp2_files] == [p.name for p in tp1_files]
    tol = tolerance(vllm_runtime.device)
    largest: dict[str, float] = {}
    for index, (tp1, tp2, prompt) in enumerate(zip(tp1_files, tp2_files, prompts, strict=True)):
        largest[f"prompt {index}"] = assert_close(
            load_checked(tp2, prompt, DEFAULT_LAYERS, SPEC.hidden_size),
            load_checked(tp1, prompt, DEFAULT_LAYERS, SPEC.hidden_size),
            tol,
            f"prompt {index}: TP=2 vs TP=1",
        )
    report_margins(request.node, f"TP=2 vs TP=1 on {vllm_runtime.device}", largest, tol)


def test_tp2_matches_hf(
    extractor_tp2: HiddenStateExtractor,
    prompts: list[list[int]],
    hf_hidden_states: list[Any],
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    # A different split of the same prompts into calls than the test above: odd and even prompts.
    tol = tolerance(vllm_runtime.device)
    largest: dict[str, float] = {}
    for parity in (0, 1):
        indices = list(range(parity, len(prompts), 2))
        paths = extractor_tp2.extract([prompts[i] for i in indices], tmp_path / f"part{parity}")
        for index, path in zip(indices, paths, strict=True):
            hidden = load_checked(path, prompts[index], DEFAULT_LAYERS, SPEC.hidden_size)
            largest[f"prompt {index}"] = assert_close(
                hidden, hf_hidden_states[index][:, DEFAULT_LAYERS], tol, f"prompt {index}: TP=2 vs HF"
            )
    report_margins(request.node, f"TP=2 vs HF on {vllm_runtime.device}", largest, tol)
