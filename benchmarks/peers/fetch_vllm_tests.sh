#!/usr/bin/env bash
# vLLM's own test suite, fetched at run time from the package registry (the project keeps none of its code):
# the sdist of the vLLM version installed in VENV, unpacked to DEST/tests plus its pyproject.toml (the pytest
# markers the suite declares). The sdist's vllm/ source is left out, so the tests import the installed vLLM.
#
#   bash benchmarks/peers/fetch_vllm_tests.sh VENV DEST [VERSION]
#
# pip prepares an sdist's metadata before it saves it; vLLM's setup.py needs torch (the venv has it) and a
# few build helpers (put in a throwaway folder), VLLM_TARGET_DEVICE=empty (no compiler) and the version
# pinned (otherwise the metadata says 0.32.0+empty and pip refuses the file).
set -euo pipefail
venv=${1:?usage: fetch_vllm_tests.sh VENV DEST [VERSION]}
dest=${2:?usage: fetch_vllm_tests.sh VENV DEST [VERSION]}
py="$venv/bin/python"
version=${3:-$("$py" -c 'import vllm; print(vllm.__version__.split("+")[0])')}
if [ -f "$dest/tests/utils.py" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
    echo "vLLM $version tests already in $dest"; exit 0
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$py" -m pip install -q --no-deps --target "$scratch/build" setuptools-rust setuptools-scm vcs-versioning \
    semantic-version
PYTHONPATH="$scratch/build" VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="$version" \
    "$py" -m pip download -q --no-deps --no-binary vllm --no-build-isolation -d "$scratch" "vllm==$version"
tar -xzf "$scratch/vllm-$version.tar.gz" -C "$scratch" "vllm-$version/tests" "vllm-$version/pyproject.toml"
rm -rf "$dest" && mkdir -p "$dest"
mv "$scratch/vllm-$version/tests" "$scratch/vllm-$version/pyproject.toml" "$dest/"
echo "$version" > "$dest/VERSION"
echo "vLLM $version tests in $dest ($(find "$dest/tests" -name 'test_*.py' | wc -l) test files)"
