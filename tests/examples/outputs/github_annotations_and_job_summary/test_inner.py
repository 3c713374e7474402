
import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("x", [1], ids=["50%:a\nb,c"])
def test_weird(x):
    hold(mib=64)
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_clean():
    pass
