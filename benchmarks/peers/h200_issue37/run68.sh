#!/usr/bin/env bash
# Run 68 (issue 37): what the 65 MiB growth of test_amp_fused_optimizer_parity is; accelerate 1 in 2, PyG 1 in 4.
set -uo pipefail
OUT=${OUT:?}
start=$(date +%s)
bash .ci/install-offline 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/s .suites/wheels/*.whl && touch /tmp/s/.done
rm -rf /tmp/lt && cp -r .suites/lightning /tmp/lt && cp benchmarks/peers/h200_issue37/diag_growth.py /tmp/lt/
( cd /tmp/lt && PYTHONPATH=/tmp/s:/tmp/lt HF_HUB_OFFLINE=1 timeout -k 5 90 python3 -m pytest -s \
   "tests/tests_fabric/plugins/precision/test_amp_integration.py" -q -p diag_growth -p no:gpuclean \
   --timeout=45 -p no:cacheprovider 2>&1 | grep -E "DIAG|passed|failed" | tail -12 )
echo "diag done at $(( $(date +%s) - start )) s"
left=$(( 555 - ($(date +%s) - start) ))
echo "== suites with ${left}s left"
SUITES_SITE=/tmp/s SUITES_DEADLINE=$left WAY_TIMEOUT_ACCELERATE=120 SHARD_ACCELERATE=2 WAY_TIMEOUT_PYG=110 SHARD_PYG=4 \
  bash benchmarks/peers/run_suites.sh $OUT/suites accelerate pyg 2>&1 | grep -v "differs:" | cut -c1-400 | tail -40
echo "total $(( $(date +%s) - start )) s"
