import pytest
import ray
from conftest import Holder, on, shut_down, started_cluster

KEEP = []

@pytest.fixture(scope="module")
def first():
    cluster, node_b, owned, pid = started_cluster("first")
    yield node_b
    shut_down(cluster, owned, pid)  # during the next test's teardown: the session watches again

@pytest.mark.needs_clean_gpus
def test_a_leaks_while_the_cluster_appears(first):
    # The cluster appears during this test's set-up: found at the check after it, with the actor the test
    # leaves (its handle in a global).
    KEEP.append(Holder.options(scheduling_strategy=on(first)).remote())
    ray.get(KEEP[-1].hold.remote(30))

@pytest.mark.needs_clean_gpus
def test_b_next_test_is_clean(first):
    pass
