"""Run 68 diagnostic: torch.cuda.memory_allocated after each test, before and after gc.collect() (a plugin,
`-p diag_growth`; run68.sh copies it next to the suite)."""
import gc
import sys

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    before = torch.cuda.memory_allocated(0)
    collected = gc.collect()
    after = torch.cuda.memory_allocated(0)
    print(f"\nDIAG {item.nodeid}: allocated {before / 2**20:.1f} MiB, after gc ({collected} objects) "
          f"{after / 2**20:.1f} MiB, reserved {torch.cuda.memory_reserved(0) / 2**20:.1f} MiB", flush=True)
