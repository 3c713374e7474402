import pytest


@pytest.mark.needs_clean_gpus
def test_c():
    pass


@pytest.mark.needs_clean_gpus
def test_d():
    pass
