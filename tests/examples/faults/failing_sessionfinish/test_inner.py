from prelude import hold, wait_holders


def test_unmarked_leak():
    hold(mib=8)
    wait_holders(1)
