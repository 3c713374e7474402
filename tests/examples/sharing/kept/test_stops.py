import pytest
from conftest import held_by_us, log


@pytest.mark.needs_clean_gpus
def test_first(request):
    log(during=request.node.nodeid, held=held_by_us())


@pytest.mark.needs_clean_gpus
def test_never_runs():
    raise AssertionError("the session stops before this test")
