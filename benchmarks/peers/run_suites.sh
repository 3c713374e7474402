#!/usr/bin/env bash
# Third-party GPU test suites, unmodified, plain and under `--gpuclean-all`, outcomes compared per test
# (docs/compat.md, "Real suites, unchanged"). After benchmarks/peers/stage_suites.sh (its .suites/ here):
#
#   bash benchmarks/peers/run_suites.sh OUTDIR [SUITE ...]    (suites: lightning pyg torchmetrics accelerate
#                                                              gpytorch joblib; default: all six)
#
# For each suite, benchmarks/peers/run_peers.py runs pytest twice in a copy of the staged suite: plugin off
# (`-p no:gpuclean`) and `-p gpuclean --gpuclean-all --gpuclean-report=...`, each with its JUnit XML, each test
# limited by pytest-timeout; it compares the outcomes test by test, runs every test whose outcome differs
# again alone both ways (a difference that does not reproduce is the suite's own flakiness), and lists
# gpuclean's findings (which test, which process, how it was found) and what outlived a session. On a machine
# without an NVIDIA driver the checks run on two idle simulated devices (`--simulate`): the suites' GPU tests
# skip there, and the checks are about processes.
#
# OUTDIR gets three files, rewritten after each suite (a run cut short keeps what it finished):
#   suites.json      the comparison per suite (tests, identical outcomes, each difference with both outcomes,
#                    gpuclean's findings, wall time each way, versions and sources); benchmarks/peers/
#                    suites_summary.py writes it
#   suites.txt       the table and run_peers.py's own output per suite
#   suites-logs.tgz  each run's pytest log, JUnit XML and gpuclean report
#
# Settings (environment):
#   PYTHON                python3 by default
#   SUITE_TEST_TIMEOUT    seconds a test may take (pytest-timeout; default 120)
#   SUITES_STALL_TIMEOUT  a way in which no test started or ended for this long is hung: killed, a time-out
#                         (default SUITE_TEST_TIMEOUT + 180: only a pytest stuck beyond its tests' own timeout
#                         meets it; a slow or busy box still ends a test now and then)
#   SUITES_DEADLINE       seconds the whole call may take: each suite keeps within what is left, a suite that
#                         cannot get one way's time is not started (on the GPU machine: 540, under 600 a call)
#   WAY_TIMEOUT_<SUITE>   seconds one way of that suite may take in all: with SUITES_DEADLINE, that suite's share
#                         of the call (defaults below); without it, SUITES_WAY_TIMEOUT (default 1200), a safety
#                         net alone, well above what any box takes (a way killed by a limit fails as TIMED OUT,
#                         its tests compared only where both ways ended them)
#   SUITES_SHARD=K        run the 1 test in K whose node id hashes to 0 (benchmarks/peers/peers_select.py;
#                         default 1: all); SHARD_<SUITE>=K for one suite; SHARD_<SUITE>=K/R runs part R
#                         (0..K-1) instead: K calls of parts 0..K-1 cover a suite that does not fit one call
#   SUITES_SITE           where the carried wheels go (default /tmp/gpuclean-suites-site)
#   SUITES_WORK           scratch folder (default a new one under /tmp)
#   SIMULATE              1: simulated devices (default: 1 where nvidia-smi finds no GPU)
#   SUITES_GPUCLEAN_ARGS  more arguments for the gpuclean way only, e.g. --gpuclean-helpers=torch_shm_manager
#   SUITES_REFERENCE_DIR  recorded plugin-off runs (run_peers.py --reference-dir): one recorded for the same
#                         suite, slice, Python, pytest, torch and library versions stands in for the off way
#                         (a test whose outcome differs from it still runs again alone, both ways)
#   SUITES_RECORD_REFERENCE=DIR  run the plugin-off way only and record it in DIR as that reference
# The suites run from a copy outside the checkout, so that pytest finds each suite's own configuration and
# never this project's pyproject.toml.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${1:?usage: run_suites.sh OUTDIR [SUITE ...]}
shift
all=(lightning pyg torchmetrics accelerate gpytorch joblib)
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=("${all[@]}")
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=${SUITES_WORK:-$(mktemp -d /tmp/gpuclean-suites.XXXXXX)}
mkdir -p "$work"
log="$out/suites.txt"
: > "$log"
say() { echo "$@" | tee -a "$log"; }

if [ -z "${SIMULATE:-}" ]; then
    SIMULATE=1
    nvidia-smi -L >/dev/null 2>&1 && SIMULATE=0
fi
# The plugin under test is this checkout's: on the GPU machine it is installed offline (editable) where
# python3 does not import it from here; elsewhere, say so rather than repoint a venv's install.
plugin=$("$py" -c 'import os, pytest_gpuclean; print(os.path.dirname(os.path.dirname(pytest_gpuclean.__file__)))' \
         2>/dev/null)
if [ "$plugin" != "$root" ]; then
    if [ "$SIMULATE" = 0 ] || [ "${SUITES_INSTALL_PLUGIN:-0}" = 1 ]; then
        # (.ci/install-offline uses python3: the one named by PYTHON where that is a path)
        if [[ $py == */* ]]; then PATH="$(dirname "$py"):$PATH" bash .ci/install-offline
        else bash .ci/install-offline; fi
    else
        echo "run_suites.sh: $py imports pytest_gpuclean from ${plugin:-nowhere}, not $root: PYTHONPATH=$root" \
             "(or SUITES_INSTALL_PLUGIN=1 to install it there, offline and editable)" >&2
        exit 2
    fi
fi
# The suites' test helpers the machine lacks (stage_suites.sh put them in .suites/wheels), in a folder of their
# own: never over what the machine has.
site=${SUITES_SITE:-/tmp/gpuclean-suites-site}
if [ -d .suites/wheels ] && [ ! -f "$site/.done" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .suites/wheels/*.whl \
        && touch "$site/.done"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# Nothing is fetched: the GPU machine has no network, and a test that would download must fail at once the
# same way in both runs. NVLink multicast stays off (example_suite/run_gpu.sh says why).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PL_RUN_STANDALONE_TESTS PL_RUN_CUDA_TESTS GPUCLEAN_SIMULATE GPUCLEAN_REPORT
say "== run_suites.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): suites ${suites[*]}, simulate=$SIMULATE, work $work"
[ "$SIMULATE" = 1 ] || nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv \
    | tee -a "$log"
"$py" -c 'import sys, torch, pytest; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.cuda.is_available(), "pytest", pytest.__version__)' 2>&1 | tee -a "$log"

# Every run gets caches of its own ({tag}: off, all, all-rerun-off, ...): the second way must not find
# what the first compiled (Inductor, Triton) or computed (torchmetrics' reference results), or it would
# skip the work (a compile worker pool never started) and look faster.
common_env=(--env "XDG_CACHE_HOME={work}/cache-{tag}" --env "TORCHINDUCTOR_CACHE_DIR={work}/cache-{tag}/inductor"
            --env "TRITON_CACHE_DIR={work}/cache-{tag}/triton")

started_all=$(date +%s)
for suite in "${suites[@]}"; do
    unset_env=()
    # What runs, and why (docs/compat.md, "Real suites, unchanged": the selection).
    case $suite in
    lightning)  # Lightning Fabric's whole suite: accelerators, the ddp/ddp_spawn/subprocess-script launchers
        # and their integration tests (ranks spawned on CPU and on the GPU), collectives, precision plugins.
        # Standalone tests (PL_RUN_STANDALONE_TESTS) and those needing 2+ GPUs skip, as upstream on one GPU.
        # Of test_spike.py's 24 runs of one Fabric launch (16 of them 2 ranks, ddp_spawn: 4 of the suite's 5
        # minutes on the CPU box), the 6 with no spike value are kept: the 18 that inject nan/inf launch the
        # same processes.
        targets=(tests/tests_fabric -k "not (spike_detection_integration and (nan or inf))")
        libs=lightning,pytorch-lightning,torch; env=(); way_default=200 ;;
    pyg)  # PyG's whole suite (its pyproject deselects the `rag` and `dataset` marks, which download); every
        # @withCUDA / @withDevice test runs on cpu and cuda:0; torch.compile tests, DataLoader workers.
        targets=(test); libs=torch-geometric,torch; env=(); way_default=220 ;;
    torchmetrics)  # regression, bases and wrappers: metrics checked against scipy/sklearn on cuda, the DDP
        # tests through torchmetrics' own pool of 2 spawned gloo ranks started by its conftest at session
        # start (USE_PYTEST_POOL=1, as its GPU CI runs them). Left out: files whose reference library is not
        # on the H200 image (properscoring, permetrics, torch-fidelity).
        targets=(tests/unittests/regression tests/unittests/bases tests/unittests/wrappers
                 --ignore=tests/unittests/regression/test_crps.py
                 --ignore=tests/unittests/regression/test_mean_error.py
                 --ignore=tests/unittests/wrappers/test_feature_share.py)
        libs=torchmetrics,torch
        env=(--env USE_PYTEST_POOL=1 --env "PYTEST_REFERENCE_CACHE={work}/cache-{tag}/references")
        way_default=120 ;;
    accelerate)  # everything but test_cli.py and test_examples.py (they need tests/test_configs, the examples
        # and the hub, which the sdist does not ship) and test_tracking.py (loggers, no GPU work).
        targets=(tests --ignore=tests/test_cli.py --ignore=tests/test_examples.py --ignore=tests/test_tracking.py)
        libs=accelerate,torch; env=(); way_default=90 ;;
    gpytorch)  # the whole suite: kernels, likelihoods, variational strategies, the examples' training loops,
        # and their *_cuda variants on the GPU.
        targets=(test); libs=gpytorch,linear-operator,torch; env=(); way_default=120 ;;
    joblib)  # joblib's own suite, a CPU one: loky's reusable executor (joblib.Parallel's default backend) in
        # nearly every parallel test, kept in a module global across tests, its resource tracker, the
        # multiprocessing and threading backends, managers, memmapping (docs/compat.md: a library's pool).
        # Its conftest fails every test at teardown if a thread-count variable is set (it checks none
        # leaks from a test): the suite runs without CI's OMP_NUM_THREADS, and joblib sizes its own pools.
        targets=(joblib/test); libs=joblib; env=(); way_default=240; unset_env=(-u OMP_NUM_THREADS) ;;
    *)
        say "run_suites.sh: no suite $suite (suites: ${all[*]})"; continue ;;
    esac
    if [ ! -d ".suites/$suite" ]; then
        say "== $suite: not staged (bash benchmarks/peers/stage_suites.sh $suite)"; continue
    fi
    # (way_default: that suite's share of a device call; a length to keep to only where a call has one)
    [ -n "${SUITES_DEADLINE:-}" ] || way_default=${SUITES_WAY_TIMEOUT:-1200}
    var="WAY_TIMEOUT_${suite^^}"
    way_timeout=${!var:-$way_default}
    # The suite's budget: its two ways and, at worst, the reruns of its differences (4 ways), within what
    # SUITES_DEADLINE leaves (less 30 s for the summary and the archive); a suite that cannot get one way's
    # time is not started. Without SUITES_DEADLINE there is none: the way limits alone (safety nets).
    suite_budget=$((4 * way_timeout + 60))
    budget=()
    if [ -n "${SUITES_DEADLINE:-}" ]; then
        left=$((started_all + SUITES_DEADLINE - $(date +%s) - 30))
        if [ "$left" -lt "$way_timeout" ]; then
            say "== $suite: not started: ${left}s left of SUITES_DEADLINE=$SUITES_DEADLINE, a way may take ${way_timeout}s"
            continue
        fi
        [ "$suite_budget" -le "$left" ] || suite_budget=$left
        budget=(--budget "$suite_budget")
    fi
    var="SHARD_${suite^^}"
    shard=${!var:-${SUITES_SHARD:-1}}
    part=0
    if [[ $shard == */* ]]; then part=${shard#*/}; shard=${shard%/*}; fi
    rm -rf "${work:?}/suites/$suite" "$work/$suite" && mkdir -p "$work/suites"
    cp -r ".suites/$suite" "$work/suites/$suite"
    say ""
    say "== $suite $(grep -E '^(version|tag|commit|file)=' ".suites/$suite/SOURCE" | tr '\n' ' ')"
    ways=off,all
    reference=()
    if [ -n "${SUITES_RECORD_REFERENCE:-}" ]; then ways=off; reference=(--record-reference "$SUITES_RECORD_REFERENCE")
    elif [ -n "${SUITES_REFERENCE_DIR:-}" ]; then reference=(--reference-dir "$SUITES_REFERENCE_DIR"); fi
    args=(dir --suite-dir "$work/suites/$suite" --name "$suite" --libs "$libs" --ways "$ways" "${reference[@]}"
          --keep-work "$work/$suite" --out "$work/$suite.json" --way-timeout "$way_timeout" --max-reruns 40
          "${budget[@]}" --stall-timeout "${SUITES_STALL_TIMEOUT:-$(( ${SUITE_TEST_TIMEOUT:-120} + 180 ))}"
          --shard "$shard" --shard-part "$part"
          "${common_env[@]}" "${env[@]}" --pytest-args="--timeout=${SUITE_TEST_TIMEOUT:-120} -rfE --durations=10"
          --gpuclean-args="${SUITES_GPUCLEAN_ARGS:-}")
    [ "$SIMULATE" = 1 ] && args+=(--simulate)
    started=$(date +%s)
    # (run_peers.py keeps to its limits; the timeout is the last resort, and loses the suite's result.)
    env "${unset_env[@]}" timeout -k 10 $((suite_budget + 30)) "$py" benchmarks/peers/run_peers.py "${args[@]}" \
        -- "${targets[@]}" \
        2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        say "== $suite: TIMED OUT: run_peers.py killed after $(( $(date +%s) - started ))s (the suite's last-resort" \
            "limit, $((suite_budget + 30))s)"
    else
        say "== $suite: run_peers.py exit $rc after $(( $(date +%s) - started ))s"
    fi
    "$py" benchmarks/peers/suites_summary.py --work "$work" --staged .suites --out "$out/suites.json" \
        "${suites[@]}" >/dev/null
    tar czf "$out/suites-logs.tgz" -C "$work" --exclude='suites' --exclude='cache-*' --exclude='sim' \
        --exclude='locks' --exclude='torch-temp' . 2>/dev/null
done
say ""
"$py" benchmarks/peers/suites_summary.py --work "$work" --staged .suites --out "$out/suites.json" "${suites[@]}" \
    | tee -a "$log"
