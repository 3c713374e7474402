import pytest


@pytest.mark.needs_clean_gpus
def test_one():
    pass


@pytest.mark.needs_clean_gpus
def test_two():
    pass
