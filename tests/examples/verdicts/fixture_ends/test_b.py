import os

import pytest


@pytest.mark.needs_clean_gpus
def test_next_module():
    pass


def test_unmarked_very_last():
    assert os.environ.get("LAST") != "failed", "the session's last test fails"
