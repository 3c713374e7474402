
import pytest


@pytest.mark.needs_clean_gpus(timeout=0.2)
def test_meets_a_busy_gpu():
    pass
