import os
import subprocess
import sys

import pytest


@pytest.mark.needs_clean_gpus
def test_runs_a_nested_session():
    nested = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "gpuclean", "-p", "no:cacheprovider", "-s",
         "--gpuclean-lock-timeout=5"],
        cwd=os.path.join(os.path.dirname(__file__), "nested"), capture_output=True, text=True,
        env=dict(os.environ, GPUCLEAN_SIMULATE=os.environ["NESTED_SIM"],
                 GPUCLEAN_LOCK_DIR=os.environ["NESTED_LOCK_DIR"]))
    assert nested.returncode == 0, nested.stdout
    assert "NESTED SEES 2\n" in nested.stdout
    assert "waits for GPU lock" not in nested.stdout, nested.stdout
