import pytest
from prelude import hold, wait_holders


def test_1_unchecked_leaks():
    hold()  # never stopped; this test is not checked: the next check finds it
    wait_holders(1)


@pytest.mark.needs_clean_gpus
def test_2_victim_reaps_it_before():
    pass


@pytest.mark.needs_clean_gpus
def test_3_leaks():
    hold()
    wait_holders(2)


@pytest.mark.needs_clean_gpus
def test_4_clean():
    pass


@pytest.mark.needs_clean_gpus
def test_5_leaks_too():
    hold()
    wait_holders(3)
