#!/usr/bin/env bash
# The peer suites on one H200 (Python 3.12, torch 2.11.0+cu130, pytest 9.1, no network), from the project root,
# after benchmarks/peers/stage_gpu.sh (its .peers/ carried over) and example_suite/install_gpu_offline.sh (CUDA
# vLLM 0.20.2 in /tmp/vllm-site). Each part fits in one 10-minute command:
#
#   bash benchmarks/peers/run_gpu.sh torch-gloo   # distributed_test.py, gloo, 2 ranks sharing GPU 0
#   bash benchmarks/peers/run_gpu.sh torch-nccl   # distributed_test.py, nccl, world size 1
#   bash benchmarks/peers/run_gpu.sh vllm         # vLLM 0.20.2's model-free tests/distributed, 1 in 5
#
# Each runs three ways (plugin off, every test marked, --gpuclean-all) on the real GPU and writes
# $OUT/<part>.json, $OUT/<part>.txt and the logs under $OUT/<part>/ (default OUT=benchmarks/results/peers_gpu).
# SHARD (default 16) and VLLM_SHARD (default 5) choose the slices (benchmarks/peers/peers_select.py);
# WAYS (default off,marked,all) the ways run, WAY_TIMEOUT (default 3600) the seconds each may take.
# BASELINE=<an earlier run's $OUT/<part>.json> compares with that run's plugin-off way instead of running it
# (each way in a call of its own: WAYS=off, then WAYS=marked BASELINE=..., then WAYS=all BASELINE=...). Each
# test gets --timeout=PEER_TEST_TIMEOUT (default 120; pytest-timeout, staged with the wheels): a stuck
# test costs that long, the same in every way.
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:?usage: run_gpu.sh torch-gloo|torch-nccl|vllm}
OUT=${OUT:-benchmarks/results/peers_gpu}
SHARD=${SHARD:-16}
mkdir -p "$OUT"
# One archive of the logs, written however the run ends (the device tool brings back only a few files; run 23
# lost the plugin-off way's log that way when its time limit ended the run).
trap 'tar czf "$OUT/$part-logs.tgz" -C "$OUT" "$part" 2>/dev/null && rm -rf "${OUT:?}/$part"' EXIT
if [ ! -d /tmp/peers-site ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/peers-site .peers/wheels/*.whl
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . \
    || python3 -m pip install -q --no-deps --no-build-isolation --break-system-packages -e .
export PYTHONPATH=/tmp/vllm-site:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}
# Never let NCCL, torch or vLLM use NVLink multicast on a shared host (example_suite/run_gpu.sh says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv
python3 -c 'import torch, pytest; print("torch", torch.__version__, "pytest", pytest.__version__)'
run=(python3 benchmarks/peers/run_peers.py --out "$OUT/$part.json" --keep-work "$OUT/$part"
     --ways "${WAYS:-off,marked,all}" --way-timeout "${WAY_TIMEOUT:-3600}" ${BASELINE:+--baseline "$BASELINE"}
     --pytest-args="--timeout=${PEER_TEST_TIMEOUT:-120} --durations=15")
case "$part" in
    torch-gloo) PEERS_SHARE_GPU=1 "${run[@]}" torch --backend gloo --world-size 2 --shard "$SHARD" ;;
    torch-nccl) "${run[@]}" torch --backend nccl --world-size 1 --shard "$SHARD" ;;
    vllm) "${run[@]}" vllm --vllm-dir .peers/vllm-0.20.2 --no-iomp --shard "${VLLM_SHARD:-5}" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
esac 2>&1 | tee "$OUT/$part.txt"
exit "${PIPESTATUS[0]}"
