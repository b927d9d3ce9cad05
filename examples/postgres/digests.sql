-- The example job's own table (examples/postgres/publish.sh), in the same
-- database as leaderrun's lease.
CREATE TABLE IF NOT EXISTS digests (
    token      bigint NOT NULL,
    body       text NOT NULL,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
