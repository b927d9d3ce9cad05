-- leaderrun's tables on PostgreSQL.
--
-- leaderrun creates them itself on first use when its role may (CREATE on
-- the schema, and on the database for a schema that does not exist yet).
-- A DBA who would rather create them by hand runs, as a role that may:
--
--     psql -v schema=leaderrun -f sql/postgres.sql
--
-- (without -v schema=…, in the schema public), then grants leaderrun's role
-- only what it needs with sql/postgres-grant.sql, and starts leaderrun with
-- ?schema=leaderrun in its URL. Running this file again changes nothing.
\if :{?schema}
\else
\set schema public
\endif

CREATE SCHEMA IF NOT EXISTS :"schema";

-- One row per key: the token counter and the lease. A row is never deleted
-- (release only ends the lease), so tokens never start again.
CREATE TABLE IF NOT EXISTS :"schema".leaderrun_lease (
    key             text PRIMARY KEY,
    -- The largest token issued (or the floor --fence-floor-cmd set).
    counter         bigint NOT NULL DEFAULT 0 CHECK (counter >= 0),
    -- The holder's token, and who holds it: "<instance>" and its attempt.
    token           bigint NOT NULL DEFAULT 0,
    holder_instance text,
    holder_attempt  bigint,
    owner           text NOT NULL DEFAULT '',
    -- The lease is held while this is in the future, by the server's clock.
    expires_at      timestamptz NOT NULL DEFAULT 'epoch'
);

-- One row per running replica of a key, refreshed as it campaigns and
-- renews; a graceful exit deletes it, a dead replica's expires.
CREATE TABLE IF NOT EXISTS :"schema".leaderrun_candidate (
    key         text NOT NULL,
    instance    text NOT NULL,
    owner       text NOT NULL,
    host        text NOT NULL,
    pid         integer NOT NULL,
    since_ms    bigint NOT NULL,
    seen_at     timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    leads       boolean NOT NULL DEFAULT false,
    -- A follower's place in line: its connection (which LISTENs) and since
    -- when it waits. A release notifies the one that has waited longest.
    listen_pid  integer,
    placed_at   timestamptz,
    PRIMARY KEY (key, instance)
);

-- The fence in a job's own transaction: raises an error (SQLSTATE LR001)
-- unless `token` still holds the lease of `key`, and keeps the lease row share-locked to
-- the end of the transaction, so no other replica acquires it before the
-- transaction's writes commit or roll back.
CREATE OR REPLACE FUNCTION :"schema".leaderrun_fence(lease_key text, lease_token bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = :"schema", pg_temp
AS $$
BEGIN
    PERFORM 1 FROM leaderrun_lease
     WHERE key = lease_key AND token = lease_token AND expires_at > clock_timestamp()
       FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'leaderrun: token % does not hold the lease of %', lease_token, lease_key
            USING ERRCODE = 'LR001',
                  HINT = 'this term is over: do not retry with this token';
    END IF;
END
$$;
REVOKE ALL ON FUNCTION :"schema".leaderrun_fence(text, bigint) FROM PUBLIC;
