# What the plugin changes for a test, one effect per test (tests/test_guest.py runs each plain and under
# the plugin, -k selecting): each writes $GUEST_OUT/<test name>.json.
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import probe
import pytest

OUT = os.environ["GUEST_OUT"]
SHOW_COOKIE = ("import json, os; "
               "print(json.dumps([os.environ.get('GPUCLEAN_TEST'), os.environ.get('GPUCLEAN_OWNER')]))")


def record(request, **found):
    probe.write(os.path.join(OUT, f"{request.node.name}.json"), found)


def forked(body):
    """``body`` in an os.fork() child that never returns into pytest; its wait status."""
    return os.waitpid(probe.fork(body), 0)[1]


@pytest.mark.needs_clean_gpus
def test_a_checked():
    pass  # starts the plugin's session: what follows runs in a session that checks


def test_cookie(request):
    def cookie(*prefix):
        out = subprocess.run([*prefix, sys.executable, "-c", SHOW_COOKIE], capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out)

    record(request, child=cookie(), scrubbed=cookie("env", "-i"))


@pytest.mark.needs_clean_gpus(count=1)
def test_count(request):
    record(request, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_after_count(request):
    record(request, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_orphan(request):
    # A double fork, as a daemon does: the grandchild outlives its parent, then exits by itself.
    read, write = os.pipe()

    def middle():
        grand = os.fork()
        if grand == 0:
            time.sleep(0.3)
            os._exit(0)
        os.write(write, str(grand).encode())

    forked(middle)  # once it is waited for, the grandchild has its new parent
    grand = int(os.read(read, 32))
    with open(f"/proc/{grand}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    # A test that waits for "any child" of its own: it started none that is left.
    try:
        collected = "the orphan" if os.waitpid(-1, 0)[0] == grand else "another process"
    except ChildProcessError:
        collected = "nothing (no child)"
    record(request, parent="pytest" if ppid == os.getpid() else "another process", wait_any=collected)


def test_sigterm_handler(request):
    record(request, handler=probe._name(signal.getsignal(signal.SIGTERM)))


def _sigtermed(fork):
    """A child made by ``fork`` sleeps in a try/finally and gets SIGTERM: [the signal that ended it, whether
    its finally block ran]. POSIX: a child at SIGTERM's default disposition dies of it at once."""
    r, w = os.pipe()
    pid = fork()
    if pid == 0:
        try:
            try:
                os.write(w, b"x")
                time.sleep(30)
            finally:
                os.write(w, b"finally")
        finally:
            os._exit(1)
    os.read(r, 1)
    time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
    status = os.waitpid(pid, 0)[1]
    os.close(w)
    ran_finally = os.read(r, 16) == b"finally"
    os.close(r)
    return [os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, ran_finally]


def test_forked_sigterm(request):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    process = ctx.Process(target=probe.sleeper, args=(started,))
    process.start()
    started.wait(30)
    time.sleep(0.05)
    process.terminate()
    process.join(30)
    # A fork from C (ctypes.PyDLL: the GIL stays held, as in os.fork) runs no at-fork hook of Python.
    record(request, fork=_sigtermed(os.fork), rawfork=_sigtermed(ctypes.PyDLL(None).fork),
           mp_exitcode=process.exitcode)


@pytest.mark.needs_clean_gpus
def test_lock_fds(request):
    me = os.getpid()
    paths = {role: os.path.join(OUT, f"{request.node.name}.{role}.json")
             for role in ("fork", "rawfork", "nocloexec")}
    forked(lambda: probe.child(paths["fork"], me))
    pid = ctypes.PyDLL(None).fork()  # a fork from C: no at-fork hook of Python runs in the child
    if pid == 0:
        try:
            probe.child(paths["rawfork"], me)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    subprocess.run([sys.executable, probe.__file__, paths["nocloexec"], str(me)], check=True, close_fds=False)
    seen = {}
    for role, path in paths.items():
        with open(path) as f:
            found = json.load(f)
        seen[role] = {"fds": found["fds"], "owners": found["lock_owners"]}
    record(request, body=probe.snapshot()["fds"], **seen)


def test_fork_fds(request):
    path = os.path.join(OUT, "fork_fds.child.json")
    forked(lambda: probe.write(path, probe.snapshot()["fds"]))
    with open(path) as f:
        record(request, body=probe.snapshot()["fds"], child=json.load(f))


def test_imports(request):
    import helper

    with pytest.raises(AssertionError) as raised:
        helper.check(2)
    record(request, message=str(raised.value).splitlines()[0], loader=type(helper.__loader__).__name__,
           meta_path=[probe._name(type(f)) for f in sys.meta_path],
           finds_user_module=[type(f).__name__ for f in sys.meta_path
                              if f.find_spec("helper", None) is not None])


@pytest.mark.needs_clean_gpus
def test_setsid(request):
    try:
        os.setsid()  # the pytest process leaves its session and process group
        done = True
    except PermissionError:  # already a process-group leader (pytest started from a shell)
        done = False
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    record(request, setsid=done, sid_is_own=os.getsid(0) == os.getpid())


def test_after_setsid(request):
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    record(request, sid_is_own=os.getsid(0) == os.getpid())
