import pytest


@pytest.mark.needs_clean_gpus(timeout=1)
def test_next():
    pass
