# Every way a test can leak a process: $LEAK names the way, $HOLDERS how many pids the leak writes.
import os
import subprocess
import sys

import pytest
from prelude import PIDFILE, SIM, hold, script, wait_holders


def plain_child():
    hold(mib=64)


def grandchild_of_exited_parent():
    subprocess.run(['sh', '-c', ' '.join([sys.executable, '-m', 'pytest_gpuclean.simulate', 'hold', '--dir',
                                          SIM, '--mib', '8', '--pidfile', PIDFILE, '&'])], check=True)


def setsid_double_fork_daemon():
    hold('--daemonize', mib=16)


def scrubbed_environment():
    hold(mib=4, prefix=['env', '-i'])


def ignores_sigterm():
    hold('--ignore-sigterm', mib=32)


def deep_tree_20():
    subprocess.Popen([sys.executable, script("chain.py"), PIDFILE, '20'])


def wide_tree_100():
    hold('--children', '99', mib=1)


@pytest.mark.needs_clean_gpus
def test_leak():
    globals()[os.environ["LEAK"]]()
    wait_holders(int(os.environ["HOLDERS"]))


@pytest.mark.needs_clean_gpus
def test_next():
    pass
