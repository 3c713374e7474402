import os
import subprocess

import pytest


def _recorded(request, name, owner):
    # A record in pytest-xprocess's own place (its pid file), naming a process this test started.
    proc = subprocess.Popen(["sleep", "600"])
    with open(os.environ["LEAK_PIDFILE"], "a") as f:
        f.write(f"{proc.pid}\n")
    folder = request.config.cache.mkdir(".xprocess") / name
    folder.mkdir()
    (folder / "xprocess.PID").write_text(str(proc.pid))
    os.chown(folder / "xprocess.PID", owner, owner)


@pytest.mark.needs_clean_gpus
def test_record_planted_by_another_user(request):
    _recorded(request, "planted", 65534)


@pytest.mark.needs_clean_gpus
def test_record_of_our_own(request):
    _recorded(request, "ours", os.getuid())
