# The do-no-harm probe (tests/test_guest.py): each test writes $GUEST_OUT/<test name>.json, what its body
# and its children observe of their process, and how a forked child dies of SIGTERM. The same module runs
# plain (-p no:gpuclean) and under the plugin; the outer test compares the files.
import ctypes
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback

import probe
import pytest

OUT = os.environ["GUEST_OUT"]


def _wait_file(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.005)


def _roles(base, test_pid):
    """Each child's snapshot, by role, plus what the test could do with an orphan."""
    paths = {}

    def path(role):
        paths[role] = f"{base}.{role}.json"
        return paths[role]

    at_fork = {"python_threads": None, "os_threads": None}

    # os.fork(): what Python 3.12 counts before it warns (DeprecationWarning) is the OS threads.
    at_fork["python_threads"] = __import__("threading").active_count()
    at_fork["os_threads"] = probe._os_threads()
    target = path("fork")
    os.waitpid(probe.fork(lambda: probe.child(target, test_pid)), 0)

    for method in ("fork", "spawn"):
        process = multiprocessing.get_context(method).Process(target=probe.child,
                                                              args=(path(f"mp_{method}"), test_pid))
        process.start()
        process.join(60)
        assert process.exitcode == 0, (method, process.exitcode)

    script = [sys.executable, probe.__file__]
    subprocess.run([*script, path("subprocess"), str(test_pid)], check=True)
    subprocess.run(["env", "-i", *script, path("scrubbed"), str(test_pid)], check=True)
    subprocess.run([*script, path("nocloexec"), str(test_pid)], check=True, close_fds=False)

    # A fork from C (an extension's fork() without exec): none of Python's at-fork hooks run in the child.
    target = path("rawfork")
    pid = ctypes.PyDLL(None).fork()  # PyDLL: the GIL stays held, as in os.fork()
    if pid == 0:
        try:
            probe.child(target, test_pid)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)

    def setsid():
        os.setsid()
        probe.child(target, test_pid)

    target = path("setsid")
    os.waitpid(probe.fork(setsid), 0)

    # A double fork: the grandchild is an orphan once the middle process exits.
    grand_path = path("grandchild")
    ready_r, ready_w = os.pipe()

    def middle():
        os.close(ready_r)
        middle_pid = os.getpid()

        def grandchild():
            deadline = time.monotonic() + 30
            while os.getppid() == middle_pid and time.monotonic() < deadline:
                time.sleep(0.002)  # until it is re-parented
            probe.child(grand_path, test_pid)

        grand = probe.fork(grandchild)
        os.write(ready_w, str(grand).encode())

    middle_pid = probe.fork(middle)
    os.close(ready_w)
    grand = int(os.read(ready_r, 32))
    os.close(ready_r)
    os.waitpid(middle_pid, 0)
    _wait_file(grand_path)
    try:
        os.waitpid(grand, 0)  # blocks until it exits, if the test's process adopted it
        waitable = True
    except ChildProcessError:
        waitable = False
    orphan = {"waitable_by_the_test": waitable}
    return {role: json.load(open(p)) for role, p in paths.items()}, at_fork, orphan


def _sigterm_fork(base):
    """An os.fork() child in a try/finally, SIGTERMed: what it does (POSIX: dies of signal 15 at once)."""
    err, finally_ran = f"{base}.sigterm.err", f"{base}.sigterm.finally"
    ready_r, ready_w = os.pipe()

    def body():
        try:
            try:
                os.write(ready_w, b"x")
                time.sleep(60)
            finally:
                open(finally_ran, "w").close()
        except BaseException:
            with open(err, "a") as f:
                traceback.print_exc(file=f)
            raise

    pid = probe.fork(body)
    os.read(ready_r, 1)
    time.sleep(0.05)  # into its sleep
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    printed = open(err).read().strip().splitlines() if os.path.exists(err) else []
    return {"died_of": signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None,
            "exit_status": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "finally_ran": os.path.exists(finally_ran),
            "printed": printed[-1] if printed else ""}


def _mp_fork_terminate(capfd):
    """multiprocessing's fork child, terminate()d (POSIX: exitcode -15, nothing printed)."""
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    process = ctx.Process(target=probe.sleeper, args=(started,))
    process.start()
    assert started.wait(30)
    time.sleep(0.05)
    process.terminate()
    process.join(30)
    return {"exitcode": process.exitcode,
            "printed_KeyboardInterrupt": "KeyboardInterrupt" in capfd.readouterr().err}


def observe(request, capfd):
    base = os.path.join(OUT, request.node.name)
    body = probe.snapshot()  # first: before the test opens anything of its own
    roles, at_fork, orphan = _roles(base, os.getpid())
    experiments = {"threads_at_fork": at_fork, "orphan": orphan, "sigterm_fork": _sigterm_fork(base),
                   "mp_fork_terminate": _mp_fork_terminate(capfd)}
    probe.write(f"{base}.json", {"body": body, **roles, "experiments": experiments})


@pytest.mark.needs_clean_gpus
def test_a_marked(request, capfd):
    observe(request, capfd)


def test_b_unmarked(request, capfd):
    observe(request, capfd)


@pytest.mark.needs_clean_gpus(count=1)
def test_c_count(request, capfd):
    observe(request, capfd)
