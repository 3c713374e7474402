"""The server at TP=1: one module-scoped ``vllm serve`` shared by every test here, used through the client.

gpuclean sees the server's whole tree (API server, resource tracker, EngineCore, worker) start in this
module's fixture, so it treats it as the fixture's: not a leak of the tests that use it, and checked at the
fixture's teardown (the last test's teardown fails if the stop leaves a process behind).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.client import HiddenStatesClient
from example_suite.compare import (
    assert_close,
    assert_files_match,
    assert_files_match_hf,
    assert_matches_hf,
    report_margins,
    tolerance,
)
from example_suite.hidden_states import ExtractionError
from example_suite.reference import HfReference
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt, read_sample
from example_suite.server import VllmServer
from example_suite.settings import ALL_LAYERS, BLOCK_SIZE, LONG_PROMPT, MAX_MODEL_LEN, EngineSettings
from example_suite.subprocesses import run_cli

pytestmark = pytest.mark.needs_clean_gpus


@pytest.fixture(scope="module")
def server_tp1(
    tiny_model_dir: Path, engine_settings: EngineSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("server-tp1") / "server.log"
    server = VllmServer(tiny_model_dir, layer_ids=ALL_LAYERS, log_path=log, **engine_settings.server())
    server.start()
    yield server
    # The way a user should stop it: SIGTERM, and vLLM's --shutdown-timeout lets it stop in order.
    report = server.stop()
    assert report.exit_code == 0 and not report.killed, (report, server.log_tail())
    assert not any(psutil.pid_exists(pid) and _not_zombie(pid) for pid in server.recorded_pids())
    # What it left (IPC socket files; on a loaded CPU box also the /dev/shm entry of a worker that vLLM had
    # to kill after its grace period) is gone with the private directory.
    assert not server.private_dir.exists()
    assert not [p for p in report.debris if p.exists()], report


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_concurrent_requests_match_hf(
    server_tp1: VllmServer,
    prompts: list[Prompt],
    hf: HfReference,
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    client = HiddenStatesClient(server_tp1.url, concurrency=len(prompts), layer_ids=ALL_LAYERS)
    # No response is read before every request has been sent: all of them are in flight at once.
    all_sent = threading.Barrier(len(prompts), timeout=120)
    client.after_send = lambda index: all_sent.wait()
    paths = client.extract(prompts, tmp_path)
    assert [p.name for p in paths] == [f"hs_{i}.safetensors" for i in range(len(prompts))]
    tol = tolerance(vllm_runtime.device)
    largest = assert_files_match_hf(paths, ALL_LAYERS, hf, tol, prompts)
    report_margins(request.node, f"server TP=1 vs HF on {vllm_runtime.device}", largest, tol)


def test_text_and_token_id_prompts_give_the_same_states(
    server_tp1: VllmServer, vllm_runtime: VllmRuntime, tmp_path: Path
) -> None:
    text, ids = read_both(server_tp1, ["w9 w8 w7 w200", [9, 8, 7, 200]], tmp_path)
    assert text.token_ids == ids.token_ids == [9, 8, 7, 200]
    assert_close(text.hidden_states, ids.hidden_states, tolerance(vllm_runtime.device), "text vs ids")


def read_both(server: VllmServer, prompts: list[Prompt], out: Path) -> list[Any]:
    paths = HiddenStatesClient(server.url).extract(prompts, out)
    return [read_sample(p) for p in paths]


def test_prompt_spanning_several_blocks(
    server_tp1: VllmServer, hf: HfReference, vllm_runtime: VllmRuntime, tmp_path: Path
) -> None:
    assert len(LONG_PROMPT) > 3 * BLOCK_SIZE
    (sample,) = read_both(server_tp1, [LONG_PROMPT], tmp_path)
    largest: dict[str, float] = {}
    assert_matches_hf(
        sample.hidden_states,
        LONG_PROMPT,
        ALL_LAYERS,
        hf,
        tolerance(vllm_runtime.device),
        "4-block prompt",
        largest,
    )


def prefix_cache_hits(server: VllmServer) -> float:
    # vLLM's Prometheus counter of prompt tokens served from the prefix cache.
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    ]
    assert values, "no vllm:prefix_cache_hits_total in /metrics"
    return sum(values)


def test_repeated_prompt_hits_the_prefix_cache_and_gives_the_same_states(
    server_tp1: VllmServer, hf: HfReference, vllm_runtime: VllmRuntime, tmp_path: Path
) -> None:
    # A prompt no other test sends: the first request computes all of it, the repeat reads 3 cached blocks.
    prompt = [1] + [(11 * i + 5) % 250 + 4 for i in range(100)]
    (first,) = read_both(server_tp1, [prompt], tmp_path / "first")
    hits_before = prefix_cache_hits(server_tp1)
    (repeat,) = read_both(server_tp1, [prompt], tmp_path / "repeat")
    assert prefix_cache_hits(server_tp1) - hits_before >= 3 * BLOCK_SIZE
    tol = tolerance(vllm_runtime.device)
    assert_close(repeat.hidden_states, first.hidden_states, tol, "repeat (prefix cache hit) vs first")
    largest: dict[str, float] = {}
    assert_matches_hf(repeat.hidden_states, prompt, ALL_LAYERS, hf, tol, "prefix-cache hit", largest)


def test_server_matches_offline_tp1(
    server_tp1: VllmServer,
    prompts: list[Prompt],
    tp1_reference: list[Any],
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
) -> None:
    paths = HiddenStatesClient(server_tp1.url).extract(prompts, tmp_path)
    assert_files_match(paths, tp1_reference, tolerance(vllm_runtime.device), "server vs offline")


def test_bad_request_is_a_clear_error(server_tp1: VllmServer, tmp_path: Path) -> None:
    too_long = [1] + [5] * MAX_MODEL_LEN
    with pytest.raises(ExtractionError, match=r"prompt 1: the server answered 400: .*"):
        HiddenStatesClient(server_tp1.url, concurrency=1).extract([[1, 2], too_long], tmp_path)


def test_client_command_line_with_progress_bar_and_resume(
    server_tp1: VllmServer, prompts: list[Prompt], tmp_path: Path
) -> None:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(
        "".join(json.dumps({"text": p} if isinstance(p, str) else {"input_ids": p}) + "\n" for p in prompts)
    )
    command = [
        "client",
        "--url",
        server_tp1.url,
        "--layers",
        "0,1,2,3,4",
        "--out",
        str(tmp_path / "out"),
        str(prompts_file),
    ]
    first = run_cli(command, tmp_path / "first.log")
    assert first.returncode == 0, first.output
    assert "hidden states: 100%" in first.output  # the tqdm bar over prompts finished
    assert f"wrote {len(prompts)} files" in first.output
    (tmp_path / "out" / "hs_2.safetensors").write_bytes(b"truncated")
    second = run_cli(command, tmp_path / "second.log")
    assert second.returncode == 0, second.output
    assert f"wrote 1 files to {tmp_path / 'out'}, kept {len(prompts) - 1}" in second.output
    assert read_sample(tmp_path / "out" / "hs_2.safetensors").token_ids == [5, 17, 42, 99, 200, 7]
