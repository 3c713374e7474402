"""The offline form at TP=1: ``OfflineExtractor`` (``vllm.LLM`` with vLLM's native extraction) against HF."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.compare import assert_files_match, assert_files_match_hf, report_margins, tolerance
from example_suite.hidden_states import (
    ExtractionError,
    default_layer_ids,
    engine_configs,
    exact_embeddings_configs,
    normalize_layer_ids,
)
from example_suite.offline import OfflineExtractor
from example_suite.reaping import descendants
from example_suite.reference import HfReference, Tp1Reference
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt, read_sample
from example_suite.server import VllmServer
from example_suite.settings import ALL_LAYERS, NUM_LAYERS, EngineSettings

pytestmark = pytest.mark.needs_clean_gpus


@pytest.fixture(scope="module")
def offline_tp1(tiny_model_dir: Path, engine_settings: EngineSettings) -> Iterator[OfflineExtractor]:
    # One engine for the module (13-45 s to start on 2 CPU cores); every test writes its own files.
    with OfflineExtractor(tiny_model_dir, layer_ids=ALL_LAYERS, **engine_settings.offline()) as ex:
        yield ex


@pytest.fixture(scope="module")
def tp1_files(
    offline_tp1: OfflineExtractor,
    prompts: list[Prompt],
    tmp_path_factory: pytest.TempPathFactory,
    tp1_reference_cache: Tp1Reference,
) -> list[Path]:
    paths = offline_tp1.extract(prompts, tmp_path_factory.mktemp("offline-tp1"))
    # The TP=2 modules compare against these instead of starting a TP=1 engine of their own.
    tp1_reference_cache.states = [read_sample(p).hidden_states for p in paths]
    return paths


def test_every_layer_matches_hf(
    tp1_files: list[Path],
    prompts: list[Prompt],
    hf: HfReference,
    vllm_runtime: VllmRuntime,
    request: pytest.FixtureRequest,
) -> None:
    assert [p.name for p in tp1_files] == [f"hs_{i}.safetensors" for i in range(len(prompts))]
    assert all(str(read_sample(p).hidden_states.dtype) == "torch.float32" for p in tp1_files)
    tol = tolerance(vllm_runtime.device)
    largest = assert_files_match_hf(tp1_files, ALL_LAYERS, hf, tol, prompts)
    report_margins(request.node, f"offline TP=1 vs HF on {vllm_runtime.device}", largest, tol)


def test_id_0_is_the_embeddings_and_id_l_is_before_the_final_norm(
    tp1_files: list[Path], hf: HfReference
) -> None:
    # Id L differs from HF's last entry (after the norm) by far more than any tolerance, and every layer moves
    # the residual stream: a swapped, repeated or normed layer could not pass the comparison above.
    import torch

    sample = read_sample(tp1_files[1])
    states = sample.hidden_states
    expected = hf.states(sample.token_ids)
    assert float((states[:, NUM_LAYERS] - expected[:, NUM_LAYERS]).abs().max()) > 0.1
    steps = (expected[:, 1:] - expected[:, :-1]).abs().amax(dim=(0, 2))
    assert bool((steps > 0.1).all()), steps
    # Id 0: the checkpoint's embedding rows, exactly (HF's hidden_states[0] is the same). Where vLLM's norm
    # runs in place and the extractor did not prevent it (hidden_states.exact_embeddings_configs), id 0
    # came back equal to id L instead.
    embeddings = hf.checkpoint_embeddings(sample.token_ids)
    assert torch.equal(expected[:, 0], embeddings)
    assert not torch.equal(states[:, 0], states[:, NUM_LAYERS]), "id 0 is a copy of id L"
    assert torch.equal(states[:, 0], embeddings)


def test_rerun_skips_good_files_and_redoes_bad_ones(
    offline_tp1: OfflineExtractor,
    prompts: list[Prompt],
    tp1_files: list[Path],
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
) -> None:
    first = offline_tp1.extract(prompts, tmp_path)
    good = os.stat(first[0])
    first[1].write_bytes(first[1].read_bytes()[:-100])  # truncated
    first[2].write_bytes(b"\x00" * 64)  # not a safetensors file
    first[3].unlink()  # missing
    (tmp_path / "hs_4.safetensors").write_bytes(first[5].read_bytes())  # a file for another prompt
    bad = {index: os.stat(first[index]) for index in (1, 2, 4)}

    again = offline_tp1.extract(prompts, tmp_path)
    assert again == first
    after = os.stat(first[0])
    assert (after.st_ino, after.st_mtime_ns) == (good.st_ino, good.st_mtime_ns)  # kept, not rewritten
    for index, before in bad.items():  # rewritten: written anew and renamed into place
        assert os.stat(again[index]).st_ino != before.st_ino, index
    redone = [again[i] for i in (1, 2, 3, 4, 5)]
    assert [read_sample(p).token_ids for p in redone] == [
        read_sample(tp1_files[i]).token_ids for i in (1, 2, 3, 4, 5)
    ]
    # A GPU's kernels are not deterministic (two runs differed in the 4th decimal on an H200): the same
    # tolerance as every other comparison, exact on the CPU in practice.
    expected = [read_sample(tp1_files[i]).hidden_states for i in (1, 2, 3, 4, 5)]
    assert_files_match(redone, expected, tolerance(vllm_runtime.device), "rerun vs first run")
    assert not list(tmp_path.glob("*.tmp"))


def test_layer_id_out_of_range_fails_before_an_engine_starts(tiny_model_dir: Path) -> None:
    before = {p.pid for p in descendants()}
    with pytest.raises(ExtractionError, match=r"layer id\(s\) \[5\] out of range.*ids are 0\.\.4"):
        OfflineExtractor(tiny_model_dir, layer_ids=[0, 5])
    assert {p.pid for p in descendants()} == before


def test_layer_ids_are_sorted_and_deduplicated_like_vllm() -> None:
    assert normalize_layer_ids([4, 0, 2, 2], 4) == [0, 2, 4]
    assert normalize_layer_ids(None, 4) == default_layer_ids(4) == [1, 2, 4]  # from (2, 2, 1, 4)
    assert default_layer_ids(32) == [2, 16, 29, 32]
    with pytest.raises(ExtractionError, match="out of range"):
        normalize_layer_ids([-1], 4)


def test_bad_prompts_are_clear_errors(offline_tp1: OfflineExtractor, tmp_path: Path) -> None:
    with pytest.raises(ExtractionError, match=r"prompt 1: expected a non-empty list of token ids"):
        offline_tp1.extract([[1, 2], []], tmp_path)
    assert not list(tmp_path.iterdir())  # checked before anything ran


def test_id_0_turns_vllms_in_place_norm_off_and_vllm_accepts_that(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Where vLLM's norm runs in place (CUDA), id 0 would come back as id L; the engines of this suite request
    # id 0, so on CPU they start with these settings too, and the comparisons above show they change nothing.
    from vllm.config.compilation import CompilationConfig
    from vllm.config.kernel import KernelConfig

    with_0, without = engine_configs([0, 4], tmp_path, cpu=True), engine_configs([1, 4], tmp_path, cpu=True)
    extra = exact_embeddings_configs()
    assert set(with_0) - set(without) == set(extra) and "compilation_config" in extra
    assert "-rms_norm" in CompilationConfig(**with_0["compilation_config"]).custom_ops
    if "kernel_config" in extra:  # vLLM versions that choose the fused residual-add norm by IR op priority
        assert KernelConfig(**with_0["kernel_config"]).ir_op_priority.fused_add_rms_norm == ["native"]
    # Both forms pass them, and refuse a caller's value that would replace them.
    server = VllmServer(tiny_model_dir, layer_ids=[0, 4])
    try:
        at = server.argv.index("--compilation-config")
        assert json.loads(server.argv[at + 1]) == extra["compilation_config"]
    finally:
        server.stop()
    with pytest.raises(ValueError, match=r"\['--compilation-config'\] are set by the server"):
        VllmServer(tiny_model_dir, layer_ids=[0], extra_args=["--compilation-config={}"])
    with pytest.raises(ValueError, match=r"\['compilation_config'\] are set by the extractor"):
        OfflineExtractor(tiny_model_dir, layer_ids=[0], compilation_config={})
