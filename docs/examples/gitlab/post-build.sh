#!/usr/bin/env bash
# GitLab runner post_build_script (config.toml), and the job's after_script (.gitlab-ci.yml): ends what the
# job left on this runner's GPUs, and whatever carries its cookie. Run twice after a job that passed: the
# second finds nothing to end. It never ends itself or its ancestors (the job's shell carries the cookie).
set -uo pipefail
GPUCLEAN=${GPUCLEAN:-/opt/gpuclean/venv/bin/gpuclean}

"$GPUCLEAN" reap --grace 10 --cookie "gitlab-${CI_JOB_ID}:"
status=$?
"$GPUCLEAN" status
# 1: a process survived SIGKILL; 3: a GPU could not be read (lost), the job's processes were ended all the
# same. Both fail a job that passed (from post_build_script); the next job's gate stops the runner for 3.
exit "$status"
