#!/usr/bin/env bash
# ACTIONS_RUNNER_HOOK_JOB_STARTED: runs before every job on this runner, as the runner's user.
# A non-zero exit fails the job before its first step: the job never starts on a dirty GPU.
# No `set -e`: a command that fails on the way to taking the runner out of service must not skip the rest.
set -uo pipefail
GPUCLEAN=${GPUCLEAN:-/opt/gpuclean/venv/bin/gpuclean}

# Tag every process the job's steps start, so job-completed.sh can find them even if they leave the
# process tree (setsid, nohup, double fork). The trailing ':' keeps job 12 from matching job 123.
if ! echo "GPUCLEAN_TEST=gha-${RUNNER_NAME}-${GITHUB_RUN_ID}-${GITHUB_RUN_ATTEMPT}:job" >> "$GITHUB_ENV"; then
  echo "::error title=gpuclean::cannot append to GITHUB_ENV: the job's processes would carry no cookie"
  exit 1
fi

# Take this runner out of service: stop its systemd unit (GPUCLEAN_RUNNER_UNIT in the runner's .env), which
# the sudoers rule in docs/ci.md lets the runner's user do, with exactly these arguments and nothing else.
# The reason goes to the system journal (journalctl -t gpuclean) and to the job's log.
out_of_service() {
  logger -t gpuclean "runner ${RUNNER_NAME} on $(hostname) taken out of service: $1" || true
  if [ -z "${GPUCLEAN_RUNNER_UNIT:-}" ]; then
    echo "::error title=Runner not stopped::GPUCLEAN_RUNNER_UNIT is not set in the runner's .env; stop the runner by hand"
  elif ! sudo -n systemctl stop --no-block "$GPUCLEAN_RUNNER_UNIT"; then
    echo "::error title=Runner not stopped::sudo -n systemctl stop --no-block $GPUCLEAN_RUNNER_UNIT failed; see the sudoers rule in docs/ci.md"
  fi
}

# Wait up to two minutes for a previous job's processes to let go, then refuse to start.
status=0
"$GPUCLEAN" check --wait 120 || status=$?
if [ "$status" -eq 3 ]; then
  # A GPU needs a reset or is lost: waiting will not help, and every job here would fail. An admin resets
  # it (gpuclean never resets a GPU) and starts the runner again.
  echo "::error title=GPU not usable::$(hostname): a GPU needs a reset or is lost; runner ${RUNNER_NAME} taken out of service"
  "$GPUCLEAN" status || true
  out_of_service "a GPU needs a reset or is lost (gpuclean check exit 3)"
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "::error title=GPU not clean::$(hostname): the GPUs were not clean after 120 s (gpuclean check exit $status); see 'Set up runner'"
  "$GPUCLEAN" status || true
  exit 1
fi
