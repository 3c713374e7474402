#!/usr/bin/env bash
# One device call of at most TOTAL seconds: the example suite in one pytest run, then what fits of the plugin's
# costs (after uninstalling the plugin, whose editable finder would shadow the trees the benchmarks measure).
set -u -o pipefail
cd "$(dirname "$0")/.."
TOTAL=${TOTAL:-440}
start=$(date +%s)
mkdir -p "$OUT/example"
echo "== example suite at $(( $(date +%s) - start )) s"
( time timeout -s INT "${SUITE_S:-300}" bash example_suite/run_gpu.sh --durations=30 \
    --junitxml="$OUT/example/junit.xml" ) > "$OUT/example/run.log" 2>&1
echo "rc=$?"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^real|checked test" "$OUT/example/run.log" | cut -c1-200 | tail -45
sed -n '/slowest/,/passed\|failed/p' "$OUT/example/run.log" | head -36
python3 -m pip uninstall -y -q pytest-gpuclean 2>&1 | tail -1
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$purelib"/__pycache__/pynvml.*.pyc  # pynvml as the image ships it (the suite's set-up compiled it)
left=$(( TOTAL - 10 - ($(date +%s) - start) ))
echo "== costs at $(( $(date +%s) - start )) s, ${left} s left"
if [ "$left" -gt 200 ]; then trees=bench-before,WORKTREE; before=bench-before; else trees=WORKTREE; before=; fi
if [ "$left" -gt 60 ]; then
    timeout 40 python3 benchmarks/nvml_start.py --runs 3 --json "$OUT/nvml_start.json" 2>&1 | tail -8
    left=$(( TOTAL - 10 - ($(date +%s) - start) ))
    timeout -k 3 $(( left * 2 / 3 )) python3 benchmarks/bench_gpu_cost.py --trees "$trees" --rounds 3 --tests 20 \
        --big-tests 120 --json "$OUT/gpu_cost.json" 2>&1 | grep -v "^round" | tail -14
    for tree in $before .; do
        left=$(( TOTAL - 5 - ($(date +%s) - start) ))
        [ "$left" -gt 25 ] || break
        timeout -k 3 "$left" python3 "$tree/benchmarks/bench_release_gpu.py" --out "$OUT/release-${tree//\//_}" \
            --repeat 2 --vllm-repeat 0 2>&1 | grep -E "driver release|reap_term_latency|package" | tail -4
    done
fi
echo "== done at $(( $(date +%s) - start )) s"
