#!/usr/bin/env bash
# The plugin's costs on a real GPU, from the repository root of a GPU box where the plugin is NOT installed
# (the benchmarks put each tree's package on PYTHONPATH; an editable install's finder would answer first):
#
#   BEFORE=bench-before OUT=/tmp/out bash benchmarks/run_gpu.sh
#
# BEFORE (optional): a directory with an older pytest_gpuclean/ and this benchmarks/ copied beside it
#   (rm -rf bench-before && mkdir bench-before && git archive REV pytest_gpuclean | tar -x -C bench-before
#    && cp -r benchmarks bench-before/), measured in the same run.
# About 7 minutes with BEFORE. Writes to $OUT: nvml_start.json, gpu_cost.json, release-*/ and run.log.
#   1. nvml_start.py: import pynvml with and without bytecode, nvmlInit, two queries, nvidia-smi;
#   2. bench_gpu_cost.py: slope per checked test and fixed cost, with and without a CUDA context in the
#      pytest process, and an idle session's cost (wall time of whole pytest processes);
#   3. bench_release_gpu.py: leak-to-clean latency against the driver's own release time.
set -u -o pipefail
OUT=${OUT:-${1:?usage: OUT=DIR [BEFORE=DIR] bash benchmarks/run_gpu.sh}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
trees=WORKTREE
[ -n "${BEFORE:-}" ] && trees="$BEFORE,WORKTREE"
status=0
{
    echo "== run_gpu.sh $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) CPUs"
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv || true
    echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
    # torch with bytecode (the CUDA-context runs import it: compiled in each, the runs would be mostly that);
    # pynvml and psutil stay as the image ships them, which is what the plugin's start pays.
    purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -m compileall -q -q -j 0 "$purelib/torch" || true

    echo; echo "== 1. NVML's start"
    timeout 120 "$PY" benchmarks/nvml_start.py --json "$OUT/nvml_start.json" || { echo "rc=$?"; status=1; }

    echo; echo "== 2. the plugin's cost per checked test, fixed and idle (trees: $trees)"
    timeout 400 "$PY" benchmarks/bench_gpu_cost.py --trees "$trees" --rounds "${ROUNDS:-5}" --tests 20 \
        --big-tests "${BIG_TESTS:-220}" --json "$OUT/gpu_cost.json" || { echo "rc=$?"; status=1; }

    echo; echo "== 3. leak-to-clean latency"
    for tree in ${BEFORE:+$BEFORE} .; do
        name=$([ "$tree" = . ] && echo after || echo before)
        timeout 150 "$PY" "$tree/benchmarks/bench_release_gpu.py" --out "$OUT/release-$name" --repeat 3 \
            --vllm-repeat 0 --import-modules torch | grep -E "driver release|package|reap_term " \
            || { echo "rc=$?"; status=1; }
    done
    echo "== run_gpu.sh done, status $status"
    exit $status
} 2>&1 | tee "$OUT/run.log"
