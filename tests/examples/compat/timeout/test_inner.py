import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_spawns_and_waits():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_plain():
    pass
