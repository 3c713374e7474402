import os

import pytest
from ray.cluster_utils import Cluster


@pytest.fixture(scope="session")
def cluster():
    root = os.environ["NODE_DIRS"]
    for name in ("head", "b"):
        os.makedirs(os.path.join(root, name, "0"))
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        include_dashboard=False, num_cpus=1, node_ip_address="127.0.0.1",
        env_vars={"GPUCLEAN_SIMULATE": os.path.join(root, "head")}))
    cluster.add_node(num_cpus=0, node_ip_address="127.0.0.1", env_vars={
        "GPUCLEAN_SIMULATE": os.path.join(root, "b"), "PYTHONPATH": os.environ["SIDE_PYTHONPATH"],
        "WORKER_SIDE_PIDS": os.environ["WORKER_SIDE_PIDS"]})
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.mark.needs_clean_gpus
def test_0_clean_first(cluster):
    pass


@pytest.mark.needs_clean_gpus
def test_1_clean_next(cluster):
    pass
