#!/usr/bin/env bash
# ACTIONS_RUNNER_HOOK_JOB_STARTED: runs before every job on this runner, as the runner's user.
# A non-zero exit fails the job before its first step: the job never starts on a dirty GPU.
set -euo pipefail
GPUCLEAN=/opt/gpuclean/venv/bin/gpuclean

# Tag every process the job's steps start, so job-completed.sh can find them even if they leave the
# process tree (setsid, nohup, double fork). The trailing ':' keeps job 12 from matching job 123.
echo "GPUCLEAN_TEST=gha-${RUNNER_NAME}-${GITHUB_RUN_ID}-${GITHUB_RUN_ATTEMPT}:job" >> "$GITHUB_ENV"

# Wait up to two minutes for a previous job's processes to let go, then refuse to start.
status=0
"$GPUCLEAN" check --wait 120 || status=$?
if [ "$status" -eq 3 ]; then
  # A GPU needs a reset or is lost: waiting will not help, and every job here would fail. Take the runner
  # out of service (gpuclean never resets a GPU); an admin resets it and starts the runner again.
  echo "::error title=GPU not usable::$(hostname): a GPU needs a reset or is lost; runner taken out of service"
  "$GPUCLEAN" status
  touch /opt/gpuclean/OUT-OF-SERVICE
  sudo -n systemctl stop --no-block "actions.runner.*" 2>/dev/null || true
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "::error title=GPU not clean::$(hostname): the GPUs were not clean after 120 s; see 'Set up runner'"
  "$GPUCLEAN" status
  exit 1
fi
