import subprocess
import sys

import pytest
from prelude import hold, wait_holders


@pytest.mark.xdist_group("engine")
@pytest.mark.parametrize("n", range(3))
def test_grouped(n):
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.xdist_group("engine")
def test_grouped_leaks():
    hold(mib=100)
    wait_holders(1)


@pytest.mark.needs_clean_gpus
@pytest.mark.parametrize("n", range(3))
def test_free(n):
    pass
