
from prelude import hold, wait_holders


def test_unmarked_leak():
    hold(mib=1)
    wait_holders(1)
