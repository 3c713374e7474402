"""Growth of ``torch.cuda.memory_allocated`` in the pytest process across a test: beyond a floor, a finding
(tensors kept alive); within it, what torch fills once per process and keeps (one session note)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pytest_gpuclean._model.records import MIB

IN_PROCESS_FLOOR_MIB = 64
"""Per device, or the test's tolerance if larger: torch's once-per-process caches (cuBLAS and cuBLASLt
workspaces per stream, the autocast weight cache, lazy constants) fit under it."""
CACHE_GROWTH_PREFIX = "gpuclean: torch memory in the pytest process grew in"


def torch_allocated() -> dict[int, int] | None:
    """``torch.cuda.memory_allocated`` per device; None where torch has not initialised CUDA (never do it
    here)."""
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return {i: int(cuda.memory_allocated(i)) for i in range(cuda.device_count())}


class TorchGrowth:
    """Running totals of the tests whose growth stayed within the floor, so a slow drip across many tests is
    still in plain sight in the one note."""

    __slots__ = ("first", "note_replacing", "tests", "total")

    def __init__(self, note_replacing: Callable[[str, str], None]) -> None:
        self.note_replacing = note_replacing
        self.tests = 0
        self.total: dict[str, float] = {}
        self.first: list[str] = []

    def after(self, nodeid: str, tolerance_mib: int, before: dict[int, int] | None,
              ) -> tuple[tuple[tuple[str, float], ...], int]:
        """A test's growth beyond the floor, per device (empty if none: within it, noted), and the floor."""
        floor = max(tolerance_mib, IN_PROCESS_FLOOR_MIB)
        if before is None:
            return (), floor  # CUDA not initialised before the test: nothing to compare with
        now = torch_allocated()
        if now is None:
            return (), floor
        grown = [(f"cuda:{i}", (now.get(i, 0) - was) / MIB)
                 for i, was in before.items() if now.get(i, 0) > was]
        if not grown:
            return (), floor
        if any(m > floor for _, m in grown):
            return tuple(grown), floor
        self._within(nodeid, grown, floor)
        return (), floor

    def _within(self, nodeid: str, grown: list[tuple[str, float]], floor: int) -> None:
        # Within the floor: not a finding.
        self.tests += 1
        for device, mib in grown:
            self.total[device] = self.total.get(device, 0.0) + mib
        if len(self.first) < 5:
            self.first.append(f"{nodeid} ({', '.join(f'+{m:.1f}' for _, m in grown)})")
        more = self.tests - len(self.first)
        in_all = ", ".join(f"{d} +{m:.1f} MiB" for d, m in self.total.items())
        self.note_replacing(CACHE_GROWTH_PREFIX, (
            f"{CACHE_GROWTH_PREFIX} {self.tests} test(s), within {floor} MiB per device, not "
            f"findings ({in_all} in all: caches torch fills once per process): {', '.join(self.first)}"
            + (f" and {more} more" if more > 0 else "")))
