import os

import pytest
from prelude import hold, wait_holders


@pytest.mark.needs_clean_gpus
def test_leaves_a_short_lived_helper():
    hold("--seconds", os.environ["LIFETIME"], mib=1)
    wait_holders(1)
