import sys
import types

import pytest

MIB = 1024 * 1024
allocated = {0: MIB}
cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 1,
                             memory_allocated=lambda i: allocated[i])
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)


@pytest.mark.needs_clean_gpus
def test_keeps_tensors_alive():
    allocated[0] += 100 * MIB


@pytest.mark.needs_clean_gpus
def test_frees_what_it_allocates():
    pass


@pytest.mark.needs_clean_gpus
def test_fills_a_workspace():
    allocated[0] += 33 * MIB  # a cuBLAS and a cuBLASLt workspace, kept for the process's life


@pytest.mark.needs_clean_gpus
def test_makes_a_constant():
    allocated[0] += 4096  # a lazily made constant tensor


@pytest.mark.needs_clean_gpus(tolerance_mib=200)
def test_within_its_tolerance():
    allocated[0] += 100 * MIB
