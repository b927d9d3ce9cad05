#!/bin/sh
# The seed's publisher: writes "<owner> #<n>" every $PUBLISH_EVERY seconds
# (0.5) with its fencing token, checks that each write was accepted, and stops
# at the first one the fence refuses. Told its term is ending (the yield
# signal), it finishes the unit it is in and exits 0.
set -u
store=$(dirname "$0")/store.sh
stopping=0
trap 'stopping=1' TERM INT
n=0
while [ "$stopping" = 0 ]; do
    n=$((n + 1))
    # The yield signal goes to the whole process group; the write runs in a
    # session of its own so that it completes rather than dying half-way.
    # (Its result is still only accepted if the fence allows it.)
    if ! setsid -w "$store" write "$LEADERRUN_OWNER #$n"; then
        echo "$LEADERRUN_OWNER: write #$n with token $LEADERRUN_TOKEN refused by the fence; stopping" >&2
        exit 1
    fi
    echo "$LEADERRUN_OWNER published #$n with token $LEADERRUN_TOKEN"
    # In the background, so the trap runs as soon as the signal arrives.
    sleep "${PUBLISH_EVERY:-0.5}" &
    wait $! 2>/dev/null
done
