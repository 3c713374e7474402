"""Where a checked session's NVML start goes: ``import pynvml`` with and without bytecode, ``nvmlInit``, one
memory and process query, against ``nvidia-smi``'s whole query (a GPU box; CPU time of fresh interpreters).

pynvml is imported from a copy of the installed module in a temporary directory, so that "without
bytecode" is the module as a PYTHONDONTWRITEBYTECODE image ships it (compiled in every process) and "with"
is after one ``py_compile``; then through the plugin's bytecode cache (``pytest_gpuclean.import_cached``,
compiling on its first use and loading from it after).

    python3 benchmarks/nvml_start.py --json $OUT/nvml_start.json
"""

from __future__ import annotations

import argparse
import os
import py_compile
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

PROBE = """
import sys, time
c0 = time.process_time()
if sys.argv[1] == "cached":
    import pytest_gpuclean
    c1 = time.process_time()
    pynvml = pytest_gpuclean._imports.import_cached("pynvml")
else:
    c1 = time.process_time()
    import pynvml
c2 = time.process_time()
pynvml.nvmlInit()
c3 = time.process_time()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
c4 = time.process_time()
print(1e3 * (c2 - c1), 1e3 * (c3 - c2), 1e3 * (c4 - c3))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    import pynvml  # (where the installed module is)

    root = tempfile.mkdtemp(prefix="gpuclean-nvml-start-")
    copy = os.path.join(root, "mod")
    os.makedirs(copy)
    shutil.copy(pynvml.__file__, copy)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": os.path.join(root, "cache"),
           "PYTHONPATH": os.pathsep.join([copy, _common.REPO])}
    env.pop("GPUCLEAN_BYTECODE_CACHE", None)
    results: dict[str, dict[str, float]] = {}

    def measure(name: str, mode: str) -> None:
        rows = [subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True,
                               check=True, cwd=root).stdout.split() for _ in range(args.runs)]
        columns = list(zip(*[[float(v) for v in row] for row in rows], strict=True))
        results[name] = {key: statistics.median(values)
                         for key, values in zip(("import_ms", "init_ms", "query_ms"), columns, strict=True)}

    measure("no bytecode", "plain")
    measure("plugin's bytecode cache", "cached")  # (its first run compiles and writes the cache)
    py_compile.compile(os.path.join(copy, "pynvml.py"))
    measure("bytecode", "plain")
    smi = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv"], check=True,
                       capture_output=True)
        smi.append(1e3 * (time.perf_counter() - start))
    rows = [[name, f"{r['import_ms']:.1f}", f"{r['init_ms']:.1f}", f"{r['query_ms']:.2f}"]
            for name, r in results.items()]
    print(_common.table(rows, ["pynvml", "import (CPU ms)", "nvmlInit (CPU ms)", "2 queries (CPU ms)"]))
    print(f"nvidia-smi --query-gpu: {statistics.median(smi):.1f} ms wall (median of {args.runs})")
    if args.json:
        _common.write_json(args.json, {"machine": _common.machine(), "pynvml": results,
                                       "nvidia_smi_wall_ms": statistics.median(smi)})
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
