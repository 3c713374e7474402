import os
import time

import pytest

from pytest_gpuclean._locks.gpus import GpuLocks


@pytest.mark.needs_clean_gpus
def test_after_kill(clean_gpus):
    print("WAITED", (time.monotonic_ns() - int(os.environ["LOGSTART_NS"])) / 1e9)
    locks = GpuLocks(os.environ["LOCK_DIR"])
    # The killed session's holder records are stale; ours are the newest.
    recorded = [locks.holder(uuid) for uuid in clean_gpus.uuids]
    assert [r.pid if r else None for r in recorded] == [os.getpid()] * 2
