#!/usr/bin/env bash
# One command for the H200 box: benchmark 1 on real NVML (bench_clean_path.py --real) and benchmark 3
# (bench_release_gpu.py: leak-to-clean latency, timeline), plus the timeline plot. About 2 minutes.
#
#   bash benchmarks/run_gpu.sh            # from the repository root; writes to $OUT
#   SIMULATE=1 PYTHON=.venv/bin/python OUT=/tmp/x bash benchmarks/run_gpu.sh   # dry run without a GPU
#
# Files written to $OUT (default benchmarks/results/gpu): run.log, clean_path_real.json,
# release_results.json, release_timeline.json, release_timeline.png, holders.log.
set -u -o pipefail
OUT=${OUT:-${1:-benchmarks/results/gpu}}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
REAL=--real SIM=
if [ "${SIMULATE:-0}" = 1 ]; then REAL= SIM=--simulate; fi  # dry run of this script on a CPU box
status=0
{
    echo "== run_gpu.sh $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) CPUs"
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv || true
    "$PY" -c 'import torch, pynvml, psutil; print("torch", torch.__version__, "psutil", psutil.__version__)' || true

    echo; echo "== benchmark 1: clean path, real NVML"
    timeout 170 "$PY" benchmarks/bench_clean_path.py $REAL --json "$OUT/clean_path_real.json" \
        || { echo "bench_clean_path.py failed: rc=$?"; status=1; }

    echo; echo "== benchmark 3: leak-to-clean latency"
    # torch and transformers imported into the measuring process (CUDA not initialised there): the heap
    # of a real GPU test session, which the reaper must not walk on its way to the first signal.
    timeout 170 "$PY" benchmarks/bench_release_gpu.py $SIM --out "$OUT" --import-modules torch,transformers \
        || { echo "bench_release_gpu.py failed: rc=$?"; status=1; }
    if [ -s "$OUT/release_timeline.json" ]; then
        "$PY" benchmarks/plot_timeline.py "$OUT/release_timeline.json" "$OUT/release_timeline.png" \
            || { echo "plot_timeline.py failed: rc=$?"; status=1; }
    fi
    echo "== run_gpu.sh done, status $status"
    exit $status
} 2>&1 | tee "$OUT/run.log"
