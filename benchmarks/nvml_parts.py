"""Where a checked session's start and end go with real NVML (a probe for docs/benchmarks.md 5d).

    python3 benchmarks/nvml_parts.py    # on a GPU machine, the plugin installed

Runs ``pytest -p gpuclean`` on one marked test under cProfile in a fresh process, and prints the
cumulative time of gpuclean's and pynvml's biggest entries.
"""

from __future__ import annotations

import os
import pstats
import subprocess
import sys
import tempfile


def main() -> int:
    root = tempfile.mkdtemp(prefix="gpuclean-nvml-parts-")
    with open(os.path.join(root, "pytest.ini"), "w") as f:
        f.write("[pytest]\nmarkers =\n    needs_clean_gpus: x\n")
    with open(os.path.join(root, "test_one.py"), "w") as f:
        f.write("import pytest\n\n\n@pytest.mark.needs_clean_gpus\ndef test_one():\n    pass\n")
    out = os.path.join(root, "prof.out")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "GPUCLEAN_LOCK_DIR": os.path.join(root, "locks")}
    env.pop("GPUCLEAN_SIMULATE", None)
    subprocess.run([sys.executable, "-m", "cProfile", "-o", out, "-m", "pytest", "-q", "-p", "gpuclean",
                    "-p", "no:cacheprovider"], cwd=root, env=env, check=True)
    stats = pstats.Stats(out)
    stats.sort_stats("cumtime").print_stats(r"gpuclean|pynvml|ctypes/__init__", 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
