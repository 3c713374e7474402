"""Shared by the example suite's tests: tolerances, the file format check, reaping a subprocess's orphans."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from example_suite.reaping import wait_and_reap


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance of ``torch.testing.assert_close``."""

    atol: float
    rtol: float


# fp32 on the CPU: vLLM and HF run the same math in a slightly different order. Never loosen these.
CPU_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-4)

# fp32 on a GPU, where vLLM's matmuls run in TF32. Measured with this suite on H200s (CUDA vLLM 0.20.2,
# docs/gpu.md run 7), largest |diff| per layer against HF fp32 on the CPU: 0 (embeddings), 2.5e-3, 4.1e-3,
# 6.5e-3, 8.6e-3 (last layer) at TP=1; worst 8.7e-3 at TP=2; TP=2 vs TP=1 worst 1.0e-3. The error grows
# with depth, so atol 2e-2 leaves a factor 2.3 over the worst layer measured (1e-2 left only 1.15).
GPU_TOLERANCE = Tolerance(atol=2e-2, rtol=1e-2)


def tolerance(device: str) -> Tolerance:
    """The comparison tolerance for results computed on ``device`` ("cpu" or "cuda")."""
    return GPU_TOLERANCE if device == "cuda" else CPU_TOLERANCE


def load_checked(
    path: Path, prompt: Sequence[int], layer_ids: Sequence[int], hidden_size: int
) -> torch.Tensor:
    """Load one extracted file, assert its format, and return ``hidden_states`` [seq, n_layers, hidden]."""
    tensors = load_file(str(path))
    assert set(tensors) == {"input_ids", "hidden_states", "layer_ids"}, sorted(tensors)
    assert tensors["input_ids"].dtype == torch.int64
    assert tensors["input_ids"].tolist() == list(prompt)
    assert tensors["layer_ids"].dtype == torch.int64
    assert tensors["layer_ids"].tolist() == list(layer_ids)
    hidden = tensors["hidden_states"]
    assert hidden.dtype == torch.float32  # the suite runs the model in fp32
    assert tuple(hidden.shape) == (len(prompt), len(layer_ids), hidden_size)
    return hidden


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str) -> float:
    """``torch.testing.assert_close`` with a message naming what was compared and the largest difference.

    Returns the largest absolute difference, so that tests can report the margin they passed with: that is
    how the GPU tolerance below was chosen.
    """
    largest = float((actual - expected).abs().max().item())

    def message(detail: str) -> str:
        return f"{what}: max |diff| {largest:.3g}\n{detail}"

    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol, msg=message)
    return largest


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
    exits by itself just after the subprocess, and then stays our zombie until someone waits for it (gpuclean
    collects such zombies and mentions them; early versions counted them as the test's leak). A new child
    still running after ``grace_s`` is a real leak: it is left to gpuclean, not killed.
    """
    known_children = {c.pid for c in psutil.Process().children()}
    try:
        yield
    finally:
        orphans = [c for c in psutil.Process().children() if c.pid not in known_children]
        wait_and_reap(orphans, grace_s, kill_survivors=False)
