import pytest
import ray
from conftest import Holder, on


@pytest.mark.needs_clean_gpus
def test_c_leaks_on_a_second_cluster(second):
    actor = Holder.options(scheduling_strategy=on(second), lifetime="detached", name="leaky",
                           namespace="t").remote()
    ray.get(actor.hold.remote(40))

@pytest.mark.needs_clean_gpus
def test_d_next_test_is_clean(second):
    pass
