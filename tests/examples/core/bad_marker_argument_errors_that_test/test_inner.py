
import pytest


@pytest.mark.needs_clean_gpus(tolerance_mib=-5)
def test_bad():
    pass


@pytest.mark.needs_clean_gpus(timeuot=3)
def test_typo():
    pass


@pytest.mark.needs_clean_gpus(2)
def test_positional():
    pass
