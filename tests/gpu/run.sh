#!/usr/bin/env bash
# One command for the real-GPU proof (see benchmarks/GPU-RUNS.md): installs the plugin without network access
# (the GPU image already has pytest, psutil, filelock, nvidia-ml-py, torch) and runs tests/gpu.
# Usage, from the repository root on a GPU machine:  bash tests/gpu/run.sh [OUTDIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/gpuclean-gpu}}
mkdir -p "$out"
bash .ci/install-offline >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
{ date -u; nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.used,memory.total --format=csv; \
  python3 -c "import torch, pytest, psutil, pynvml; print('torch', torch.__version__, 'pytest', pytest.__version__, 'psutil', psutil.__version__)"; } | tee "$out/device.txt"
PYTHONUNBUFFERED=1 python3 -m pytest tests/gpu -v -s -p no:cacheprovider --junitxml="$out/gpu-junit.xml" 2>&1 | tee "$out/gpu-tests.log"
exit "${PIPESTATUS[0]}"
