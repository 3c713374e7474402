"""The command line: ``python -m example_suite.extract offline`` for real, and its errors (no traceback).

The ``client`` form runs against the shared server in test_server.py.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.compare import assert_matches_hf, tolerance
from example_suite.reference import HfReference
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt, read_sample
from example_suite.settings import EngineSettings
from example_suite.subprocesses import run_cli

pytestmark = pytest.mark.needs_clean_gpus

LAYERS = [2, 3, 4]


def write_prompts(path: Path, prompts: list[Prompt]) -> Path:
    lines = [json.dumps({"text": p} if isinstance(p, str) else {"input_ids": p}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_offline_command_line(
    tiny_model_dir: Path,
    prompts: list[Prompt],
    hf: HfReference,
    engine_settings: EngineSettings,
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    command = [
        "offline", "--model", str(tiny_model_dir), "--layers", "4,2,3", "--out", str(out),
        "--dtype", engine_settings.dtype, "--max-model-len", str(engine_settings.max_model_len),
        "--batch-size", "4",  # 6 prompts: a batch of 4, then one of 2
        str(write_prompts(tmp_path / "prompts.jsonl", prompts)),
    ]  # fmt: skip
    if engine_settings.offline().get("enforce_eager"):
        # Like every engine of the suite (settings.py): compiling this one cost 35 s of CPU on the 2-core
        # box (the test with its fixtures, 84 -> 49 s), for graphs the tiny model gains nothing from.
        command.append("--enforce-eager")
    engine = engine_settings.offline()
    command += [
        "--max-num-seqs",
        str(engine["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(engine["max_num_batched_tokens"]),
    ]
    if vllm_runtime.device == "cuda":
        command += [
            "--gpu-memory-utilization",
            str(engine["gpu_memory_utilization"]),
            "--kv-cache-memory-bytes",
            str(engine["kv_cache_memory_bytes"]),
        ]
    first = run_cli(command, tmp_path / "first.log")
    assert first.returncode == 0, first.output[-5000:]
    assert "hidden states: 100%" in first.output  # the tqdm bar over prompts finished
    assert f"wrote {len(prompts)} files to {out}, kept 0 (layer ids {LAYERS})" in first.output
    assert sorted(p.name for p in out.iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(len(prompts)))
    largest: dict[str, float] = {}
    for index in range(len(prompts)):
        sample = read_sample(out / f"hs_{index}.safetensors")
        assert sample.layer_ids == LAYERS
        tol = tolerance(vllm_runtime.device)
        assert_matches_hf(sample.hidden_states, sample.token_ids, LAYERS, hf, tol, f"prompt {index}", largest)

    # A rerun with every file complete has nothing to do, and starts no engine for it.
    again = run_cli(command, tmp_path / "again.log")
    assert again.returncode == 0, again.output[-5000:]
    assert f"all {len(prompts)} prompts already have their file" in again.output
    assert "vLLM" not in again.output and "EngineCore" not in again.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


USER_ERRORS = {
    "bad prompt file": r"prompts.jsonl:3: expected {\"input_ids\": \[int, ...\]} or {\"text\": \"...\"}",
    "missing prompt file": r"nowhere.jsonl: cannot read the prompt file: No such file or directory",
    "layer id out of range": r"layer id\(s\) \[9\] out of range: this model has 4 decoder layers",
    "unreachable server": r"cannot reach the vLLM server at http://127.0.0.1:\d+ .*is `vllm serve` running",
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_are_one_line_without_traceback(case: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"input_ids": [1, 2]}\n\n{"ids": [3]}\n' if case == "bad prompt file" else '{"text": "w5"}\n'
    )
    out = ["--out", str(tmp_path / "out")]
    command = {
        "bad prompt file": ["offline", "--model", str(tiny_model_dir), *out, str(prompts)],
        "missing prompt file": [
            "offline",
            "--model",
            str(tiny_model_dir),
            *out,
            str(tmp_path / "nowhere.jsonl"),
        ],
        "layer id out of range": [
            "offline",
            "--model",
            str(tiny_model_dir),
            "--layers",
            "0,9",
            *out,
            str(prompts),
        ],
        "unreachable server": ["client", "--url", f"http://127.0.0.1:{free_port()}", *out, str(prompts)],
    }[case]
    run = run_cli(command, tmp_path / "cli.log", timeout_s=120)
    assert run.returncode == 2, run.output
    assert "Traceback" not in run.output, run.output
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), run.output
    assert re.search(USER_ERRORS[case], lines[0]), (USER_ERRORS[case], lines[0])
