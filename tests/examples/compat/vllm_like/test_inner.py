import os
import subprocess
import sys
import urllib.request

import pytest
from prelude import hold, wait_holders
from vllm_like import RemoteServer, create_new_process_for_each_test, fork_new_process_for_each_test


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RemoteServer(str(tmp_path_factory.mktemp("server") / "port")) as remote:
        yield remote


@pytest.mark.needs_clean_gpus
def test_health(server):
    assert urllib.request.urlopen(server.url_for("health")).read() == b"ok"


def test_health_again(server):
    assert urllib.request.urlopen(server.url_for("health")).read() == b"ok"


@fork_new_process_for_each_test
def test_forked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@fork_new_process_for_each_test
def test_forked_leaves_a_child_in_its_group():
    hold(mib=100)  # ended by the helper's killpg, as in vLLM
    wait_holders(1)


@create_new_process_for_each_test("spawn")
def test_spawned():
    assert os.environ["VLLM_LIKE_SPAWNED_CHILD"] == "1"


@fork_new_process_for_each_test
def test_forked_escapee():
    hold("--daemonize", mib=50)  # its own session: the helper's killpg misses it
    wait_holders(2)
