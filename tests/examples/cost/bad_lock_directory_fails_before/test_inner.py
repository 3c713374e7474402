
import pytest
from prelude import hold


def test_unmarked_first():
    hold(mib=1)


@pytest.mark.needs_clean_gpus
def test_checked():
    pass
