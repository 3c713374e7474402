import pytest


@pytest.mark.needs_clean_gpus(count=1)
def test_wants_one():
    pass
