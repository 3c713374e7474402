# On a node whose PYTHONPATH has it: every Ray worker of a job starts a side process that carries the
# worker's RAY_JOB_ID; its pid and job go to $WORKER_SIDE_PIDS.
import os
import subprocess


def _side_process():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return
    job = os.environ.get("RAY_JOB_ID", "")
    if b"default_worker.py" not in command or job in ("", "ffffffff"):
        return
    proc = subprocess.Popen(["sleep", "120"])
    with open(os.environ["WORKER_SIDE_PIDS"], "a") as f:
        f.write(f"{proc.pid} {job}\n")

_side_process()
