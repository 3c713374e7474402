import os
import signal
import time

import pytest
from prelude import SIM

from pytest_gpuclean.simulate import allocate

marked = pytest.mark.needs_clean_gpus(timeout=float(os.environ["MARK_TIMEOUT"]))


def kill(pid):
    # Gone means gone: dead (a zombie of the test that started it, here), not merely signalled.
    os.kill(pid, signal.SIGKILL)
    stat = f"/proc/{pid}/stat"
    while os.path.exists(stat) and open(stat).read().rsplit(")")[1].split()[0] != "Z":
        time.sleep(0.01)


@marked
def test_1():
    pass


@marked
def test_2_same():
    pass


def test_3_outside_holder_grows():
    allocate(SIM, 0, 300, pid=int(os.environ["FIRST_HOLDER"]))


@marked
def test_4_more_memory():
    pass


@marked
def test_5_same():
    pass


def test_6_another_holder_with_the_same_memory():
    kill(int(os.environ["FIRST_HOLDER"]))
    open(os.environ["GO"], "w").close()
    while not (os.path.exists(os.environ["LATER_PIDFILE"]) and open(os.environ["LATER_PIDFILE"]).read()):
        time.sleep(0.01)


@marked
def test_7_new_holder():
    pass


def test_8_holder_gone():
    kill(int(open(os.environ["LATER_PIDFILE"]).read()))


@marked
def test_9_clean_again(clean_gpus):
    assert [d.used_bytes for d in clean_gpus.devices] == [0, 0]
