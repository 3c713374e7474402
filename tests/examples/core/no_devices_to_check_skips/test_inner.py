
import pytest


@pytest.mark.needs_clean_gpus
def test_gpu():
    pass


def test_cpu():
    pass
