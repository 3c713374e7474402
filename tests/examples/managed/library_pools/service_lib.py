"""A library that keeps a service process for the caller's lifetime (as wandb's service), in a class attribute
of a module singleton; it ends the service at exit."""

import atexit
import subprocess
import sys


class Service:
    _process = None

    @classmethod
    def get(cls):
        if cls._process is None:
            cls._process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            atexit.register(cls._process.terminate)
        return cls._process
