"""TP=1: extracted hidden states match HF transformers, and batching does not change them."""

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
ALL_LAYERS = list(range(SPEC.num_layers + 1))  # 0 (embeddings) .. N (last decoder layer's output)


@pytest.fixture(scope="module")
def extractor_tp1(tiny_model_dir: Path, engine_args: dict[str, Any]) -> Iterator[HiddenStateExtractor]:
    # One engine for the module: starting one costs ~25 s on 2 CPU cores. Every test writes its own files.
    with HiddenStateExtractor(
        tiny_model_dir, tensor_parallel_size=1, layer_ids=ALL_LAYERS, **engine_args
    ) as ex:
        yield ex


def test_batch_matches_hf(
    extractor_tp1: HiddenStateExtractor,
    prompts: list[list[int]],
    hf_hidden_states: list[Any],
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    paths = extractor_tp1.extract(prompts, tmp_path)  # all prompts in one generate call
    assert [p.name for p in paths] == [f"{i:08d}.safetensors" for i in range(len(prompts))]
    tol = tolerance(vllm_runtime.device)
    largest = {f"layer {layer_id}": 0.0 for layer_id in ALL_LAYERS}
    for index, (path, prompt, expected) in enumerate(zip(paths, prompts, hf_hidden_states, strict=True)):
        hidden = load_checked(path, prompt, ALL_LAYERS, SPEC.hidden_size)
        for column, layer_id in enumerate(ALL_LAYERS):
            diff = assert_close(
                hidden[:, column], expected[:, layer_id], tol, f"prompt {index} layer id {layer_id} vs HF"
            )
            largest[f"layer {layer_id}"] = max(largest[f"layer {layer_id}"], diff)
    report_margins(request.node, f"TP=1 vs HF on {vllm_runtime.device}", largest, tol)


def test_layers_really_differ(hf_hidden_states: list[Any]) -> None:
    # Guards the comparison above against a degenerate model: each layer must move the residual stream by far
    # more than any tolerance, or a swapped or repeated layer id could pass.
    for expected in hf_hidden_states:
        steps = (expected[:, 1:] - expected[:, :-1]).abs().amax(dim=(0, 2))
        assert bool((steps > 0.1).all()), steps


def test_one_prompt_per_call_equals_batch(
    extractor_tp1: HiddenStateExtractor, prompts: list[list[int]], vllm_runtime: VllmRuntime, tmp_path: Path
) -> None:
    batched = extractor_tp1.extract(prompts, tmp_path / "batched")
    for index, prompt in enumerate(prompts):
        (single,) = extractor_tp1.extract([prompt], tmp_path / "single", start_index=index)
        assert single.name == batched[index].name
        assert_close(
            load_checked(single, prompt, ALL_LAYERS, SPEC.hidden_size),
            load_checked(batched[index], prompt, ALL_LAYERS, SPEC.hidden_size),
            tolerance(vllm_runtime.device),
            f"prompt {index}: alone vs in a batch",
        )


def test_default_layer_selection() -> None:
    # EAGLE-3's (2, N//2, N-3) aux layers plus the last layer N, made valid (clamped, de-duplicated, sorted).
    assert default_layer_ids(4) == [1, 2, 4]  # (2, 2, 1, 4)
    assert default_layer_ids(2) == [0, 1, 2]  # (2, 1, -1, 2)
    assert default_layer_ids(32) == [2, 16, 29, 32]
    assert default_layer_ids(80) == [2, 40, 77, 80]
