#!/usr/bin/env bash
# ACTIONS_RUNNER_HOOK_JOB_COMPLETED: runs after every job on this runner (also failed or cancelled
# ones), as the runner's user. Ends what the job left on this runner's GPUs, and what carries its cookie.
set -uo pipefail
GPUCLEAN=${GPUCLEAN:-/opt/gpuclean/venv/bin/gpuclean}

"$GPUCLEAN" reap --grace 10 --cookie "gha-${RUNNER_NAME}-${GITHUB_RUN_ID}-${GITHUB_RUN_ATTEMPT}:"
status=$?
"$GPUCLEAN" status
# 1: a process survived SIGKILL (uninterruptible sleep in the driver?); 3: a GPU could not be read (lost),
# what was provably the job's was ended all the same. Either way the next job's check refuses to start
# (exit 3 takes the runner out of service there); say so here, where the cause is.
exit "$status"
