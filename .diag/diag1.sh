#!/usr/bin/env bash
# Exploration on the GPU box: bytecode, NVML costs, vLLM import and engine start, the crash->shutdown pair.
set -u -o pipefail
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/diag1.log") 2>&1
date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total,persistence_mode --format=csv
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset} nproc=$(nproc)"
python3 - <<'PY'
import importlib.util, os, sys
print(sys.version)
for name in ("pynvml", "torch", "transformers", "psutil", "pytest"):
    spec = importlib.util.find_spec(name)
    origin = spec.origin
    cache = importlib.util.cache_from_source(origin)
    print(name, origin, "pyc exists:", os.path.exists(cache))
PY
echo "== nvidia-smi query x3"; for i in 1 2 3; do /usr/bin/time -f "nvidia-smi %e s wall %U user %S sys" nvidia-smi --query-gpu=memory.used --format=csv,noheader; done
echo "== pynvml import / init, as shipped"
for i in 1 2 3; do python3 -c "
import time,resource
t=time.perf_counter();c=time.process_time()
import pynvml
t1=time.perf_counter();c1=time.process_time()
pynvml.nvmlInit()
t2=time.perf_counter();c2=time.process_time()
h=pynvml.nvmlDeviceGetHandleByIndex(0)
t3=time.perf_counter()
for _ in range(1000): pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
t4=time.perf_counter()
for _ in range(1000): pynvml.nvmlDeviceGetComputeRunningProcesses(h)
t5=time.perf_counter()
print(f'import {1e3*(t1-t):.1f}ms wall {1e3*(c1-c):.1f}ms cpu; nvmlInit {1e3*(t2-t1):.1f}ms wall {1e3*(c2-c1):.1f}ms cpu; meminfo {1e3*(t4-t3):.1f}us; procs {1e3*(t5-t4):.1f}us')
"; done
python3 -X importtime -c "import pynvml" 2>&1 | sort -t'|' -k2 -n | tail -4
echo "== pynvml compiled to bytecode (py_compile), again"
python3 -c "import py_compile, pynvml; print(py_compile.compile(pynvml.__file__))"
for i in 1 2; do python3 -c "
import time
t=time.perf_counter();c=time.process_time()
import pynvml
t1=time.perf_counter();c1=time.process_time()
pynvml.nvmlInit()
t2=time.perf_counter();c2=time.process_time()
print(f'import {1e3*(t1-t):.1f}ms wall {1e3*(c1-c):.1f}ms cpu; nvmlInit {1e3*(t2-t1):.1f}ms wall {1e3*(c2-c1):.1f}ms cpu')
"; done
echo "== strace -c of nvmlInit"; command -v strace && strace -f -c -o "$OUT/strace_nvmlinit.txt" python3 -c "import pynvml; pynvml.nvmlInit()" ; head -25 "$OUT/strace_nvmlinit.txt" 2>/dev/null
echo "== vLLM install"
/usr/bin/time -f "install %e s" bash example_suite/install_gpu_offline.sh
export PYTHONPATH=/tmp/vllm-site
bash .ci/install-offline
echo "== import vllm, no bytecode (x2)"
for i in 1; do /usr/bin/time -f "import vllm %e s wall %U user" python3 -c "import vllm.entrypoints.openai.api_server"; done
/usr/bin/time -f "compileall %e s" python3 -m compileall -q -j 16 /tmp/vllm-site >/dev/null
echo "== import vllm, with bytecode (x2)"
for i in 1; do /usr/bin/time -f "import vllm %e s wall %U user" python3 -c "import vllm.entrypoints.openai.api_server"; done
echo "== engine start, tiny model, eager (with bytecode)"
VLLM_LOGGING_LEVEL=INFO timeout 200 python3 .diag/engine_start.py 2>&1 | grep -E "TIMES|took|seconds|Memory profiling|init engine|Loading|graph|compil" | head -40
echo "== crash then shutdown in one session (DEBUG logs)"
mkdir -p "$OUT/bt"
VLLM_LOGGING_LEVEL=DEBUG timeout -s INT 300 python3 -m pytest -p gpuclean example_suite/test_server_crash.py example_suite/test_server_shutdown.py -v -rs -p no:cacheprovider --basetemp="$OUT/bt" --durations=0 2>&1 | tail -80
echo "rc=$?"
find "$OUT/bt" -name "*.log" -size -3M | head -20
ps -eo pid,ppid,stat,etime,cmd | grep -v "ps -eo" | tail -20
nvidia-smi
