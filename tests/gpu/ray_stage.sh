#!/usr/bin/env bash
# Here (with internet): stage Ray for the GPU machine, which has no internet and takes at most 64 MiB per call.
# Downloads the Ray version that .ci/setup pins, with its dependencies, as wheels for CPython 3.12 on x86_64
# manylinux, packs them into one tar and splits it into folders .ray-stage/00 .. NN of at most 58 MiB each
# (git-ignored). Then, on the GPU machine, one call per folder copies its part into /tmp/ray-stage/, and
# tests/gpu/ray_gpu.sh installs from there. Usage, from the repository root: bash tests/gpu/ray_stage.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
version=$(grep -o 'ray==[0-9][0-9.]*' .ci/setup | head -1 | cut -d= -f3)
work="$root/.ray-wheels"
rm -rf "$work" && mkdir -p "$work"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$work" "ray==$version"
rm -rf "$root/.ray-stage" && mkdir -p "$root/.ray-stage"
(cd "$work" && sha256sum *.whl > SHA256SUMS && tar cf - *.whl SHA256SUMS) | split -b 58m -d - "$root/.ray-stage/part"
for f in "$root"/.ray-stage/part*; do n=${f##*part}; mkdir -p "$root/.ray-stage/$n"; mv "$f" "$root/.ray-stage/$n/"; done
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for p in .ray-wheels/ .ray-stage/; do grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
echo "ray==$version: $(ls "$work"/*.whl | wc -l) wheels, $(du -sb "$work" | cut -f1) bytes; parts:"
for d in "$root"/.ray-stage/*/; do echo "  ${d#"$root"/} $(du -sb "$d" | cut -f1) bytes"; done
