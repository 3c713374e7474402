import pytest


@pytest.mark.needs_clean_gpus
def test_a(engine):
    pass


@pytest.mark.needs_clean_gpus
def test_b():
    pass
