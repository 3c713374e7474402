#!/usr/bin/env bash
# Install CUDA vLLM 0.20.2 on the H200 machine, which has no internet.
#
# Before: on a machine with PyPI access, run example_suite/stage_gpu.sh from the repository root; it downloads the
# wheels of example_suite/requirements-gpu.txt (Python 3.12, x86_64) and splits them into .vllm-stage/NN/
# parts of at most 54 MiB. Copy every part file into /tmp/vllm-stage/ on the GPU machine, then run this script.
# It unpacks and installs into /tmp/vllm-site (no index, no dependency resolution: the image provides torch
# 2.11.0+cu130, transformers, numpy, ...). Afterwards: export PYTHONPATH=/tmp/vllm-site:$PYTHONPATH
set -euo pipefail
stage=${VLLM_STAGE_DIR:-/tmp/vllm-stage}
site=${VLLM_SITE_DIR:-/tmp/vllm-site}
if PYTHONPATH=$site python3 -c "import vllm" 2>/dev/null; then
    echo "vLLM already installed in $site"
else
    ls "$stage"/part* >/dev/null || { echo "no parts in $stage (see the header of $0)" >&2; exit 2; }
    mkdir -p /tmp/vllm-wheels
    cat "$stage"/part* | tar xf - -C /tmp/vllm-wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" /tmp/vllm-wheels/*.whl
fi
# Bytecode for vLLM and for what the image ships without it (torch, on the H100/H200 image), on every core
# at once: the image sets PYTHONDONTWRITEBYTECODE=1, so otherwise every process of every engine (API
# server, EngineCore, workers, vLLM's model inspection) compiles torch and vLLM from source. Measured on an
# H100: `import vllm.entrypoints.openai.api_server` took 16-18 s per process. What has bytecode is only
# looked at.
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m compileall -q -q -j 0 "$site" "$purelib" || true
PYTHONPATH=$site:${PYTHONPATH:-} python3 -c \
    "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
