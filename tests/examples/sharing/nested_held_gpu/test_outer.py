import os
import subprocess
import sys

import pytest

from pytest_gpuclean._locks.held import HELD_VAR


@pytest.mark.needs_clean_gpus(count=1)
def test_runs_a_nested_session():
    nested = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider", "-s",
         f"--gpuclean-simulate={os.environ['NESTED_SIM']}",
         f"--gpuclean-lock-dir={os.environ['NESTED_LOCK_DIR']}",
         "--gpuclean-lock-timeout=5"],
        cwd=os.path.join(os.path.dirname(__file__), "nested"), capture_output=True, text=True)
    assert nested.returncode == 0, nested.stdout
    assert "NESTED SEES " + os.environ["CUDA_VISIBLE_DEVICES"] + "\n" in nested.stdout


def test_nothing_held_afterwards():
    assert HELD_VAR not in os.environ
