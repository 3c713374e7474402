#!/usr/bin/env bash
# Run 67 (issue 37): Lightning's amp tests with the Open MPI fix, then GPyTorch whole and Lightning Fabric 1 in 3.
set -uo pipefail
OUT=${OUT:?}
start=$(date +%s)
bash .ci/install-offline 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/s .suites/wheels/*.whl && touch /tmp/s/.done
echo "== lightning amp, whole file, --gpuclean-all"
rm -rf /tmp/lt && cp -r .suites/lightning /tmp/lt
( cd /tmp/lt && PYTHONPATH=/tmp/s HF_HUB_OFFLINE=1 timeout -k 5 120 python3 -m pytest \
   tests/tests_fabric/plugins/precision/test_amp_integration.py -q -rfE -p gpuclean --gpuclean-all \
   --timeout=45 -p no:cacheprovider 2>&1 | tail -15; ps -eo pid,ppid,args | grep [o]rted || echo "no orted left" )
echo "amp done at $(( $(date +%s) - start )) s"
left=$(( 565 - ($(date +%s) - start) ))
echo "== suites with ${left}s left"
SUITES_SITE=/tmp/s SUITES_DEADLINE=$left WAY_TIMEOUT_GPYTORCH=170 WAY_TIMEOUT_LIGHTNING=120 SHARD_LIGHTNING=3 \
  bash benchmarks/peers/run_suites.sh $OUT/suites gpytorch lightning 2>&1 | grep -v "differs:" | cut -c1-400 | tail -40
echo "total $(( $(date +%s) - start )) s"
