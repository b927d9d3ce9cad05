#!/bin/sh
# The seed's fenced store (FencedDigests) in a real SQLite file: one row per
# digest with the highest token that wrote it, and every accepted write kept
# in order, with its time.
#
#   store.sh init [FENCE]   create the tables; the fence starts at FENCE (0)
#   store.sh claim          a term's first write: the stored fence must be lower
#   store.sh write BODY     later writes: the stored fence may be equal
#   store.sh floor          print the fence (for --fence-floor-cmd)
#
# claim and write take the token from $LEADERRUN_TOKEN and exit 1 when the
# fence refuses them. The database is $DIGESTS_DB (default ./digests.db).
set -eu
db=${DIGESTS_DB:-digests.db}
sql() { sqlite3 -batch -cmd '.timeout 10000' "$db" "$1"; }
now="CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

case ${1:-} in
init)
    sql "CREATE TABLE IF NOT EXISTS digests (name TEXT PRIMARY KEY, fence INTEGER NOT NULL, body TEXT NOT NULL DEFAULT '');
         CREATE TABLE IF NOT EXISTS published (seq INTEGER PRIMARY KEY AUTOINCREMENT, token INTEGER NOT NULL, body TEXT NOT NULL, at_ms INTEGER NOT NULL);
         INSERT OR IGNORE INTO digests (name, fence) VALUES ('digest', ${2:-0});" ;;
claim)
    token=$((LEADERRUN_TOKEN + 0))
    changed=$(sql "UPDATE digests SET fence = $token WHERE name = 'digest' AND fence < $token; SELECT changes();")
    [ "$changed" = 1 ] ;;
write)
    token=$((LEADERRUN_TOKEN + 0))
    body=$(printf %s "$2" | sed "s/'/''/g")
    changed=$(sql "BEGIN IMMEDIATE;
        UPDATE digests SET body = '$body', fence = $token WHERE name = 'digest' AND fence <= $token;
        INSERT INTO published (token, body, at_ms) SELECT $token, '$body', $now WHERE changes() = 1;
        SELECT changes();
        COMMIT;")
    [ "$changed" = 1 ] ;;
floor)
    sql "SELECT fence FROM digests WHERE name = 'digest';" ;;
*)
    echo "usage: store.sh init [FENCE] | claim | write BODY | floor" >&2
    exit 2 ;;
esac
