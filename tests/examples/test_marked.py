# One checked test, which passes.
import pytest


@pytest.mark.needs_clean_gpus
def test_gpu():
    pass
