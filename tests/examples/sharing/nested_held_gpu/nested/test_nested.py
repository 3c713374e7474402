import pytest


@pytest.mark.needs_clean_gpus
def test_nested(clean_gpus):
    print("NESTED SEES", ",".join(clean_gpus.uuids))
