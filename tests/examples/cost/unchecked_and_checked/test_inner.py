import pytest


def test_plain():
    pass

def test_other():
    pass


@pytest.mark.needs_clean_gpus
def test_checked():
    pass
