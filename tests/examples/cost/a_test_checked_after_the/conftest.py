import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    if item.name == "test_late":
        item.add_marker(pytest.mark.needs_clean_gpus)
    return (yield)
