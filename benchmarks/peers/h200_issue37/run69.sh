#!/usr/bin/env bash
# Run 69 (issues 39 and 37): the refactored core on the H200 (tests/gpu but Ray, the guest probe with real
# NVML), then Lightning Fabric part 1 of 2.
set -uo pipefail
OUT=${OUT:?}
start=$(date +%s)
bash .ci/install-offline 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/s .suites/wheels/*.whl && touch /tmp/s/.done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/xd .suites/xdist/*.whl
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv
echo "== tests/gpu (not ray) at $(( $(date +%s) - start )) s"
PYTHONPATH=/tmp/xd timeout -k 5 250 python3 -m pytest tests/gpu -v -p no:cacheprovider -k "not ray" \
  --junitxml=$OUT/gpu-junit.xml > $OUT/tests-gpu.log 2>&1
echo "rc $?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $OUT/tests-gpu.log | cut -c1-220 | tail -40
echo "== guest probe, real NVML, at $(( $(date +%s) - start )) s"
GUEST_REAL_GPU=1 PYTHONPATH=/tmp/xd timeout -k 5 100 python3 -m pytest tests/test_guest.py -q -p no:cacheprovider \
  -k observes > $OUT/guest.log 2>&1
echo "rc $?"; tail -6 $OUT/guest.log | cut -c1-300
left=$(( 565 - ($(date +%s) - start) ))
echo "== lightning 2/0 with ${left}s left"
SUITES_SITE=/tmp/s SUITES_DEADLINE=$left WAY_TIMEOUT_LIGHTNING=150 SHARD_LIGHTNING=2/0 \
  bash benchmarks/peers/run_suites.sh $OUT/suites lightning 2>&1 | grep -v "differs:" | cut -c1-400 | tail -30
echo "total $(( $(date +%s) - start )) s"
