"""Helpers of the real-GPU tests (tests/gpu): what NVML says now, and whether a process still runs."""

from __future__ import annotations

from pytest_gpuclean.core.reading.nvml import NvmlBackend


def used_mib() -> float:
    """GPU memory in use on every device, as NVML's v2 ``used`` says now."""
    backend = NvmlBackend()
    try:
        return sum(backend.snapshot(d).used_bytes for d in backend.devices()) / 2**20
    finally:
        backend.close()


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie, or one being removed, holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
