import os

import pytest


@pytest.mark.needs_clean_gpus
def test_uses_both(server, engine):
    pass


@pytest.mark.skipif(os.environ.get("LAST") == "skipped", reason="the module ends with a skipped test")
@pytest.mark.needs_clean_gpus
def test_marked_last():
    pass


@pytest.mark.skipif(os.environ.get("LAST") == "skipped", reason="the module ends with a skipped test")
def test_unmarked_last():
    pass
