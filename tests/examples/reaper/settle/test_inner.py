import os

import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_leaves_a_short_lived_helper():
    # BUSY: the helper works until it exits (a resource tracker cleaning up after its client); otherwise
    # it sleeps, waiting for nothing the test will do.
    hold("--seconds", os.environ["LIFETIME"], *(["--busy"] if os.environ.get("BUSY") else []), mib=1)
    wait_holders(1)
