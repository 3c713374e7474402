import sys
import types

import pytest

allocated = {0: 1024 * 1024}
cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 1,
                             memory_allocated=lambda i: allocated[i])
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)


@pytest.mark.needs_clean_gpus
def test_keeps_tensors_alive():
    allocated[0] += 64 * 1024 * 1024


@pytest.mark.needs_clean_gpus
def test_frees_what_it_allocates():
    pass
