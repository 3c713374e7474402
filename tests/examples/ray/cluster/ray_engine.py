import os
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pytest_gpuclean.simulate import allocate


@ray.remote(num_cpus=0)
class Worker:
    def hold(self, mib):
        allocate(os.environ["GPUCLEAN_SIMULATE"], 0, mib)
        return os.getpid()

ray.init(address=os.environ["RAY_TEST_ADDRESS"], log_to_driver=False)
worker = Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(sys.argv[2], soft=False)).remote()
pid = ray.get(worker.hold.remote(25))
with open(sys.argv[1], "w") as f:
    f.write(str(pid))
time.sleep(600)
