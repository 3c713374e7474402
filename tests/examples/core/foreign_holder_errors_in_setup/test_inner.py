
import pytest


@pytest.mark.needs_clean_gpus(timeout=0.5)
def test_victim():
    raise AssertionError("must not run on dirty GPUs")


def test_unmarked_runs():
    pass
