#!/usr/bin/env bash
# GitLab runner pre_build_script (config.toml): runs in the job's shell before the job's script, as the
# runner's user. A non-zero exit fails the job before its script: the job never starts on a dirty GPU.
# No `set -e`: a command that fails on the way to taking the runner out of service must not skip the rest.
set -uo pipefail
GPUCLEAN=${GPUCLEAN:-/opt/gpuclean/venv/bin/gpuclean}

status=0
"$GPUCLEAN" check --wait 120 || status=$?
if [ "$status" -eq 3 ]; then
  # Waiting will not help, and every job here would fail: stop the runner's systemd unit (the sudoers rule in
  # docs/ci.md lets the runner's user do exactly this). That ends this job too, and every runner the same
  # gitlab-runner process serves. An admin resets the GPU (gpuclean never does) and starts it again.
  unit=${GPUCLEAN_RUNNER_UNIT:-gitlab-runner.service}
  echo "ERROR: a GPU on $(hostname) needs a reset or is lost; taking the runner out of service ($unit)"
  "$GPUCLEAN" status || true
  logger -t gpuclean "gitlab runner ${CI_RUNNER_DESCRIPTION:-?} taken out of service: a GPU needs a reset or is lost" || true
  sudo -n systemctl stop --no-block "$unit" \
    || echo "ERROR: sudo -n systemctl stop --no-block $unit failed; see the sudoers rule in docs/ci.md"
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "ERROR: the GPUs on $(hostname) were not clean after 120 s (gpuclean check exit $status)"
  "$GPUCLEAN" status || true
  exit 1
fi
