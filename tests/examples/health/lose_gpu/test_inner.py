import os

import pytest

from pytest_gpuclean import simulate

SIM = os.environ["GPUCLEAN_SIMULATE"]
# How GPU 0 is lost ($HOW).
LOSE = {"lost file": lambda: simulate.set_state(SIM, 0, "lost", "fallen off the bus"),
        "xid 79": lambda: simulate.xid(SIM, 0, 79),
        "vanished": lambda: os.rename(os.path.join(SIM, "0"), os.path.join(SIM, "gone"))}


@pytest.mark.needs_clean_gpus
def test_loses_it():
    LOSE[os.environ["HOW"]]()


@pytest.mark.needs_clean_gpus
def test_never_runs():
    pass
