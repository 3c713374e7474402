"""A Ray job (cluster argv[1]) that ends and leaves on node argv[2] a named detached actor, on node argv[3]
an anonymous one and an escaped process (its pid in argv[4]); prints their pids."""

import os
import subprocess
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On

from pytest_gpuclean.simulate import allocate


@ray.remote(num_cpus=0)
class Holder:
    def hold(self, mib):
        allocate(os.environ["GPUCLEAN_SIMULATE"], 0, mib)
        return os.getpid()


@ray.remote(num_cpus=0)
def escape(pidfile):
    # setsid -f: a new session and an orphan, which outlives its worker and its job.
    subprocess.run(["setsid", "-f", sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir",
                    os.environ["GPUCLEAN_SIMULATE"], "--mib", "10", "--pidfile", pidfile], check=True)
    for _ in range(1000):
        if os.path.exists(pidfile) and open(pidfile).read().strip():
            return int(open(pidfile).read())
        time.sleep(0.01)

ray.init(address=sys.argv[1], log_to_driver=False)
b, c, pidfile = sys.argv[2], sys.argv[3], sys.argv[4]
named = Holder.options(lifetime="detached", name="cli-leak", namespace="t",
                       scheduling_strategy=On(b, soft=False)).remote()
anonymous = Holder.options(lifetime="detached", scheduling_strategy=On(c, soft=False)).remote()
pids = [ray.get(named.hold.remote(30)), ray.get(anonymous.hold.remote(20)),
        ray.get(escape.options(scheduling_strategy=On(c, soft=False)).remote(pidfile))]
print(" ".join(map(str, pids)))
