"""Where a checked session's start and end go with real NVML (a probe for docs/benchmarks.md 2).

    python3 benchmarks/nvml_parts.py    # on a GPU machine, the plugin installed

First NVML's own steps, timed in fresh interpreters that have imported pytest (three of them): ``import
pynvml``, ``nvmlInit``, the enumeration gpuclean does, a snapshot, ``nvmlShutdown``. Then ``pytest -p
gpuclean`` on one marked test under cProfile in a fresh process: the cumulative time of gpuclean's and
pynvml's biggest entries.
"""

from __future__ import annotations

import os
import pstats
import subprocess
import sys
import tempfile

PARTS = """
import threading, time
import pytest
t0 = time.perf_counter()
import pynvml
t1 = time.perf_counter()
pynvml.nvmlInit()
t2 = time.perf_counter()
import _layers_compat  # noqa: F401  # (a tree from before the layers: issue 29)
from pytest_gpuclean._reading.nvml import NvmlBackend
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
backend = NvmlBackend.__new__(NvmlBackend)
backend._nvml, backend._handles, backend._minors, backend._memory_v2 = pynvml, {}, {}, True
backend._lock = threading.Lock()
devices = backend._enumerate(handles)
t3 = time.perf_counter()
for device in devices:
    backend.snapshot(device)
t4 = time.perf_counter()
pynvml.nvmlShutdown()
t5 = time.perf_counter()
print(f"import pynvml {1e3 * (t1 - t0):.1f} ms, nvmlInit {1e3 * (t2 - t1):.1f} ms, "
      f"handles and enumeration {1e3 * (t3 - t2):.1f} ms, a snapshot of every GPU {1e3 * (t4 - t3):.2f} ms, "
      f"nvmlShutdown {1e3 * (t5 - t4):.1f} ms")
"""


def main() -> int:
    # Compiled as pip leaves it (the GPU image ships it without bytecode: bench_session.py says more).
    subprocess.run([sys.executable, "-c", "import py_compile, pynvml; py_compile.compile(pynvml.__file__)"],
                   check=False)
    for _ in range(3):
        subprocess.run([sys.executable, "-c", PARTS], check=True)
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
