"""Left out by `-- tests --ignore=tests/test_ignored.py`: it would fail."""


def test_never_runs() -> None:
    raise AssertionError("run_peers.py dir passed pytest's --ignore on")
