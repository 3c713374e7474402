"""Shared by the example suite's tests: settings, tolerances, the HF reference, comparisons, subprocesses.

Imports torch lazily: the conftest imports this module in environments without torch or vLLM, where every
test is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import psutil
import pytest

from example_suite.reaping import wait_and_reap
from example_suite.runtime import VllmRuntime
from example_suite.samples import Prompt, read_sample

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 600  # an offline run starts an engine: 15-60 s on 2 busy CPU cores, ~70 s on an H200

NUM_LAYERS = 4  # TinyLlamaSpec().num_layers
HIDDEN_SIZE = 128  # TinyLlamaSpec().hidden_size
ALL_LAYERS = list(range(NUM_LAYERS + 1))  # 0 (embeddings) .. L (last decoder layer's output, before the norm)
LONG_PROMPT = [1] + [(7 * i + 11) % 250 + 4 for i in range(111)]  # 112 tokens: 4 blocks of 32
MAX_MODEL_LEN = 128  # the longest test prompt has 112 tokens
# The smallest block size CPU vLLM accepts (a multiple of 32): the long prompt then spans 4 KV blocks, and a
# repeat of it hits the prefix cache for 3 of them.
BLOCK_SIZE = 32
# On a GPU, vLLM would otherwise reserve 92% of each card; the tiny model needs a few GB at most.
GPU_MEMORY_UTILIZATION = 0.1


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance of ``torch.testing.assert_close``."""

    atol: float
    rtol: float


# fp32 on the CPU: vLLM and HF run the same math in a slightly different order (measured: at most 5e-6).
# Never loosen these.
CPU_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-4)

# fp32 on a GPU, where vLLM's matmuls run in TF32. Largest |diff| against HF fp32 on the CPU measured on H200s
# with CUDA vLLM 0.20.2 and this tiny model: 2.5e-3 to 3.9e-3 with vLLM's native extraction at TP=1
# (offline and server alike, measured when the suite was written); up to 8.7e-3 at TP=2 with the earlier
# hook-based extraction of the same layers (docs/gpu.md run 7: the error grows with depth and TP changes the
# reduction order).
# atol 2e-2 leaves a factor 2.3 over the worst value ever measured and 5 over the native path's.
GPU_TOLERANCE = Tolerance(atol=2e-2, rtol=1e-2)


@dataclass(frozen=True)
class EngineSettings:
    """What every engine and server of the suite runs with (fp32, so that the comparisons can be tight)."""

    device: str
    dtype: str = "float32"
    max_model_len: int = MAX_MODEL_LEN
    block_size: int = BLOCK_SIZE

    def offline(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``OfflineExtractor``."""
        args: dict[str, Any] = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            # Eager: starts in 13 s instead of 36 s on 2 CPU cores (compilation), and the suite's tiny model
            # gains nothing from compiled graphs.
            "enforce_eager": True,
        }
        if self.device == "cuda":
            args["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        return {**args, **extra}

    def server(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``VllmServer``."""
        extra_args = ["--enforce-eager", "--block-size", str(self.block_size)]
        if self.device == "cuda":
            extra_args += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)]
        return {"dtype": self.dtype, "max_model_len": self.max_model_len, "extra_args": extra_args, **extra}


@dataclass
class Tp1Reference:
    """vLLM's TP=1 states for ``prompts`` at ``ALL_LAYERS``, once some module has computed them."""

    states: list[Any] | None = None


def tolerance(device: str) -> Tolerance:
    """The comparison tolerance for results computed on ``device`` ("cpu" or "cuda")."""
    return GPU_TOLERANCE if device == "cuda" else CPU_TOLERANCE


class HfReference:
    """The tiny model in HF transformers, fp32 on the CPU: residual streams per prompt, cached by ids."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._states: dict[tuple[int, ...], Any] = {}

    @cached_property
    def model(self) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir).eval()  # float32, as saved

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def token_ids(self, text: str) -> list[int]:
        """How the model's tokenizer encodes ``text`` by default (as vLLM does for a text prompt)."""
        return list(self.tokenizer(text)["input_ids"])

    def states(self, token_ids: Sequence[int]) -> Any:
        """HF's ``hidden_states`` for the prompt, stacked: [tokens, L+1, hidden]; entry L is normed."""
        key = tuple(int(t) for t in token_ids)
        if key not in self._states:
            import torch

            with torch.no_grad():
                out = self.model(torch.tensor([list(key)]), output_hidden_states=True)
            self._states[key] = torch.stack([h[0] for h in out.hidden_states], dim=1)
        return self._states[key]

    def checkpoint_embeddings(self, token_ids: Sequence[int]) -> Any:
        """The embedding rows of ``token_ids`` read from the checkpoint file itself (not through HF)."""
        from safetensors import safe_open

        with safe_open(str(self.model_dir / "model.safetensors"), framework="pt") as f:
            return f.get_tensor("model.embed_tokens.weight")[list(token_ids)]

    def final_norm(self, hidden: Any) -> Any:
        """HF's final RMSNorm (``model.model.norm``) applied to ``hidden``, on the CPU in fp32."""
        import torch

        with torch.no_grad():
            return self.model.model.norm(hidden.to("cpu", torch.float32))


def assert_close(actual: Any, expected: Any, tol: Tolerance, what: str) -> float:
    """``torch.testing.assert_close`` with a message naming what was compared and the largest difference.

    Returns the largest absolute difference, so that tests can report the margin they passed with.
    """
    import torch

    largest = float((actual - expected).abs().max().item())

    def message(detail: str) -> str:
        return f"{what}: max |diff| {largest:.3g}\n{detail}"

    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol, msg=message)
    return largest


def assert_matches_hf(
    hidden: Any,
    token_ids: Sequence[int],
    layer_ids: Sequence[int],
    hf: HfReference,
    tol: Tolerance,
    what: str,
    largest: dict[str, float],
) -> None:
    """Every layer of one extracted sample against HF, keeping the largest |diff| per layer id in ``largest``.

    Id k < L against HF's ``hidden_states[k]``; id L (before the final norm) after applying HF's final norm,
    against HF's last entry.
    """
    assert hidden.shape[:2] == (len(token_ids), len(layer_ids)), (tuple(hidden.shape), len(layer_ids))
    expected = hf.states(token_ids)
    for column, layer_id in enumerate(layer_ids):
        actual = hidden[:, column].float()
        if layer_id == NUM_LAYERS:
            actual = hf.final_norm(actual)
        label = f"id {layer_id}" + (" (normed)" if layer_id == NUM_LAYERS else "")
        diff = assert_close(actual, expected[:, layer_id], tol, f"{what}, layer {label} vs HF")
        largest[label] = max(largest.get(label, 0.0), diff)


def assert_files_match_hf(
    paths: Sequence[Path],
    layer_ids: Sequence[int],
    hf: HfReference,
    tol: Tolerance,
    prompts: Sequence[Prompt] | None = None,
) -> dict[str, float]:
    """Output files (prompt i's at place i) against HF at every id; returns the largest |diff| per id.

    With ``prompts``, each file's token ids must be its prompt's (a text's: as the tokenizer encodes it).
    """
    largest: dict[str, float] = {}
    for index, path in enumerate(paths):
        sample = read_sample(path)
        assert sample.layer_ids == list(layer_ids), (index, sample.layer_ids)
        if prompts is not None:
            prompt = prompts[index]
            expected_ids = hf.token_ids(prompt) if isinstance(prompt, str) else prompt
            assert sample.token_ids == expected_ids, (index, sample.token_ids)
        assert_matches_hf(
            sample.hidden_states, sample.token_ids, layer_ids, hf, tol, f"prompt {index}", largest
        )
    return largest


def assert_files_match(
    paths: Sequence[Path], expected: Sequence[Any], tol: Tolerance, what: str
) -> dict[str, float]:
    """Output files against other states of the same prompts (``expected[i]`` for prompt i); returns the
    largest |diff| per prompt."""
    return {
        f"prompt {index}": assert_close(
            read_sample(path).hidden_states, states, tol, f"prompt {index}: {what}"
        )
        for index, (path, states) in enumerate(zip(paths, expected, strict=True))
    }


def report_margins(node: pytest.Item, what: str, largest: dict[str, float], tol: Tolerance) -> None:
    """Print, and keep as the test's ``max_abs_diff`` user property, the largest difference per item."""
    worst = max(largest.values())
    shown = ", ".join(f"{name} {value:.3g}" for name, value in largest.items())
    print(f"{what}: max |diff| {shown}; worst {worst:.3g} against atol {tol.atol:g}")
    # user_properties rather than the record_property fixture, which warns under JUnit's xunit2 family.
    node.user_properties.append(("max_abs_diff", f"{worst:.3g}"))


@contextmanager
def orphans_reaped(grace_s: float = 10.0) -> Iterator[None]:
    """Around running a subprocess: afterwards, wait for those of its descendants re-parented to this process.

    gpuclean makes pytest a child subreaper, so orphans of a subprocess become our children instead of init's.
    One always appears: a subprocess that used multiprocessing's spawn (vLLM does) has a resource tracker that
    exits by itself just after the subprocess, and then stays our zombie until someone waits for it. A new
    child still running after ``grace_s`` is a real leak: it is left to gpuclean, not killed.
    """
    known_children = {c.pid for c in psutil.Process().children()}
    try:
        yield
    finally:
        orphans = [c for c in psutil.Process().children() if c.pid not in known_children]
        wait_and_reap(orphans, grace_s, kill_survivors=False)


@dataclass(frozen=True)
class CliRun:
    """Exit status and output (stdout and stderr together) of a command-line run."""

    returncode: int
    output: str


def run_cli(arguments: list[str], log_path: Path, timeout_s: float = CLI_TIMEOUT_S) -> CliRun:
    """``python -m example_suite.extract ARGS`` in a subprocess, its output to a file (never a pipe)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    with log_path.open("wb") as log, orphans_reaped():
        completed = subprocess.run(
            [sys.executable, "-m", "example_suite.extract", *arguments],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    return CliRun(completed.returncode, log_path.read_text(errors="replace"))


INNER_TIMEOUT_S = 420  # an inner session starts one engine or server: 15-110 s on 2 busy CPU cores
# An inner test still running after this long dumps every thread's stack into its output (and goes on): a
# hang then leaves something to read, well before the timeout above ends it.
INNER_STACKS_AFTER_S = 240


def run_inner_session(pytester: pytest.Pytester) -> pytest.RunResult:
    """Run the inner test file under gpuclean in a subprocess; reap its orphaned zombies afterwards.

    ``runpytest_subprocess`` sends the inner output to files, not pipes: a leaked EngineCore inherits the
    inner session's stdout/stderr and could otherwise keep us waiting for EOF forever (seen on an H200 when
    the suite was written).
    """
    with orphans_reaped():
        try:
            return pytester.runpytest_subprocess(
                "-p", "gpuclean", "-v", "-p", "no:cacheprovider",
                "-o", f"faulthandler_timeout={INNER_STACKS_AFTER_S}",
                timeout=INNER_TIMEOUT_S,
            )  # fmt: skip
        except pytester.TimeoutExpired:
            # Show what the inner session had printed: otherwise a hang leaves nothing to go on.
            printed = [(pytester.path / name) for name in ("stdout", "stderr")]
            tails = "\n".join(p.read_text(errors="replace")[-6000:] for p in printed if p.exists())
            pytest.fail(f"inner session still running after {INNER_TIMEOUT_S}s; it printed:\n{tails}")


# An inner test file that leaves an engine behind (test_abandoned_engine.py, test_server_crash.py): this
# prelude, the file's own first test (which writes ``{"engine": [{"pid", "cmdline", ...}], ...}`` to
# PIDS_FILE), then INNER_NEXT_TEST.
INNER_PRELUDE = """
import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, {repo!r})
PIDS_FILE = Path({pids_file!r})
"""

INNER_NEXT_TEST = """

@pytest.mark.needs_clean_gpus
def test_next_test_passes():
    # Still the same session: only the plugin can have ended them by now.
    engine = json.loads(PIDS_FILE.read_text())["engine"]
    alive = [p for p in engine if psutil.pid_exists(p["pid"])
             and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
"""


@dataclass(frozen=True)
class InnerSession:
    """An inner session whose first test left an engine behind: its result, output and PIDS_FILE."""

    result: pytest.RunResult
    output: str
    pids_file: Path

    def recorded(self) -> dict[str, Any]:
        """What the first inner test wrote to PIDS_FILE (fails the test, with the output, if nothing)."""
        import json

        assert self.pids_file.exists(), self.output[-6000:]
        return dict(json.loads(self.pids_file.read_text()))


def leaving_tp(runtime: VllmRuntime) -> int:
    """TP size of the engine an inner test leaves behind: 2 (orphaned workers too) unless only one GPU."""
    return 1 if runtime.device == "cuda" and runtime.gpus < 2 else 2


def run_leaving_session(pytester: pytest.Pytester, first_test: str, **fields: Any) -> InnerSession:
    """Run INNER_PRELUDE + ``first_test`` (formatted with ``fields``) + INNER_NEXT_TEST under gpuclean."""
    pids_file = pytester.path / "engine-pids.json"
    prelude = INNER_PRELUDE.format(repo=str(REPO_ROOT), pids_file=str(pids_file))
    pytester.makepyfile(test_inner=prelude + first_test.format(**fields) + INNER_NEXT_TEST)
    result = run_inner_session(pytester)
    return InnerSession(result, result.stdout.str() + "\n" + result.stderr.str(), pids_file)


def assert_engine_reaped_and_blamed(
    session: InnerSession, test_name: str, engine: list[dict[str, Any]]
) -> None:
    """:func:`assert_leak_reaped_and_blamed`, and every process of ``engine`` gone by now."""
    assert_leak_reaped_and_blamed(session.result, test_name, engine)
    # Nothing of the engine is left running now (pids are not reused that fast).
    deadline = time.monotonic() + 10
    while not all(gone(p["pid"]) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(p["pid"]) for p in engine), (engine, session.output[-3000:])


def report_section(output: str, title: str) -> str:
    """The body of one ``___ TITLE ___`` block of pytest's report, e.g. "ERROR at teardown of test_x"."""
    import re

    match = re.search(rf"_+ {re.escape(title)} _+\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", output, re.S)
    assert match, f"no {title!r} section in:\n{output}"
    return match.group(1)


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie counts as gone: it holds no memory)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_leak_reaped_and_blamed(
    result: pytest.RunResult, test_name: str, processes: list[dict[str, Any]]
) -> None:
    """The inner ``test_name`` passed its body, errored at teardown naming every one of ``processes``
    (``{"pid", "cmdline"}``) as leaked, and the inner ``test_next_test_passes`` passed."""
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [f"*test_inner.py::{test_name} PASSED*", f"*test_inner.py::{test_name} ERROR*"]
    )
    result.stdout.fnmatch_lines(["*test_inner.py::test_next_test_passes PASSED*"])
    report = report_section(result.stdout.str(), f"ERROR at teardown of {test_name}")
    assert "leaked" in report, report
    for process in processes:  # the report names each process with its command line
        cmdline = " ".join(process["cmdline"].split())  # setproctitle pads the title with spaces
        assert f"pid {process['pid']} " in report and cmdline[:60] in report, (process, report)


def remove_engine_debris(pids: set[int], directories: Sequence[str]) -> None:
    """After a test killed or abandoned an engine: remove what its processes could not clean up themselves.

    ``directories`` (a server's private directory, an extractor's staging directory) and, on CPU, the
    OpenMP registrations ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_*`` of exactly ``pids``; only once none of
    ``pids`` runs any more.
    """
    import shutil

    from example_suite.runtime import openmp_registrations

    if not all(gone(pid) for pid in pids):
        return
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    for entry in openmp_registrations(pids):
        entry.unlink(missing_ok=True)
