"""The command line: ``python -m example_suite.extract`` on a jsonl file, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.checks import assert_close, load_checked, orphans_reaped, tolerance
from example_suite.runtime import VllmRuntime
from example_suite.tiny_model import TinyLlamaSpec

pytestmark = pytest.mark.needs_clean_gpus

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS = [2, 3, 4]
CLI_TIMEOUT_S = 600


def test_cli_writes_one_file_per_prompt(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    hf_hidden_states: list[Any],
    engine_args: dict[str, Any],
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
) -> None:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out_dir = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "example_suite.extract",
        "--model",
        str(tiny_model_dir),
        "--tp",
        "1",
        "--layers",
        ",".join(map(str, LAYERS)),
        "--out",
        str(out_dir),
        "--dtype",
        engine_args["dtype"],
        "--max-model-len",
        str(engine_args["max_model_len"]),
        "--batch-size",
        "4",  # 6 prompts: a batch of 4, then one of 2
        str(prompts_file),
    ]
    if "gpu_memory_utilization" in engine_args:
        command += ["--gpu-memory-utilization", str(engine_args["gpu_memory_utilization"])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_path = tmp_path / "cli.log"
    # Output to a file, not a pipe: a stray engine process could keep a pipe open and hang us (GPU-FACTS.md).
    with log_path.open("wb") as log, orphans_reaped():
        completed = subprocess.run(
            command,
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
    output = log_path.read_text(errors="replace")
    assert completed.returncode == 0, output[-5000:]
    assert "hidden states: 100%" in output  # the tqdm bar over prompts finished
    assert f"wrote {len(prompts)} files" in output

    files = sorted(out_dir.iterdir())
    assert [f.name for f in files] == [f"{i:08d}.safetensors" for i in range(len(prompts))]
    for index, (path, prompt) in enumerate(zip(files, prompts, strict=True)):
        hidden = load_checked(path, prompt, LAYERS, TinyLlamaSpec().hidden_size)
        assert_close(
            hidden,
            hf_hidden_states[index][:, LAYERS],
            tolerance(vllm_runtime.device),
            f"prompt {index}: CLI vs HF",
        )


def test_cli_rejects_bad_prompt_file(tmp_path: Path) -> None:
    from example_suite.extract import read_prompts

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n\n{"text": "no ids"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        list(read_prompts(bad))
