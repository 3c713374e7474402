#!/usr/bin/env bash
# Stage CUDA vLLM for a GPU machine without internet (run here, with PyPI access, from the repository root).
# Downloads the wheels of example_suite/requirements-gpu.txt for CPython 3.12 on x86_64 manylinux, without
# their dependencies (the list is complete; the GPU image provides torch and the rest), packs them into one tar
# and splits it into .vllm-stage/00 .. NN, one part file each of at most 54 MiB (git-ignored): a device call
# carries at most 64 MiB, the checkout included. Then, on the GPU machine, one call per folder copies its part
# into /tmp/vllm-stage/, and example_suite/install_gpu_offline.sh (run by example_suite/run_gpu.sh) installs
# them. Usage: bash example_suite/stage_gpu.sh   (PYTHON: the pip to use, default python3)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
py=${PYTHON:-python3}
work="$root/.vllm-wheels"
mkdir -p "$work"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$work" -r example_suite/requirements-gpu.txt
rm -rf .vllm-stage && mkdir -p .vllm-stage
(cd "$work" && tar cf - *.whl) | split -b 54m -d - .vllm-stage/part
for f in .vllm-stage/part*; do n=${f##*part}; mkdir -p ".vllm-stage/$n"; mv "$f" ".vllm-stage/$n/"; done
ls -d .vllm-stage/*
