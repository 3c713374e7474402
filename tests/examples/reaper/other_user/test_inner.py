import os
import subprocess
import time

import pytest

# A shell holder: the other user can't run this venv's Python (it lives under /root).
HOLDER = 'echo 7340032 > "$GPUCLEAN_SIMULATE/0/$$"; echo $$ >> "$LEAK_PIDFILE"; exec sleep 3600'


@pytest.mark.needs_clean_gpus(timeout=0.5)
def test_spawns_as_other_user():
    subprocess.Popen(["sh", "-c", HOLDER], user=int(os.environ["OTHER_UID"]),
                     group=int(os.environ["OTHER_GID"]), cwd="/")
    deadline = time.monotonic() + 20
    while not os.path.exists(os.environ["LEAK_PIDFILE"]) and time.monotonic() < deadline:
        time.sleep(0.01)
