"""A Ray driver started before pytest (cluster argv[1]): once argv[3] exists, it makes an actor on node
argv[2] and writes the actor's pid to argv[4]."""

import os
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

address, node, go, ready = sys.argv[1:5]
ray.init(address=address, log_to_driver=False)


@ray.remote(num_cpus=0)
class Service:
    def pid(self):
        return os.getpid()

while not os.path.exists(go):
    time.sleep(0.01)
actor = Service.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
pid = ray.get(actor.pid.remote())
with open(ready + ".tmp", "w") as f:
    f.write(str(pid))
os.rename(ready + ".tmp", ready)
time.sleep(600)
