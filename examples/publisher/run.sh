#!/bin/sh
# Replays the seed's run ("A publisher on one replica") with leaderrun, on the
# file backend and, when redis-server is installed, on Redis:
#
#   1. two replicas; pod-a publishes with token 1; it is stopped the way a
#      deploy stops it (SIGTERM): its unit finishes, the lease is released,
#      and pod-b takes over with token 2. The gap is measured.
#   2. a lock backend that lost its data, under a store that has seen token
#      50: with --fence-floor-cmd the first term draws 51 and its claim goes
#      through at once.
#   3. the same without the floor command: claims are refused until the
#      counter passes 50. The time that takes is measured.
#
# Usage: examples/publisher/run.sh [file] [redis]    (default: both)
# Needs sqlite3, redis-server for Redis, and leaderrun: $LEADERRUN if set,
# else the checkout's own build (target/release or target/debug, the newer),
# else the one on PATH.
# Timing comes from the usual LEADERRUN_* variables (defaults otherwise).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
checkout=$(cd "$here/../.." && pwd)
leaderrun=${LEADERRUN:-}
if [ -z "$leaderrun" ]; then
    for build in "$checkout/target/release/leaderrun" "$checkout/target/debug/leaderrun"; do
        [ -x "$build" ] || continue
        if [ -z "$leaderrun" ] || [ "$build" -nt "$leaderrun" ]; then leaderrun=$build; fi
    done
fi
if [ -z "$leaderrun" ]; then
    leaderrun=$(command -v leaderrun) || {
        echo "run.sh: no leaderrun: build it (cargo build --release) or install it (cargo install --locked --path .)" >&2
        exit 1
    }
fi
work=$(mktemp -d)
redis_pid=
cleanup() {
    [ -z "$redis_pid" ] || kill -9 "$redis_pid" 2>/dev/null || true
    pkill -9 -f "leaderrun.*--key digest-publisher-$$" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
store() { "$here/store.sh" "$@"; }
ms_now() { echo $(( $(date +%s%N) / 1000000 )); }
query() { sqlite3 -batch -cmd '.timeout 10000' "$DIGESTS_DB" "$1"; }
# Waits (up to 120 s) until the query prints something other than 0 or nothing.
wait_for() {
    i=0
    while :; do
        out=$(query "$1")
        [ -n "$out" ] && [ "$out" != 0 ] && return 0
        i=$((i + 1))
        [ $i -lt 12000 ] || { echo "timed out waiting for: $1" >&2; exit 1; }
        sleep 0.01
    done
}
replica() { # OWNER URL ARGS... : start a replica in the background
    owner=$1 url=$2; shift 2
    "$leaderrun" --backend "$url" --key "digest-publisher-$$" --owner "$owner" -q \
        --claim-cmd "$here/store.sh claim" "$@" -- "$here/publish.sh" >>"$work/out" 2>&1 &
}

run_backend() { # NAME URL-FOR-STEP-1 URL-AFTER-LOSS (a function that loses the data)
    name=$1 url=$2 lose=$3
    echo "== $name backend"

    export DIGESTS_DB="$work/$name-1.db"
    store init 0
    replica pod-a "$url"; a=$!
    wait_for "SELECT count(*) FROM published WHERE token = 1"
    replica pod-b "$url"; b=$!
    sleep 1.2
    stopped=$(ms_now)
    kill -TERM "$a"; wait "$a" || true
    wait_for "SELECT count(*) FROM published WHERE token = 2"
    kill -TERM "$b"; wait "$b" || true
    echo "step 1: pod-a published $(query "SELECT count(*) FROM published WHERE token = 1") units with token 1 and was stopped (SIGTERM); pod-b took over with token 2"
    echo "step 1: pod-b's first write came $(( $(query "SELECT min(at_ms) FROM published WHERE token = 2") - stopped )) ms after the stop (the seed promises within 500 ms)"

    $lose
    export DIGESTS_DB="$work/$name-2.db"
    store init 50
    start=$(ms_now)
    replica pod-a "$url" --fence-floor-cmd "$here/store.sh floor"; a=$!
    wait_for "SELECT count(*) FROM published"
    echo "step 2: with --fence-floor-cmd the first term drew token $(query "SELECT min(token) FROM published") and published after $(( $(ms_now) - start )) ms"
    kill -TERM "$a"; wait "$a" || true

    $lose
    export DIGESTS_DB="$work/$name-3.db"
    store init 50
    start=$(ms_now)
    replica pod-a "$url"; a=$!
    wait_for "SELECT count(*) FROM published"
    took=$(( $(ms_now) - start ))
    echo "step 3: without it, claims were refused up to token 50; token $(query "SELECT min(token) FROM published") published after $took ms"
    kill -TERM "$a"; wait "$a" || true
}

for backend in ${*:-file redis}; do
    case $backend in
    file)
        state=$work/state
        lose_file() { rm -rf "$state"; }
        run_backend file "file:$state" lose_file ;;
    redis)
        if ! command -v redis-server >/dev/null; then
            echo "== redis backend: skipped (no redis-server)"
            continue
        fi
        socket=$work/redis.sock
        redis-server --port 0 --unixsocket "$socket" --save '' --appendonly no --dir "$work" >/dev/null &
        redis_pid=$!
        # leaderrun holds off a Redis that started less than one ttl ago (a
        # fresh server may have lost a lease whose holder is still stopping):
        # a first term waits that out.
        until [ -S "$socket" ]; do sleep 0.05; done
        "$leaderrun" --backend "redis+unix://$socket" --key "warm-up-$$" -q -- true
        lose_redis() { redis-cli -s "$socket" FLUSHALL >/dev/null; }
        run_backend redis "redis+unix://$socket" lose_redis ;;
    *) echo "unknown backend $backend: use file or redis" >&2; exit 2 ;;
    esac
done
