import pytest

pytestmark = pytest.mark.needs_clean_gpus


@pytest.mark.parametrize("i", range(40))
def test_clean(i):
    pass


def test_fixture(clean_gpus):
    assert [d.used_bytes for d in clean_gpus.devices] == [0, 0]
