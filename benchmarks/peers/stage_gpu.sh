#!/usr/bin/env bash
# Prepare the peer suites for the offline H200 machine (run on a machine with PyPI access, from the project root):
# vLLM 0.20.2's tests (from its sdist) in .peers/vllm-0.20.2, and the pure-Python wheels its tests and PyTorch's
# test helpers import that the H200 image lacks, in .peers/wheels (Python 3.12). .peers/ is git-ignored: carry
# it to the GPU machine (about 15 MB), then run benchmarks/peers/run_gpu.sh there.
set -euo pipefail
venv=${VENV:-.venv}
bash benchmarks/peers/fetch_vllm_tests.sh "$venv" .peers/vllm-0.20.2 0.20.2
rm -rf .peers/wheels && mkdir -p .peers/wheels
"$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d .peers/wheels tblib multiprocess expecttest pytest-timeout
ls .peers/wheels
du -sh .peers
