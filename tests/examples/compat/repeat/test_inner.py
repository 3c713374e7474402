import time

from prelude import hold


def test_leaks():
    hold(mib=10)
    time.sleep(0.1)
