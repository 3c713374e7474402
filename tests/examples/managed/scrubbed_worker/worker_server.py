"""A server started with a scrubbed environment. On each request (a file ``request-N`` in argv[1]) it runs
``sh -c 'WORKER & echo $! > worker-N.pid'``: the shell exits at once, and its worker is an orphan that the
pytest process (a subreaper) adopts, with no cookie and born while the test that made the request ran. The
worker holds 100 MiB of simulated GPU 0 (argv[2] is the simulated devices' folder)."""

import os
import subprocess
import sys
import time

folder, sim = sys.argv[1], sys.argv[2]
worker = f"{sys.executable} -m pytest_gpuclean.simulate hold --dir {sim} --device 0 --mib 100"
served = 0
while True:
    request = os.path.join(folder, f"request-{served}")
    if os.path.exists(request):
        pidfile = f"{folder}/worker-{served}"
        subprocess.run(["sh", "-c", f"{worker} & echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}.pid"],
                       check=True)
        served += 1
    time.sleep(0.01)
