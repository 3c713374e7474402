import pytest


@pytest.mark.needs_clean_gpus(timeout=30)
def test_marked():
    pass
