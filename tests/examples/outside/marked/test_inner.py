import os

import pytest


@pytest.mark.needs_clean_gpus(timeout=float(os.environ["MARK_TIMEOUT"]))
@pytest.mark.parametrize("n", range(int(os.environ["MARKED_TESTS"])))
def test_marked(n):
    pass
