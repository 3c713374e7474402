import os
import time

import pytest
from prelude import alive

OLDER_PIDS, GO = os.environ["OLDER_PIDS"], os.environ["OLDER_GO"]


@pytest.mark.needs_clean_gpus
def test_asks_the_older_process_to_double_fork():
    open(GO, "w").close()
    deadline = time.monotonic() + 30
    while len(open(OLDER_PIDS).read().split()) < 2:
        assert time.monotonic() < deadline, "the older process started no daemon"
        time.sleep(0.01)


@pytest.mark.needs_clean_gpus
def test_finds_the_daemon():
    assert alive(int(open(OLDER_PIDS).read().split()[1])), "the older process's daemon is gone"
