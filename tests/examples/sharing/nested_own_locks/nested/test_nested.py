import pytest


@pytest.mark.needs_clean_gpus
def test_nested(clean_gpus):
    print("NESTED SEES", len(clean_gpus.uuids))
