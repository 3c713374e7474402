
import pytest


@pytest.mark.needs_clean_gpus
def test_marked(clean_gpus):
    assert [d.index for d in clean_gpus.devices] == [0, 1]
    assert all(d.used_bytes == 0 and d.total_bytes == 80 * 1024**3 for d in clean_gpus.devices)
    assert all(d.uuid.startswith("GPU-") and d.name == "Simulated GPU" for d in clean_gpus.devices)


def test_fixture_only(clean_gpus):
    assert len(clean_gpus.devices) == 2
