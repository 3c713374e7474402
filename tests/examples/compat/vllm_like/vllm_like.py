"""fork/spawn-per-test decorators and a server in its own session, as vLLM's tests/utils.py has them."""
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time

SPAWNED = "VLLM_LIKE_SPAWNED_CHILD"


def fork_new_process_for_each_test(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        pid = os.fork()
        if pid == 0:
            os.setpgrp()  # its own group, so that the parent's killpg below spares pytest
            try:
                func(*args, **kwargs)
            except BaseException:
                import traceback
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # whatever the test left in its group
        assert os.waitstatus_to_exitcode(status) == 0, f"forked test exited with {status}"
    return wrapper


def spawn_new_process_for_each_test(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if os.environ.get(SPAWNED) == "1":
            return func(*args, **kwargs)
        code = (f"import importlib; getattr(importlib.import_module({func.__module__!r}), "
                f"{func.__name__!r})()")
        env = dict(os.environ, **{SPAWNED: "1"})
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return wrapper


def create_new_process_for_each_test(method=None):
    return spawn_new_process_for_each_test if method == "spawn" else fork_new_process_for_each_test


class RemoteServer:
    """Starts fake_server.py (an API process and a spawned engine holding GPU memory) in a new session."""

    def __init__(self, port_file):
        self.proc = subprocess.Popen([sys.executable, "fake_server.py", port_file], start_new_session=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            assert self.proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.port = int(open(port_file).read())

    def url_for(self, *parts):
        return f"http://127.0.0.1:{self.port}/" + "/".join(parts)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pgid = os.getpgid(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # engine processes that outlived the API process
