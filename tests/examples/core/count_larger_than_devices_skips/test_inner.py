
import pytest


@pytest.mark.needs_clean_gpus(count=3)
def test_three():
    pass
