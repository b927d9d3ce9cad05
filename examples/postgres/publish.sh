#!/bin/sh
# A job whose data lives in the same PostgreSQL as its lease: the fence is
# checked inside the transaction that writes, so a stale leader's write is
# refused atomically with the check (README, "The fence in your own
# transaction").
#
#     leaderrun --backend "$DATABASE_URL" --key digest -- examples/postgres/publish.sh BODY
#
# DATABASE_URL: the database, as psql takes it; LEADERRUN_KEY and
# LEADERRUN_TOKEN: set by leaderrun. The table: examples/postgres/digests.sql.
# Exits 0 when the row is written, 3 when the fence refused it (a newer term
# holds the lease: stop, and do not retry with this token), 1 otherwise.
set -eu
out=$(psql "$DATABASE_URL" -X -q -At -v ON_ERROR_STOP=1 \
    -v key="$LEADERRUN_KEY" -v token="$LEADERRUN_TOKEN" -v body="$1" 2>&1 <<'SQL'
BEGIN;
SELECT leaderrun_fence(:'key', :'token');
INSERT INTO digests (token, body) VALUES (:'token', :'body');
COMMIT;
SQL
) && exit 0
case $out in
*"does not hold the lease"*)
    echo "publish: refused, token $LEADERRUN_TOKEN no longer holds $LEADERRUN_KEY" >&2
    exit 3 ;;
*)
    echo "publish: $out" >&2
    exit 1 ;;
esac
