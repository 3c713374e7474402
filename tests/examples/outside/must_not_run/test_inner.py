import os

import pytest

TIMEOUT = float(os.environ["MARK_TIMEOUT"])


@pytest.mark.needs_clean_gpus(timeout=TIMEOUT)
@pytest.mark.parametrize("n", range(4))
def test_marked(n):
    raise AssertionError("must not run on dirty GPUs")
