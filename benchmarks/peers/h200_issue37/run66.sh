#!/usr/bin/env bash
# Run 66 (issue 37): Lightning's amp finding, then accelerate and GPyTorch whole, plain vs --gpuclean-all.
set -uo pipefail
OUT=${OUT:?}
start=$(date +%s)
bash .ci/install-offline 2>&1 | tail -3
echo "install: $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv
git log -1 --format='commit %H' 2>/dev/null || true
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/s .suites/wheels/*.whl && touch /tmp/s/.done
echo "== lightning amp diagnosis"
rm -rf /tmp/lt && cp -r .suites/lightning /tmp/lt
( cd /tmp/lt && PYTHONPATH=/tmp/s HF_HUB_OFFLINE=1 timeout -k 5 120 python3 -m pytest \
   tests/tests_fabric/plugins/precision/test_amp_integration.py -v -rA -x -p gpuclean --gpuclean-all \
   --gpuclean-report=$OUT/amp-report.json --timeout=45 -p no:cacheprovider 2>&1 | tail -80 )
echo "amp done at $(( $(date +%s) - start )) s"
python3 - <<'PY' "$OUT/amp-report.json"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no report:", e); sys.exit()
for t in r.get("tests", []):
    if t.get("outcome") != "clean" or t.get("findings"):
        print(json.dumps(t, indent=1)[:6000])
PY
left=$(( 560 - ($(date +%s) - start) ))
echo "== suites with ${left}s left"
SUITES_SITE=/tmp/s SUITES_DEADLINE=$left WAY_TIMEOUT_ACCELERATE=150 WAY_TIMEOUT_GPYTORCH=150 \
  bash benchmarks/peers/run_suites.sh $OUT/suites accelerate gpytorch 2>&1 | tail -40
echo "total $(( $(date +%s) - start )) s"
