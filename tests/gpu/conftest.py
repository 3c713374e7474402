"""Real-GPU tests: skipped unless NVML answers (run them on the H200, see docs/gpu.md)."""

from __future__ import annotations

import pytest


def _nvml_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"no NVIDIA driver/NVML: {exc}"
    return None if count else "NVML sees no GPU"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = _nvml_reason()
    if reason is None:
        return
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.skip(reason=f"real-GPU test: {reason}"))
