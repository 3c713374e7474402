"""torch's memory in the pytest process across a test: growth of ``torch.cuda.memory_allocated`` beyond a
floor is a finding (tensors kept alive after the test); growth within it is what torch fills once per
process and keeps, one note for the session."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pytest_gpuclean._model.records import MIB

IN_PROCESS_FLOOR_MIB = 64
"""Growth of ``torch.cuda.memory_allocated`` in the pytest process up to this (or the test's tolerance, if
larger) on each device is not a finding: torch fills caches once per process and keeps them (a cuBLAS and
a cuBLASLt workspace per stream, the autocast weight cache, lazily made constants; README)."""
CACHE_GROWTH_PREFIX = "gpuclean: torch memory in the pytest process grew in"


def torch_allocated() -> dict[int, int] | None:
    """``torch.cuda.memory_allocated`` per device, or None where torch has not initialised CUDA in this
    process (never initialise it)."""
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return {i: int(cuda.memory_allocated(i)) for i in range(cuda.device_count())}


class TorchGrowth:
    """The session's tests whose in-process growth stayed within the floor: how many, the growth per device
    in all, the first few (named in the note, which ``note_replacing`` rewrites as tests add to it, so a
    slow drip across many tests is still in plain sight; running totals: a session may have thousands)."""

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
            return (), floor  # (torch had not initialised CUDA before the test: nothing to compare with)
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
        # Not a finding: what torch fills once per process and keeps (cuBLAS workspaces, the autocast cache,
        # lazily made constants).
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
