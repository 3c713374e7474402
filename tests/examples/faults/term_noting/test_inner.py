import subprocess
import sys
import time

from prelude import script, wait_holders


def test_leak_and_hang():
    subprocess.Popen([sys.executable, script("note_term.py")])
    wait_holders(1)
    time.sleep(120)
