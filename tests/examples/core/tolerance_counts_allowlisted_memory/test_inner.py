
import pytest


@pytest.mark.needs_clean_gpus(tolerance_mib=150, timeout=0.2)
def test_marker_tolerance():
    pass
