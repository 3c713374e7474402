"""Helpers of the real-GPU tests (tests/gpu): what NVML says now, whether a process still runs, the first
whole GPU and a torch process that holds memory on it."""

from __future__ import annotations

from pytest_gpuclean._model.records import DeviceInfo
from pytest_gpuclean._reading.nvml import NvmlBackend

TORCH_HOLDER = r'''
import sys, time
import torch
block = torch.empty(int(sys.argv[1]) * 1024 * 1024, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
with open(sys.argv[2], "w") as f:
    f.write("ready")
time.sleep(3600)
'''
"""A CUDA process for ``python -c``: holds argv[1] MiB through torch, then writes 'ready' to argv[2]."""


def first_whole_gpu() -> DeviceInfo:
    """The first whole GPU NVML lists (a MIG slice would work too, but then CUDA_VISIBLE_DEVICES needs its MIG
    UUID)."""
    backend = NvmlBackend()
    try:
        return next(d for d in backend.devices() if d.mig_index is None)
    finally:
        backend.close()


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
