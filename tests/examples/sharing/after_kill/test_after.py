import os
import time

import pytest

from pytest_gpuclean.core.locks.locks import GpuLocks


@pytest.mark.needs_clean_gpus
def test_after_kill(clean_gpus):
    print("WAITED", (time.monotonic_ns() - int(os.environ["LOGSTART_NS"])) / 1e9)
    locks = GpuLocks(os.environ["LOCK_DIR"])
    # The killed session's holder records are stale; ours are the newest.
    assert [locks.holder(uuid)["pid"] for uuid in clean_gpus.uuids] == [os.getpid()] * 2
