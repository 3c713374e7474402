"""Open MPI's singleton start, as libmpi does it: the process that calls MPI_Init without mpirun forks
a daemon (``orted --hnp --set-sid ... --singleton-died-pipe FD``) in a session of its own, hands it the read
end of a pipe, keeps the write end for its life, and the daemon exits when that pipe closes. Lightning's
environment detection (``import mpi4py.MPI``) does this in the pytest process (docs/compat.md)."""

import os
import subprocess
import sys

import pytest

DAEMON = r"""
import os, sys
fd = int(sys.argv[sys.argv.index("--singleton-died-pipe") + 1])
while os.read(fd, 1):  # the singleton's end closed: EOF
    pass
"""

_daemon = None
_kept = None  # the singleton's end of the pipe, kept for the process's life


def start(kept_by_me: bool):
    read_end, write_end = os.pipe()
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, "--hnp", "--set-sid", "--singleton-died-pipe", str(read_end)],
        pass_fds=(read_end,), start_new_session=True)
    os.close(read_end)
    with open(os.environ["LEAK_PIDFILE"], "a") as f:
        f.write(f"{daemon.pid}\n")
    if kept_by_me:
        return daemon, write_end
    # The write end held by another child instead (a rank that outlives its test): no evidence for the daemon.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(write_end,))
    os.close(write_end)
    with open(os.environ["LEAK_PIDFILE"], "a") as f:
        f.write(f"{holder.pid}\n")
    return daemon, None


def mpi_init():
    global _daemon, _kept
    if _daemon is None:
        _daemon, _kept = start(kept_by_me=True)
    return _daemon


@pytest.mark.needs_clean_gpus
def test_first_mpi_init_starts_the_daemon():
    assert mpi_init().poll() is None


@pytest.mark.needs_clean_gpus
def test_later_test_still_has_it():
    assert mpi_init().poll() is None


@pytest.mark.skipif(os.environ.get("MPI_NEGATIVE") != "1", reason="the negative case only when asked")
@pytest.mark.needs_clean_gpus
def test_a_daemon_whose_pipe_another_child_holds():
    daemon, _ = start(kept_by_me=False)
    assert daemon.poll() is None
