import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pytest_gpuclean.simulate import allocate


@ray.remote(num_cpus=0)
class SetupHolder:
    def hold(self, mib):
        allocate(os.environ["GPUCLEAN_SIMULATE"], 0, mib)
        return os.getpid()

def pytest_configure(config):
    # The session set-up's: protected through every test, reaped by the very last sweep (after the
    # reports), when the driver's job is long over.
    ray.init(address=os.environ["RAY_TEST_ADDRESS"], log_to_driver=False)
    actor = SetupHolder.options(lifetime="detached", name="setup-leak", namespace="t", scheduling_strategy=
                                NodeAffinitySchedulingStrategy(os.environ["NODE_C"], soft=False)).remote()
    ray.get(actor.hold.remote(10))
