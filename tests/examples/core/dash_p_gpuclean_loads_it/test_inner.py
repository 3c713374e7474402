
import pytest


@pytest.mark.needs_clean_gpus
def test_a(clean_gpus):
    assert len(clean_gpus.devices) == 2
