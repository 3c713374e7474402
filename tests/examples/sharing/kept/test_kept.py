import os

import pytest
from conftest import held_by_us, log, recorded_tests


def during(request):
    log(during=request.node.nodeid, held=held_by_us(), records=recorded_tests(),
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"), inherits=os.environ.get("GPUCLEAN_HELD_LOCKS"))


@pytest.mark.needs_clean_gpus
def test_a(request):
    during(request)


@pytest.mark.needs_clean_gpus
def test_b(request):
    during(request)


def test_unchecked(request):
    during(request)


@pytest.mark.needs_clean_gpus(count=1)
def test_one(request):
    during(request)


@pytest.mark.needs_clean_gpus(count=1)
def test_one_again(request):
    during(request)


@pytest.mark.needs_clean_gpus
def test_both(request):
    during(request)
