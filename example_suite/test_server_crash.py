"""A server's API process dies mid-test (SIGKILL, as the OOM killer does): gpuclean reaps and blames.

The inner test starts ``vllm serve`` itself, extracts one prompt, and the API server is SIGKILLed. vLLM's
EngineCore and workers do not notice: they live on, orphaned (re-parented to pytest, which gpuclean makes a
child subreaper), holding their memory (on a GPU: the whole KV cache). gpuclean must find them at that test's
teardown, reap them, blame that test, and the next test must pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from example_suite.runtime import VLLM_MISSING, VllmRuntime

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.leaks import (
    assert_engine_reaped_and_blamed,
    leaving_tp,
    remove_engine_debris,
    run_leaving_session,
)
from example_suite.settings import EngineSettings

pytestmark = pytest.mark.needs_clean_gpus

FIRST_TEST = """
from example_suite.client import HiddenStatesClient
from example_suite.server import VllmServer


@pytest.mark.needs_clean_gpus
def test_api_server_killed(tmp_path):
    server = VllmServer({model!r}, layer_ids=[2], tensor_parallel_size={tp}, log_path={log!r},
                        **{server_args!r})
    server.start()
    HiddenStatesClient(server.url).extract([[1, 17, 42]], tmp_path)
    engine = [{{"pid": p.pid, "cmdline": " ".join(p.cmdline())}} for p in server.processes()[1:]
              if "resource_tracker" not in " ".join(p.cmdline())]
    PIDS_FILE.write_text(json.dumps({{"tree": server.recorded_pids(), "engine": engine,
                                     "private_dir": str(server.private_dir)}}))
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    # The test ends as one whose server crashed would: nobody stops EngineCore and the workers.
"""


def test_orphans_of_a_killed_api_server_are_reaped_and_blamed(
    pytester: pytest.Pytester,
    tiny_model_dir: Path,
    engine_settings: EngineSettings,
    vllm_runtime: VllmRuntime,
) -> None:
    tp = leaving_tp(vllm_runtime)
    log = pytester.path / "server.log"
    session = run_leaving_session(
        pytester,
        FIRST_TEST,
        model=str(tiny_model_dir),
        log=str(log),
        server_args=engine_settings.server(),
        tp=tp,
    )
    try:
        assert session.pids_file.exists(), session.output[-6000:] + _tail(log)
        engine = session.recorded()["engine"]
        # EngineCore, and the workers where vLLM runs the model in its own processes (CPU, or TP=2).
        assert any("EngineCore" in p["cmdline"] or "spawn_main" in p["cmdline"] for p in engine), engine
        assert len(engine) >= (1 + tp if tp > 1 else 1), engine
        assert_engine_reaped_and_blamed(session, "test_api_server_killed", engine)
    finally:
        if session.pids_file.exists():
            # The killed server could not clean up after itself (IPC sockets, TMPDIR, /dev/shm).
            recorded = session.recorded()
            remove_engine_debris(set(recorded["tree"]), [recorded["private_dir"]])


def _tail(path: Path) -> str:
    return "\n--- server log ---\n" + path.read_text(errors="replace")[-4000:] if path.exists() else ""
