import os


def test_plain():
    pass

def test_other():
    pass


def test_cookie():
    # What a test or fixture starts carries the session's cookie even while nothing is checked.
    assert os.environ["GPUCLEAN_TEST"].endswith(":session")
