import pytest


@pytest.mark.needs_clean_gpus
def test_checked():
    pass
