#!/bin/sh
# The chaos suite's publisher: the seed's publisher (examples/publisher),
# writing every 50 ms and logging every attempt, accepted or refused, as
# "<monotonic-ish ns> <token> <accepted 1|0> <pid> <owner> <shard>" in
# $CHAOS_DIR/attempts. It stops at the first refused write, like the seed's.
# In shard mode each shard has a store of its own, digests.<shard>.db.
set -u
store=$STORE
shard=${LEADERRUN_SHARD:--}
if [ "$shard" != - ]; then
    DIGESTS_DB=$CHAOS_DIR/digests.$shard.db
    export DIGESTS_DB
fi
stopping=0
trap 'stopping=1' TERM INT
n=0
while [ "$stopping" = 0 ]; do
    n=$((n + 1))
    if setsid -w "$store" write "$LEADERRUN_OWNER #$n"; then accepted=1; else accepted=0; fi
    now=$(date +%s%N) || exit 1
    echo "$now $LEADERRUN_TOKEN $accepted $$ $LEADERRUN_OWNER $shard" >> "$CHAOS_DIR/attempts"
    [ "$accepted" = 1 ] || exit 1
    sleep 0.05 &
    wait $! 2>/dev/null
done
