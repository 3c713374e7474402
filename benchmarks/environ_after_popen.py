"""How often a process's environment reads empty right after ``subprocess.Popen`` returns (docs/ci.md).

``Popen`` returns once the exec has closed its error pipe; the kernel sets the new program's argument and
environment bounds after that, so a read of ``/proc/<pid>/environ`` in between finds nothing. A test that
starts a process and at once has a check read its cookie there must wait for it (``tests/helpers.py:
exec_done``).

    python benchmarks/environ_after_popen.py [--runs 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    args = parser.parse_args()
    missing = 0
    for _ in range(args.runs):
        proc = subprocess.Popen(["sleep", "5"], env={**os.environ, "GPUCLEAN_PROBE": "1"})
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                data = f.read()
        except OSError:
            data = b""
        if b"GPUCLEAN_PROBE=1" not in data:
            missing += 1
        proc.kill()
        proc.wait()
    print(f"environment without the variable right after Popen: {missing} of {args.runs} starts")


if __name__ == "__main__":
    main()
