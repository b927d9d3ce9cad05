//! Every statement the backend sends, for one schema. Each operation is one
//! statement (a data-modifying `WITH` at most), run in autocommit under READ
//! COMMITTED: `INSERT … ON CONFLICT DO UPDATE` and `UPDATE` lock the lease
//! row and judge it as last committed, so two replicas never both win.
//! Expiry is judged by the server's `clock_timestamp()` (never `now()`, the
//! transaction's start, which a lock wait makes stale), and times go back as
//! milliseconds left, so no replica compares clocks.
//!
//! Parameters shared by the statements that refresh this replica's
//! candidate record: `$1` key, `$2` instance, `$3` owner, `$4` host, `$5`
//! pid, `$6` start (Unix ms), `$7` ttl (ms); each statement's own follow.

/// The DDL, as `sql/postgres.sql` (the file a DBA runs with psql) has it.
const SCHEMA_FILE: &str = include_str!("../../../sql/postgres.sql");

/// The DDL for `schema`, for a replica allowed to run it: psql's commands
/// dropped, its variable filled in; `CREATE SCHEMA` left out when the schema
/// exists (it needs a privilege on the database even then).
pub fn schema_ddl(schema: &str, schema_exists: bool) -> String {
    SCHEMA_FILE
        .lines()
        .filter(|line| !line.starts_with('\\'))
        .filter(|line| !(schema_exists && line.starts_with("CREATE SCHEMA")))
        .map(|line| line.replace(":\"schema\"", &ident(schema)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A quoted identifier.
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A candidate record upserted with `leading`; `placed` is the new
/// `placed_at` when the row exists (a follower's place in line).
fn beat(s: &str, leading: &str, placed: &str) -> String {
    format!(
        "INSERT INTO {s}.leaderrun_candidate AS c
                (key, instance, owner, host, pid, since_ms, seen_at, expires_at, leads)
         VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp(),
                 clock_timestamp() + $7 * interval '1 millisecond', {leading})
         ON CONFLICT (key, instance) DO UPDATE
            SET seen_at = excluded.seen_at, expires_at = excluded.expires_at,
                leads = excluded.leads, placed_at = {placed}"
    )
}

/// Keeps a follower's place; a leader has none.
const KEEP_PLACE: &str = "CASE WHEN excluded.leads THEN NULL ELSE c.placed_at END";

pub struct Statements {
    /// `$8` attempt, `$9` highest token seen, `$10` largest token. Rows of
    /// (code, token, owner, ms): 1 acquired; 0 held (owner, ms left); 5 the
    /// counter is exhausted. No row: the row was made by a concurrent
    /// attempt after this statement's snapshot (read it again).
    pub acquire: String,
    /// `$8` token. One row: (renewed, holder's token, owner, someone else
    /// holds it now).
    pub renew: String,
    /// `$8` token. One row: (released, followers woken).
    pub release: String,
    pub heartbeat: String,
    /// Takes a place in line: this connection, from now.
    pub place: String,
    /// `$1` key, `$2` floor. The counter.
    pub advance: String,
    /// `$1` key, `$2` instance.
    pub withdraw: String,
    /// `$1` key. (token, owner, counter, ms left or -1 when free).
    pub lease: String,
    /// `$1` key. Live candidates: (owner, host, pid, since ms, seen ms, leading).
    pub candidates: String,
    /// Which of leaderrun's objects exist, and the privileges it needs on
    /// them: `$1` schema, `$2` lease table, `$3` candidate table, `$4` fence
    /// function. (schema, USAGE on it, lease table, candidate table, fence
    /// function, then the privileges of `GRANTS`, NULL for a missing table.)
    pub exists: String,
}

/// The table privileges `exists` asks for, in its order: for messages.
pub const GRANTS: [(&str, &str); 7] = [
    ("SELECT", "leaderrun_lease"),
    ("INSERT", "leaderrun_lease"),
    ("UPDATE", "leaderrun_lease"),
    ("SELECT", "leaderrun_candidate"),
    ("INSERT", "leaderrun_candidate"),
    ("UPDATE", "leaderrun_candidate"),
    ("DELETE", "leaderrun_candidate"),
];

impl Statements {
    pub fn new(schema: &str) -> Statements {
        let s = &ident(schema);
        let same_attempt = "l.holder_instance = $2 AND l.holder_attempt = $8
                            AND l.expires_at > clock_timestamp()";
        let ms_left =
            "greatest(0, extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint";
        Statements {
            acquire: format!(
                "WITH up AS (
                    INSERT INTO {s}.leaderrun_lease AS l
                           (key, counter, token, holder_instance, holder_attempt, owner, expires_at)
                    SELECT $1, next, next, $2, $8, $3,
                           clock_timestamp() + $7 * interval '1 millisecond'
                      FROM (SELECT CASE WHEN $9 < $10 THEN $9 + 1 END AS next) AS n
                     WHERE next IS NOT NULL
                    ON CONFLICT (key) DO UPDATE
                       SET counter = CASE WHEN {same_attempt} THEN l.counter
                                          ELSE greatest(l.counter, $9) + 1 END,
                           token = CASE WHEN {same_attempt} THEN l.token
                                        ELSE greatest(l.counter, $9) + 1 END,
                           holder_instance = $2, holder_attempt = $8, owner = $3,
                           expires_at = clock_timestamp() + $7 * interval '1 millisecond'
                     WHERE ({same_attempt})
                        OR ((l.expires_at <= clock_timestamp() OR l.holder_instance = $2)
                            AND greatest(l.counter, $9) < $10)
                    RETURNING l.token
                 ),
                 beat AS ({beat})
                 SELECT 1, token, '', $7 FROM up
                 UNION ALL
                 SELECT CASE WHEN (l.expires_at <= clock_timestamp() OR l.holder_instance = $2)
                                  AND greatest(l.counter, $9) >= $10 THEN 5 ELSE 0 END,
                        l.token, l.owner, {ms_left}
                   FROM {s}.leaderrun_lease l
                  WHERE l.key = $1 AND NOT EXISTS (SELECT FROM up)",
                beat = beat(s, "EXISTS (SELECT FROM up)", KEEP_PLACE),
            ),
            renew: format!(
                "WITH r AS (
                    UPDATE {s}.leaderrun_lease
                       SET expires_at = clock_timestamp() + $7 * interval '1 millisecond'
                     WHERE key = $1 AND token = $8 AND holder_instance = $2
                       AND expires_at > clock_timestamp()
                    RETURNING token
                 ),
                 beat AS ({beat})
                 SELECT EXISTS (SELECT FROM r), coalesce(l.token, 0), coalesce(l.owner, ''),
                        coalesce(l.expires_at > clock_timestamp()
                                 AND l.holder_instance IS DISTINCT FROM $2, false)
                   FROM (SELECT 1) AS one LEFT JOIN {s}.leaderrun_lease l ON l.key = $1",
                beat = beat(s, "EXISTS (SELECT FROM r)", KEEP_PLACE),
            ),
            release: format!(
                "WITH r AS (
                    UPDATE {s}.leaderrun_lease SET expires_at = clock_timestamp()
                     WHERE key = $1 AND token = $8 AND holder_instance = $2
                       AND expires_at > clock_timestamp()
                    RETURNING token
                 ),
                 beat AS ({beat}),
                 next AS (
                    SELECT c.instance FROM {s}.leaderrun_candidate c
                     WHERE c.key = $1 AND c.instance <> $2 AND NOT c.leads
                       AND c.placed_at IS NOT NULL AND c.expires_at > clock_timestamp()
                       AND EXISTS (SELECT FROM pg_stat_get_activity(c.listen_pid))
                       AND EXISTS (SELECT FROM r)
                     ORDER BY c.placed_at
                     LIMIT 1
                 )
                 SELECT EXISTS (SELECT FROM r),
                        (SELECT count(*) FROM next, pg_notify('leaderrun_' || next.instance, $8::text))",
                beat = beat(s, "false", "NULL"),
            ),
            heartbeat: beat(s, "false", KEEP_PLACE),
            place: format!(
                "{beat}, listen_pid = pg_backend_pid()",
                beat = beat(s, "false", "clock_timestamp()"),
            )
            .replace(
                "(key, instance, owner, host, pid, since_ms, seen_at, expires_at, leads)",
                "(key, instance, owner, host, pid, since_ms, seen_at, expires_at, leads, listen_pid, placed_at)",
            )
            .replace(
                "'1 millisecond', false)",
                "'1 millisecond', false, pg_backend_pid(), clock_timestamp())",
            ),
            advance: format!(
                "INSERT INTO {s}.leaderrun_lease AS l (key, counter) VALUES ($1, $2)
                 ON CONFLICT (key) DO UPDATE SET counter = greatest(l.counter, excluded.counter)
                 RETURNING counter"
            ),
            withdraw: format!(
                "DELETE FROM {s}.leaderrun_candidate
                  WHERE key = $1 AND (instance = $2 OR expires_at <= clock_timestamp())"
            ),
            lease: format!(
                "SELECT l.token, l.owner, l.counter,
                        CASE WHEN l.expires_at > clock_timestamp() THEN {ms_left} ELSE -1 END
                   FROM {s}.leaderrun_lease l WHERE l.key = $1"
            ),
            candidates: format!(
                "SELECT owner, host, pid, since_ms, (extract(epoch FROM seen_at) * 1000)::bigint, leads
                   FROM {s}.leaderrun_candidate
                  WHERE key = $1 AND expires_at > clock_timestamp()
                  ORDER BY since_ms, pid"
            ),
            // to_regclass fails without USAGE on the schema: ask only then.
            // A privilege on a missing table is NULL.
            exists: "SELECT s.oid IS NOT NULL, usable,
                            lease IS NOT NULL, candidate IS NOT NULL, fence IS NOT NULL,
                            has_table_privilege(lease, 'SELECT'),
                            has_table_privilege(lease, 'INSERT'),
                            has_table_privilege(lease, 'UPDATE'),
                            has_table_privilege(candidate, 'SELECT'),
                            has_table_privilege(candidate, 'INSERT'),
                            has_table_privilege(candidate, 'UPDATE'),
                            has_table_privilege(candidate, 'DELETE')
                       FROM (SELECT to_regnamespace($1) AS oid) AS s,
                            LATERAL (SELECT CASE WHEN s.oid IS NULL THEN false
                                                 ELSE has_schema_privilege(s.oid, 'USAGE')
                                            END AS usable) AS u,
                            LATERAL (SELECT CASE WHEN usable THEN to_regclass($2) END AS lease,
                                            CASE WHEN usable THEN to_regclass($3) END AS candidate,
                                            CASE WHEN usable THEN to_regprocedure($4) END AS fence
                                    ) AS o"
                .into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ddl_is_the_file_for_the_schema() {
        let ddl = schema_ddl("jobs", false);
        assert!(
            ddl.contains("CREATE SCHEMA IF NOT EXISTS \"jobs\";"),
            "{ddl}"
        );
        assert!(ddl.contains("\"jobs\".leaderrun_lease ("), "{ddl}");
        assert!(ddl.contains("SET search_path = \"jobs\", pg_temp"), "{ddl}");
        assert!(
            !ddl.contains(":\"schema\"") && !ddl.contains("\\if"),
            "{ddl}"
        );
        assert!(!schema_ddl("jobs", true).contains("CREATE SCHEMA"));
    }

    #[test]
    fn a_place_in_line_names_its_connection() {
        let place = Statements::new("public").place;
        assert!(place.contains("listen_pid, placed_at)"), "{place}");
        assert!(
            place.contains("false, pg_backend_pid(), clock_timestamp())"),
            "{place}"
        );
        assert!(place.ends_with("listen_pid = pg_backend_pid()"), "{place}");
    }
}
