# GPU 0 holds 10 MiB of an ignored process from outside the session (the test's holder); the session's own
# timeout and tolerance, set globally, are longer and tighter than these markers'.
import pytest


@pytest.mark.needs_clean_gpus(timeout=0.5)
def test_waits_its_own_timeout():
    raise AssertionError("must not run on dirty GPUs")


@pytest.mark.needs_clean_gpus(tolerance_mib=20)
def test_within_its_own_tolerance():
    pass
