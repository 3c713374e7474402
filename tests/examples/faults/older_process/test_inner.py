import os
import time

import pytest

OLDER_PIDS, GO = os.environ["OLDER_PIDS"], os.environ["OLDER_GO"]


@pytest.mark.needs_clean_gpus
def test_asks_the_older_process_for_a_child():
    open(GO, "w").close()
    deadline = time.monotonic() + 30
    while len(open(OLDER_PIDS).read().split()) < 3:
        assert time.monotonic() < deadline, "the older process started no child"
        time.sleep(0.01)


@pytest.mark.needs_clean_gpus
def test_next():
    pass
