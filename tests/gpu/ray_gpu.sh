#!/usr/bin/env bash
# On the GPU machine (no internet), after every part staged by tests/gpu/ray_stage.sh is in /tmp/ray-stage/:
# installs the plugin and Ray offline, then runs the --gpuclean-ray GPU scenario (tests/gpu/test_ray_gpu.py:
# a two-node Ray cluster on this host, the head owning the GPU, the other node CPU-only; a leaked named CUDA
# actor reaped via ray.kill, an anonymous one by the ladder, a vLLM engine on Ray (TP=1) kept in a global;
# each found on its node, attributed, the GPU back to zero, release time per node; next test clean).
# With CUDA vLLM staged in /tmp/vllm-stage (see example_suite/install_gpu_offline.sh) the vLLM test runs too.
# Usage, from the repository root:  bash tests/gpu/ray_gpu.sh [OUTDIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/gpuclean-ray-gpu}}
mkdir -p "$out"
version=$(grep -o 'ray==[0-9][0-9.]*' .ci/setup | head -1 | cut -d= -f3)
{
  set -e
  bash .ci/install-offline
  rm -rf /tmp/ray-wheels && mkdir -p /tmp/ray-wheels
  cat /tmp/ray-stage/part* | tar xf - -C /tmp/ray-wheels
  (cd /tmp/ray-wheels && sha256sum -c --quiet SHA256SUMS)
  # Only what the image lacks (or has in a version Ray refuses) is installed; torch and the rest stay.
  python3 -m pip install -q --no-index --find-links /tmp/ray-wheels "ray==$version" \
    || python3 -m pip install -q --no-index --find-links /tmp/ray-wheels --break-system-packages "ray==$version"
  # CUDA vLLM for the engine-on-Ray test, when its parts were staged (example_suite/install_gpu_offline.sh).
  if [ -d /tmp/vllm-stage ] || [ -d /tmp/vllm-site ]; then bash example_suite/install_gpu_offline.sh; fi
} >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
# The raylets inherit this (the cluster fixture starts them), and so do the Ray workers vLLM places there.
[ -d /tmp/vllm-site ] && export PYTHONPATH=/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
{ date -u; nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.used,memory.total --format=csv; \
  python3 -c "import ray, torch, pytest; print('ray', ray.__version__, 'torch', torch.__version__, 'pytest', pytest.__version__, 'cuda', torch.cuda.is_available())"; \
  } | tee "$out/device.txt"
# RAY_GPU_K selects tests (pytest -k), e.g. RAY_GPU_K=vllm for the engine-on-Ray test alone.
PYTHONUNBUFFERED=1 python3 -m pytest tests/gpu/test_ray_gpu.py -v -s -p no:cacheprovider ${RAY_GPU_K:+-k "$RAY_GPU_K"} \
  --junitxml="$out/ray-gpu-junit.xml" 2>&1 | tee "$out/ray-gpu-tests.log"
status=${PIPESTATUS[0]}
nvidia-smi --query-gpu=index,memory.used --format=csv | tee -a "$out/device.txt"
exit "$status"
