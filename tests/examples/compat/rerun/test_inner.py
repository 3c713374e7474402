import os

from prelude import hold, wait_holders

ATTEMPTS = os.environ["ATTEMPTS"]


def test_flaky():
    with open(ATTEMPTS, "a") as f:
        f.write("x")
    if len(open(ATTEMPTS).read()) == 1:
        hold(mib=100)
        wait_holders(1)
        raise AssertionError("first attempt fails")


def test_steady():
    pass
