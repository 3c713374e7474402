import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pytest_gpuclean.simulate import allocate


@ray.remote(num_cpus=0)
class Holder:
    def hold(self, mib):
        allocate(os.environ["GPUCLEAN_SIMULATE"], 0, mib)
        return os.getpid()

def on(node):
    return NodeAffinitySchedulingStrategy(node, soft=False)

def publish(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)

def started_cluster(name):
    # A head and a second node, each with its own simulated devices; this process is a driver of it, and
    # the fixture that calls this owns an actor holding memory on the second node.
    root = os.path.join(os.environ["NODE_DIRS"], name)
    dirs = {n: os.path.join(root, n) for n in ("head", "b")}
    for d in dirs.values():
        os.makedirs(os.path.join(d, "0"))
    common = dict(num_cpus=1, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        include_dashboard=False, env_vars={"GPUCLEAN_SIMULATE": dirs["head"]}, **common))
    b = cluster.add_node(env_vars={"GPUCLEAN_SIMULATE": dirs["b"]}, **common)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    owned = Holder.options(scheduling_strategy=on(b.node_id)).remote()
    pid = ray.get(owned.hold.remote(20))
    publish(os.path.join(root, "node_b"), b.node_id)
    publish(os.path.join(root, "address"), cluster.address)
    return cluster, b.node_id, owned, pid

def shut_down(cluster, owned, pid):
    # The fixture's actor lived through every check until its fixture ends.
    assert ray.get(owned.hold.remote(20)) == pid
    ray.shutdown()
    cluster.shutdown()

@pytest.fixture(scope="session")
def second():
    cluster, node_b, owned, pid = started_cluster("second")
    # Another job's actor (the driver is no process of this session), on the same cluster.
    bystander = os.path.join(os.environ["NODE_DIRS"], "second", "bystander")
    for _ in range(6000):
        if os.path.exists(bystander):
            break
        time.sleep(0.01)
    other = int(open(bystander).read())
    yield node_b
    assert os.path.exists(f"/proc/{other}") and open(f"/proc/{other}/stat").read().split()[2] != "Z"
    shut_down(cluster, owned, pid)
