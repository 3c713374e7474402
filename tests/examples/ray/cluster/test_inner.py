import os
import subprocess
import sys

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pytest_gpuclean.simulate import allocate

NODE_B, NODE_C = os.environ["NODE_B"], os.environ["NODE_C"]
KEEP = []

def on(node):
    return NodeAffinitySchedulingStrategy(node, soft=False)


@ray.remote(num_cpus=0)
class Holder:
    def hold(self, mib):
        allocate(os.environ["GPUCLEAN_SIMULATE"], 0, mib)
        return os.getpid()

@ray.remote(num_cpus=0)
def spawn_holder(pidfile):
    proc = subprocess.Popen([sys.executable, "-m", "pytest_gpuclean.simulate", "hold", "--dir",
                             os.environ["GPUCLEAN_SIMULATE"], "--mib", "30", "--pidfile", pidfile])
    return proc.pid

def setup_module():
    if not ray.is_initialized():  # the conftest connected already
        ray.init(address=os.environ["RAY_TEST_ADDRESS"], log_to_driver=False)

def teardown_module():
    ray.shutdown()

@pytest.fixture(scope="module")
def shared_actor():
    actor = Holder.options(scheduling_strategy=on(NODE_B)).remote()
    pid = ray.get(actor.hold.remote(20))
    yield actor, pid
    ray.kill(actor)

@pytest.mark.needs_clean_gpus
def test_a_fixture_actor_is_protected(shared_actor):
    assert ray.get(shared_actor[0].hold.remote(20)) == shared_actor[1]

@pytest.mark.needs_clean_gpus
def test_b_handle_in_global():
    KEEP.append(Holder.options(scheduling_strategy=on(NODE_B)).remote())
    ray.get(KEEP[-1].hold.remote(50))

@pytest.mark.needs_clean_gpus
def test_b2_actor_on_the_drivers_node():
    # Ray prestarts workers on the driver's node before the job asks: their environment names no job
    # (RAY_JOB_ID=ffffffff), only the control store says whose actor they run.
    KEEP.append(Holder.options(scheduling_strategy=on(os.environ["NODE_HEAD"])).remote())
    ray.get(KEEP[-1].hold.remote(35))

@pytest.mark.needs_clean_gpus
def test_c_detached():
    actor = Holder.options(scheduling_strategy=on(NODE_C), lifetime="detached", name="leaky",
                           namespace="t").remote()
    ray.get(actor.hold.remote(40))

@pytest.mark.needs_clean_gpus
def test_d_subprocess_on_other_node():
    ray.get(spawn_holder.options(scheduling_strategy=on(NODE_C)).remote(os.environ["LEAK_PIDFILE"]))
    import time
    for _ in range(500):
        if os.path.exists(os.environ["LEAK_PIDFILE"]):
            break
        time.sleep(0.01)


@pytest.mark.needs_clean_gpus
def test_d2_engine_process_drives_its_own_job():
    # As vLLM's engine process does with distributed_executor_backend="ray": a child of the test connects
    # to the cluster as a driver of its own and places its GPU worker on another node.
    import time
    pidfile = os.environ["LEAK_PIDFILE"] + ".engine"
    subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "ray_engine.py"), pidfile,
                      NODE_B])
    for _ in range(3000):
        if os.path.exists(pidfile) and open(pidfile).read():
            break
        time.sleep(0.01)

@pytest.mark.needs_clean_gpus
def test_e_fixture_actor_still_there(shared_actor):
    assert ray.get(shared_actor[0].hold.remote(20)) == shared_actor[1]

@pytest.mark.needs_clean_gpus
def test_f_clean():
    pass

def test_z_unchecked_leak_found_at_session_end():
    # Not checked, and no checked test follows: only the session-end sweep of the cluster finds it.
    actor = Holder.options(scheduling_strategy=on(NODE_B), lifetime="detached", name="late",
                           namespace="t").remote()
    ray.get(actor.hold.remote(15))
