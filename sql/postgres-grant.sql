-- Grants a role exactly what leaderrun needs on its tables (made with
-- sql/postgres.sql), and nothing else: no DDL, no DELETE of a lease row.
--
--     psql -v schema=leaderrun -v role=leaderrun_app -f sql/postgres-grant.sql
--
-- A job that fences its own writes in its transaction (the README's
-- PostgreSQL section) needs EXECUTE on leaderrun_fence only.
\if :{?schema}
\else
\set schema public
\endif

GRANT USAGE ON SCHEMA :"schema" TO :"role";
GRANT SELECT, INSERT, UPDATE ON :"schema".leaderrun_lease TO :"role";
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".leaderrun_candidate TO :"role";
GRANT EXECUTE ON FUNCTION :"schema".leaderrun_fence(text, bigint) TO :"role";
