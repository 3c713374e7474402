#!/bin/bash
# gpuclean's cost in instructions (valgrind callgrind): deterministic to a few instructions, so a before/after
# needs one run each even on a loaded machine. Usage: PYTHON=venv/bin/python bash benchmarks/instructions.sh
# (the plugin installed in that venv is the one measured, or the package under TREE: TREE=dir holding a
# pytest_gpuclean/ folder, e.g. from `git archive REV pytest_gpuclean | tar -x -C dir`). Prints instructions added by -p gpuclean against
# -p no:gpuclean plus an empty plugin (the same entry-point lookup), autoload off, to an idle 50-test suite
# (pytest -q and --co) and to 1 and 21 marked tests on 8 simulated devices with locks.
set -euo pipefail
P=${PYTHON:-.venv/bin/python}
P="$(cd "$(dirname "$P")" && pwd)/$(basename "$P")"  # absolute (the runs cd elsewhere), the venv's own link
# The package measured, byte-compiled first: the runs do not write .pyc files, and a module compiled from
# source in a run would count its compilation.
"$P" -m compileall -q "$(cd / && PYTHONPATH=${TREE:-} "$P" -c 'import os, pytest_gpuclean; print(os.path.dirname(pytest_gpuclean.__file__))')" >/dev/null
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/noop" "$T/idle" "$T/c1" "$T/c21" "$T/locks" "$T"/sim/{0..7}
echo '"""empty"""' > "$T/noop/gpuclean_bench_noop.py"
"$P" - "$T" <<'PY'
import sys
root = sys.argv[1]
for name, n, marked in (("idle", 50, False), ("c1", 1, True), ("c21", 21, True)):
    open(f"{root}/{name}/pytest.ini", "w").write("[pytest]\nmarkers =\n    needs_clean_gpus: x\n")
    with open(f"{root}/{name}/test_gen.py", "w") as f:
        f.write("import pytest\n" + ("pytestmark = pytest.mark.needs_clean_gpus\n" if marked else ""))
        for i in range(n):
            f.write(f"def test_{i}():\n    pass\n")
PY
cg() {
  local dir=$1; shift
  (cd "$T/$dir" && env PYTHONPATH="$T/noop${TREE:+:$TREE}" PYTHONHASHSEED=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1 \
     GPUCLEAN_SIMULATE="$T/sim" GPUCLEAN_LOCK_DIR="$T/locks" valgrind --tool=callgrind \
     --callgrind-out-file=/dev/null "$P" -m pytest -p no:cacheprovider -q "$@" 2>&1 | awk '/Collected/ {print $4}')
}
OFF=(-p no:gpuclean -p gpuclean_bench_noop)
a=$(cg idle "${OFF[@]}"); b=$(cg idle -p gpuclean); c=$(cg idle --co "${OFF[@]}"); d=$(cg idle --co -p gpuclean)
echo "idle -q: +$(( (b - a) / 1000 ))k instructions; idle --co: +$(( (d - c) / 1000 ))k"
o1=$(cg c1 "${OFF[@]}"); g1=$(cg c1 -p gpuclean); o21=$(cg c21 "${OFF[@]}"); g21=$(cg c21 -p gpuclean)
slope=$(( ((g21 - o21) - (g1 - o1)) / 20 ))
echo "checked (8 sim devices, locks): per test +$(( slope / 1000 ))k; fixed +$(( ((g1 - o1) - slope) / 1000 ))k"
