
from prelude import hold, wait_holders


def test_plain():
    pass


def test_late():
    hold(mib=2)
    wait_holders(1)


def test_plain_again():
    pass
