"""The failure gpuclean exists for: a test abandons a vLLM engine; gpuclean reaps it, blames that test.

An inner pytest session (``pytester.runpytest_subprocess("-p", "gpuclean", ...)``) runs two tests. The first
starts an ``LLM`` (TP=2 where two devices are available: CPU, or two GPUs; else TP=1), keeps a global
reference and never shuts it down, so EngineCore (and its TP workers) outlive it. The second must pass,
and checks from inside the same session that those processes are already
gone (so they were reaped in the first test's teardown, not by vLLM's own clean-up at interpreter exit).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from example_suite.runtime import VLLM_MISSING, VllmRuntime, vllm_environment

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.checks import orphans_reaped

pytestmark = pytest.mark.needs_clean_gpus

INNER_TIMEOUT_S = 300  # the inner session starts one engine (~35 s on 2 CPU cores at TP=2)
# An inner test still running after this long dumps every thread's stack into its output (and goes on): a
# hang then leaves something to read, well before the timeout above ends it.
INNER_STACKS_AFTER_S = 150

INNER_TESTS = """
import json
import os
from pathlib import Path

import psutil
import pytest

MODEL = {model!r}
PIDS_FILE = Path({pids_file!r})
ENGINE_ARGS = {engine_args!r}

# A global reference: the engine is never garbage-collected, so vLLM never shuts it down before exit.
_abandoned = []


@pytest.mark.needs_clean_gpus
def test_abandons_engine():
    from vllm import LLM, SamplingParams

    llm = LLM(model=MODEL, tensor_parallel_size={tp}, enforce_eager=True, **ENGINE_ARGS)
    llm.generate([{{"prompt_token_ids": [1, 17, 42]}}], SamplingParams(max_tokens=1), use_tqdm=False)
    _abandoned.append(llm)
    PIDS_FILE.write_text(json.dumps(engine_processes()))


def engine_processes():
    # vLLM names its processes VLLM::EngineCore and VLLM::Worker_TP<n> where setproctitle is installed;
    # without it (seen with CUDA vLLM 0.20.2) they keep the `multiprocessing.spawn` command line, and their
    # place in the tree says what they are: EngineCore is our child, the TP workers are its children.
    engine = []
    for child in psutil.Process().children():
        cmdline = " ".join(child.cmdline())
        if "resource_tracker" in cmdline or not ("VLLM::" in cmdline or "spawn_main" in cmdline):
            continue
        engine.append({{"pid": child.pid, "role": "EngineCore", "cmdline": cmdline}})
        for worker in child.children(recursive=True):
            worker_cmdline = " ".join(worker.cmdline())
            if "resource_tracker" not in worker_cmdline:
                engine.append({{"pid": worker.pid, "role": "worker", "cmdline": worker_cmdline}})
    return engine


@pytest.mark.needs_clean_gpus
def test_next_test_passes():
    # Still the same session: only the plugin can have ended them by now.
    engine = json.loads(PIDS_FILE.read_text())
    alive = [p for p in engine if psutil.pid_exists(p["pid"])
             and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
"""


def _section(output: str, title: str) -> str:
    # The body of one "___ ERROR at teardown of X ___" block of pytest's report.
    match = re.search(rf"_+ {re.escape(title)} _+\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", output, re.S)
    assert match, f"no {title!r} section in:\n{output}"
    return match.group(1)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_abandoned_engine_is_reaped_and_blamed(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    engine_args: dict[str, Any],
    vllm_runtime: VllmRuntime,
) -> None:
    # TP=2 shows orphaned TP workers too; a one-GPU runner still shows the abandoned EngineCore (the case
    # measured on the H200 in GPU-FACTS: 14.8 GB held until killed).
    tp = 1 if vllm_runtime.device == "cuda" and vllm_runtime.gpus < 2 else 2
    for name, value in vllm_environment(tensor_parallel_size=tp).items():
        monkeypatch.setenv(name, value)  # LD_PRELOAD and friends must be set before the engine starts
    pids_file = pytester.path / "engine-pids.json"
    pytester.makepyfile(
        test_inner=INNER_TESTS.format(
            model=str(tiny_model_dir),
            pids_file=str(pids_file),
            engine_args=engine_args,
            tp=tp,
        )
    )

    # runpytest_subprocess sends the inner output to files, not pipes: a leaked EngineCore inherits the inner
    # session's stdout/stderr and could otherwise keep us waiting for EOF forever (GPU-FACTS.md, pipe hazard).
    with orphans_reaped():
        try:
            # faulthandler_timeout: an inner test that hangs dumps every thread's stack into its output.
            result = pytester.runpytest_subprocess(
                "-p",
                "gpuclean",
                "-v",
                "-p",
                "no:cacheprovider",
                "-o",
                f"faulthandler_timeout={INNER_STACKS_AFTER_S}",
                timeout=INNER_TIMEOUT_S,
            )
        except pytester.TimeoutExpired:
            # Show what the inner session had printed: otherwise a hang leaves nothing to go on.
            printed = [(pytester.path / name) for name in ("stdout", "stderr")]
            tails = "\n".join(p.read_text(errors="replace")[-6000:] for p in printed if p.exists())
            pytest.fail(f"inner session still running after {INNER_TIMEOUT_S}s; it printed:\n{tails}")
    output = result.stdout.str() + "\n" + result.stderr.str()

    assert pids_file.exists(), output[-6000:]
    engine = json.loads(pids_file.read_text())
    core_pids = [p["pid"] for p in engine if p["role"] == "EngineCore"]
    assert len(core_pids) == 1, engine
    # With TP=1 the model runs inside EngineCore; with TP=2 in two worker processes.
    assert sum(p["role"] == "worker" for p in engine) == (tp if tp > 1 else 0), engine

    # The first test passed its body and errored in teardown with the plugin's leak report; the second passed.
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_inner.py::test_abandons_engine PASSED*", "*test_inner.py::test_abandons_engine ERROR*"]
    )
    result.stdout.fnmatch_lines(["*test_inner.py::test_next_test_passes PASSED*"])
    report = _section(result.stdout.str(), "ERROR at teardown of test_abandons_engine")
    assert "leaked" in report, report
    assert f"pid {core_pids[0]}" in report, report
    for process in engine:  # the report names every process of the engine, with its command line
        cmdline = " ".join(process["cmdline"].split())  # setproctitle pads the title with spaces
        assert f"pid {process['pid']} " in report and cmdline[:60] in report, (process, report)

    # And nothing of the engine is left running now (pids are not reused that fast).
    deadline = time.monotonic() + 10
    while not all(_gone(p["pid"]) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p["pid"]) for p in engine), (engine, output[-3000:])
