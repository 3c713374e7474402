import json
import os

import pytest


@pytest.mark.needs_clean_gpus
def test_one():
    pass


@pytest.mark.needs_clean_gpus(count=2)
def test_wants_both_gpus(clean_gpus):
    with open(os.environ["SEEN"], "w") as f:
        json.dump([[d.index, d.used_bytes] for d in clean_gpus.devices], f)


@pytest.mark.needs_clean_gpus(count=2)
def test_wants_both_again():
    pass
