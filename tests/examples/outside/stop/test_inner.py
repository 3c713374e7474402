import os

import pytest


@pytest.mark.needs_clean_gpus(timeout=float(os.environ["MARK_TIMEOUT"]))
@pytest.mark.parametrize("n", range(3))
def test_marked(n):
    pass


def test_unmarked():
    pass
