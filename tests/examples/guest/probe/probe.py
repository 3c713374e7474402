"""What a process can observe of itself, as JSON: the do-no-harm probe of tests/test_guest.py (issue 37).

``snapshot()`` records the process-wide state that a test body (or a child of it) can see and that a pytest
plugin living in the same process could change: signal dispositions and mask, the child-subreaper flag, the
environment, open descriptors and their close-on-exec flags, threads, import machinery, modules, cwd,
umask, rlimits, hooks, faulthandler, atexit, warning filters, gc, interpreter settings, process group and
session, nice value, CPU affinity. Values that differ from one run to the next whatever the plugin does
(pids, pipe inodes, random ids) are masked, so that a plain run and a run under the plugin compare equal
where nothing differs.

Run as a script (``python probe.py OUT TEST_PID``) it writes the snapshot of the process it runs in:
the exec'ed children (``subprocess``, ``env -i``, ``close_fds=False``) use that.
"""

import atexit
import ctypes
import faulthandler
import gc
import json
import os
import re
import resource
import signal
import sys
import threading
import traceback
import warnings

PR_GET_CHILD_SUBREAPER = 37
SIGNALS = ("SIGTERM", "SIGINT", "SIGCHLD", "SIGPIPE", "SIGUSR1", "SIGHUP", "SIGQUIT", "SIGALRM")

# Values that change from run to run with or without the plugin (the worker xdist gave a test to, too):
# their key is kept, the value masked.
_SESSION_ID = re.compile(r"gc\.\d+\.\d+\.\d+\.[0-9a-f]+")
_VARYING_ENV = ("GUEST_OUT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER", "GPUCLEAN_HELD_LOCKS",
                "GPUCLEAN_XDIST_WORKERS_SINCE", "GPUCLEAN_OUTSIDE_STATE")


def _name(obj):
    """A handler or hook by its qualified name (an object's repr holds its address, which varies)."""
    if obj is None:
        return "None"
    for special in ("SIG_DFL", "SIG_IGN"):
        if obj is getattr(signal, special):
            return special
    if obj is signal.default_int_handler:
        return "signal.default_int_handler"
    function = getattr(obj, "__func__", obj)  # a bound method: its function
    module = getattr(function, "__module__", None) or type(function).__module__
    qualname = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{qualname}"


def _env_value(key, value):
    if key in _VARYING_ENV:
        return "<varies>"
    if key == "GPUCLEAN_TEST":
        # The session ids name a pid and a random part; the structure (nesting, the owner's token) stays.
        return _SESSION_ID.sub("gc.<session>", value)
    return value


def _subreaper():
    flag = ctypes.c_int(-1)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        return f"error {ctypes.get_errno()}"
    return flag.value


def _fds(ignore):
    """Each open descriptor: what it points to (numbers that vary masked) and its close-on-exec flag. As a
    sorted list, not by number: which number a descriptor got says nothing about the plugin."""
    import fcntl

    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in ignore:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            cloexec = bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
        except OSError:
            continue  # the listing's own descriptor, closed by now
        found.append(f"{re.sub(r'[0-9]+', 'N', target)} {'cloexec' if cloexec else 'INHERITED-BY-EXEC'}")
    return sorted(found)


def _os_threads():
    # Field 20 of /proc/self/stat: what Python 3.12's fork() counts before it warns (every OS thread,
    # not only those the threading module knows).
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[17])


def _filters():
    return [[action, getattr(message, "pattern", message), category.__name__,
             getattr(module, "pattern", module), lineno]
            for action, message, category, module, lineno in warnings.filters]


def _relation(parent_pid):
    """Process group and session, relative to the parent's (their ids vary from run to run)."""
    me = os.getpid()
    try:
        parent = os.getpgid(parent_pid), os.getsid(parent_pid)
    except OSError:
        parent = None, None
    return {"pgrp": "own" if os.getpgrp() == me else "parent's" if os.getpgrp() == parent[0] else "other",
            "sid": "own" if os.getsid(0) == me else "parent's" if os.getsid(0) == parent[1] else "other"}


def snapshot(test_pid=None, ignore=()):
    """Everything above, for this process. ``test_pid``: the test's process, to say whether this one's
    parent is it."""
    rlimits = {name: list(resource.getrlimit(getattr(resource, name)))
               for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
    umask = os.umask(0)
    os.umask(umask)
    ppid = os.getppid()
    return {
        "signals": {name: _name(signal.getsignal(getattr(signal, name))) for name in SIGNALS},
        "sigmask": sorted(signal.Signals(s).name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "subreaper": _subreaper(),
        "env": {key: _env_value(key, value) for key, value in sorted(os.environ.items())},
        "fds": _fds(set(ignore)),
        "threads": sorted(re.sub(r"[0-9]+", "N", t.name) for t in threading.enumerate()),
        "os_threads": _os_threads(),
        "meta_path": [_name(type(f)) for f in sys.meta_path],
        "path_hooks": [_name(h) for h in sys.path_hooks],
        "modules": sorted(sys.modules),
        "cwd": os.getcwd(),
        "umask": oct(umask),
        "rlimits": rlimits,
        "excepthook": _name(sys.excepthook),
        "threading_excepthook": _name(threading.excepthook),
        "unraisablehook": _name(sys.unraisablehook),
        "faulthandler": faulthandler.is_enabled(),
        "atexit": atexit._ncallbacks(),
        "warning_filters": _filters(),
        "gc": {"enabled": gc.isenabled(), "threshold": list(gc.get_threshold()),
               "callbacks": len(gc.callbacks)},
        "switchinterval": sys.getswitchinterval(),
        "recursionlimit": sys.getrecursionlimit(),
        "flags": {name: getattr(sys.flags, name) for name in dir(sys.flags)
                  if not name.startswith("_") and not callable(getattr(sys.flags, name))},
        "process_group": _relation(ppid),
        "parent": None if test_pid is None else ("the test's process" if ppid == test_pid else "another"),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
    }


def write(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # whole or not at all: the test waits for the file


def lock_owners(test_pid):
    """For each descriptor this process has of a GPU lock file (``*.lock``), who holds the file's POSIX lock:
    F_GETLK names the holder of a conflicting lock, never one of this process's own."""
    import fcntl
    import struct

    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").endswith(".lock"):
                continue
            # Linux's struct flock (64-bit off_t): a write lock on the whole file, would it conflict?
            answer = fcntl.fcntl(int(name), fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
        except OSError:
            continue
        kind, _, _, _, pid = struct.unpack("hhqqi4x", answer)
        found.append("free" if kind == fcntl.F_UNLCK else "the test's process" if pid == test_pid
                     else "another process")
    return sorted(found)


def child(path, test_pid):
    """The body of a child (a forked one, multiprocessing's, an exec'ed one): its snapshot, and who holds
    the GPU locks whose files it has open."""
    write(path, {**snapshot(test_pid), "lock_owners": lock_owners(test_pid)})


def sleeper(started):
    """A multiprocessing child that says it runs, then waits to be terminated."""
    import time

    started.set()
    time.sleep(60)


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]))


def fork(body):
    """Run ``body`` in an os.fork() child that never returns into pytest; returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            body()
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    return pid
