#!/usr/bin/env bash
# A shell job that takes part in gpuwait's pausing protocol.
#
#   gpuwait --pausable --vram 4G -- ./job.sh WORKDIR
#
# It processes numbered chunks, remembering the next one in WORKDIR/next. When gpuwait sends
# the checkpoint signal (GPUWAIT_CHECKPOINT_SIGNAL) it finishes the chunk in hand, saves its
# place and exits with GPUWAIT_RESUME_EXIT; gpuwait starts it again later and it carries on.
set -euo pipefail
workdir=${1:?usage: job.sh WORKDIR [CHUNKS]}
chunks=${2:-20}
mkdir -p "$workdir"
next=$(cat "$workdir/next" 2>/dev/null || echo 0)

paused=0
if [ "${GPUWAIT_PAUSABLE:-}" = 1 ]; then
    trap 'paused=1' "${GPUWAIT_CHECKPOINT_SIGNAL:-USR1}"
fi

while [ "$next" -lt "$chunks" ]; do
    sleep 0.1 # one chunk of real work goes here
    echo "chunk $next done (run ${GPUWAIT_RESUME_COUNT:-0})" >>"$workdir/log"
    next=$((next + 1))
    echo "$next" >"$workdir/next.tmp" && mv "$workdir/next.tmp" "$workdir/next"
    if [ "$paused" = 1 ]; then
        exit "${GPUWAIT_RESUME_EXIT:-75}"
    fi
done
