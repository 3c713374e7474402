#!/usr/bin/env bash
# Run the example suite on the H200 GPU machine (Python 3.12, torch 2.11+cu130, transformers 5.x, safetensors,
# tokenizers, tqdm, pytest, psutil, nvidia-ml-py in the image), from the project root:
#
#   bash example_suite/run_gpu.sh [extra pytest args]
#
# CUDA vLLM 0.20.2 comes from /tmp/vllm-site (installed by example_suite/install_gpu_offline.sh if missing),
# with the stock hidden-states connector (the CPU workarounds are applied on CPU vLLM only).
# TP=2 tests need two visible GPUs and are skipped with a reason on a one-GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash example_suite/install_gpu_offline.sh
export PYTHONPATH=/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH}
# `vllm serve` imports packages the offline engine does not (uvicorn, jmespath, ...; the second half of
# example_suite/requirements-gpu.txt): fail here, with the missing module's name, if the stage lacked them.
python3 -c "import vllm.entrypoints.openai.api_server, setproctitle" \
    || { echo "run_gpu.sh: the vLLM install cannot run \`vllm serve\` (see above)" >&2; exit 2; }
# The plugin (pytest11 entry point "gpuclean"), without its dependencies: the image has them.
bash .ci/install-offline
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
# Multi-GPU hosts shared with others: never let NCCL, torch or vLLM use NVLink multicast (NVLS, symmetric
# memory), which can take a host's GPUs out of service; TP=2 on this tiny model needs none of it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
# exec: a SIGINT (e.g. `timeout -s INT`) then reaches pytest itself, which prints the failures so far.
exec python3 -m pytest -p gpuclean example_suite -v -rs -p no:cacheprovider "$@"
