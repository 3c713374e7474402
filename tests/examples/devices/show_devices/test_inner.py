import os

import pytest


def test_sees(clean_gpus):
    print("SEEN", [(d.index, d.uuid) for d in clean_gpus.devices])


@pytest.mark.needs_clean_gpus(count=1)
def test_count_gets_full_uuid():
    print("VISIBLE", os.environ["CUDA_VISIBLE_DEVICES"])
