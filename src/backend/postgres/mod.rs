//! The PostgreSQL backend: the lease in a table of the database the team
//! already runs.
//!
//! - `url.rs`: libpq's URL form; `pgpass.rs`: `PGPASSWORD` and the password
//!   file; `tls.rs`: `sslmode` as libpq means it;
//! - `session.rs`: the connection, made again after a drop, and the sorting
//!   of errors;
//! - `sql.rs`: every statement; `sql/postgres.sql`: the tables.
//!
//! A key is one row of `leaderrun_lease` (its counter and its lease, never
//! deleted, so tokens only grow) and a row per running replica in
//! `leaderrun_candidate`. Every decision is one statement judged by the
//! server's clock. A commit is durable, so tokens survive a restart of the
//! server; each replica still sends the highest token it has seen, so a
//! database restored from an old backup never hands out a token again.
//!
//! Followers wait on their own connection, which `LISTEN`s on a channel of
//! the replica's; its candidate record names the connection and since when
//! it waits. A release notifies the follower that has waited longest and
//! whose connection is still open: one wakes, not all of them.

mod pgpass;
mod session;
mod sql;
mod tls;
mod url;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::types::Type;

use self::session::{Link, Param};
use self::sql::{GRANTS, Statements};
use self::url::PostgresUrl;
use super::{
    Attempt, Backend, BackendOptions, Bounded, Call, Candidate, Capabilities, Fatal, Holder,
    Identity, LeaseConfig, LeaseStore, Observation, RenewError, StoreError, Unreachable,
    split_record_host,
};
use crate::error::ConfigError;

/// Tokens are `bigint`s.
pub const MAX_TOKEN: u64 = i64::MAX as u64;

/// The advisory lock that lets one replica at a time create the tables.
const DDL_LOCK: i64 = 0x6c65_6164_6572_7275; // "leaderru"

pub struct PostgresBackend {
    url: PostgresUrl,
    config: tokio_postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    /// The password came from `PGPASSWORD`.
    from_env: bool,
    /// A password file ignored for its permissions, for messages.
    ignored_passfile: Option<std::path::PathBuf>,
}

pub fn parse(raw: &str, options: &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError> {
    let url = PostgresUrl::parse(raw)?;
    let refused = |why: String| ConfigError::BackendUrl {
        url: url.to_string(),
        why,
    };
    let ca_file = url.ca_file.as_deref().or(options.tls_ca_file.as_deref());
    let tls = tls::connector(url.tls, ca_file).map_err(refused)?;
    let mut config = url.config.clone();
    let mut found = pgpass::Found::default();
    if config.get_password().is_none() {
        found = pgpass::find(&config, url.passfile.as_deref());
        if let Some(password) = &found.password {
            config.password(password);
        }
    }
    let from_env = found.from_env;
    let ignored_passfile = found.ignored;
    if config.get_application_name().is_none() {
        config.application_name("leaderrun");
    }
    Ok(Arc::new(PostgresBackend {
        url,
        config,
        tls,
        from_env,
        ignored_passfile,
    }))
}

impl fmt::Display for PostgresBackend {
    /// The URL with the password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.url)
    }
}

impl Backend for PostgresBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            tokens: true,
            fence_advance: true,
            durable_tokens: true,
            server_clock: true,
            max_token: MAX_TOKEN,
        }
    }

    fn lease(&self, lease: LeaseConfig) -> Result<Arc<dyn LeaseStore>, ConfigError> {
        let call_timeout = lease.call_timeout;
        Ok(Bounded::wrap(
            Arc::new(self.store(lease, true)),
            call_timeout,
        ))
    }

    fn observer(
        &self,
        key: &str,
        call_timeout: Duration,
    ) -> Result<Arc<dyn LeaseStore>, ConfigError> {
        let lease = LeaseConfig::observer(key, call_timeout);
        Ok(Bounded::wrap(
            Arc::new(self.store(lease, false)),
            call_timeout,
        ))
    }

    fn secret_env(&self) -> &'static [&'static str] {
        if self.from_env { &["PGPASSWORD"] } else { &[] }
    }
}

impl PostgresBackend {
    fn store(&self, lease: LeaseConfig, campaigns: bool) -> PostgresStore {
        let mut config = self.config.clone();
        // The server bounds each statement and lock wait too, so a stuck
        // transaction holding the row never holds a replica past its call.
        let bound = lease.call_timeout.as_millis().max(1);
        let options = format!(
            "{} -c statement_timeout={bound} -c lock_timeout={bound} -c idle_in_transaction_session_timeout={}",
            config.get_options().unwrap_or_default(),
            bound * 4,
        );
        config.options(options.trim_start());
        config.connect_timeout(lease.call_timeout);
        config.keepalives_idle(Duration::from_secs(5));
        let mut link = Link::new(
            config,
            self.tls.clone(),
            self.url.to_string(),
            lease.call_timeout,
        );
        if let Some(file) = &self.ignored_passfile {
            link.password_hint = format!(
                " (the password file {} was ignored: it is readable by others; chmod 600 it)",
                file.display()
            );
        }
        PostgresStore {
            channel: format!("leaderrun_{}", lease.me.instance),
            link,
            sql: Statements::new(&self.url.schema),
            schema: self.url.schema.clone(),
            campaigns,
            ttl_ms: lease.ttl.as_millis().min(i64::MAX as u128) as i64,
            me: lease.me,
            key: lease.key,
            highest_seen: AtomicU64::new(0),
            ready: AtomicBool::new(false),
        }
    }
}

/// One replica's lease on one key.
pub struct PostgresStore {
    link: Link,
    sql: Statements,
    schema: String,
    key: String,
    me: Identity,
    ttl_ms: i64,
    /// The channel this replica's connection listens on.
    channel: String,
    /// A replica's store, not `status`'s: it may create the tables.
    campaigns: bool,
    /// The highest token this replica has seen, its own or a holder's.
    highest_seen: AtomicU64,
    /// Its tables were found (or made) and its privileges checked.
    ready: AtomicBool,
}

/// The parameters of a candidate record, `$1`..`$7` of `sql.rs`.
struct Record {
    pid: i32,
    since: i64,
}

impl PostgresStore {
    fn saw(&self, token: u64) {
        self.highest_seen.fetch_max(token, Ordering::SeqCst);
    }

    fn record(&self) -> Record {
        Record {
            pid: i32::try_from(self.me.pid).unwrap_or(i32::MAX),
            since: i64::try_from(self.me.since_ms).unwrap_or(i64::MAX),
        }
    }

    /// Runs a statement that refreshes this replica's candidate record,
    /// with `more` after the record's seven parameters.
    async fn with_record(
        &self,
        sql: &str,
        more: &[Param<'_>],
    ) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        let record = self.record();
        let host = self.me.record_host();
        let mut params: Vec<Param<'_>> = vec![
            (&self.key, Type::TEXT),
            (&self.me.instance, Type::TEXT),
            (&self.me.owner, Type::TEXT),
            (&host, Type::TEXT),
            (&record.pid, Type::INT4),
            (&record.since, Type::INT8),
            (&self.ttl_ms, Type::INT8),
        ];
        params.extend(more.iter().cloned());
        self.link.query(sql, &params).await
    }

    fn qualified(&self, name: &str) -> String {
        format!("{}.{name}", sql::ident(&self.schema))
    }

    async fn acquire_once(&self, attempt: u64) -> Result<Attempt, StoreError> {
        self.ready().await?;
        let attempt = i64::try_from(attempt).unwrap_or(i64::MAX);
        let highest = i64::try_from(self.highest_seen.load(Ordering::SeqCst)).unwrap_or(i64::MAX);
        let max = MAX_TOKEN as i64;
        let rows = self
            .with_record(
                &self.sql.acquire,
                &[
                    (&attempt, Type::INT8),
                    (&highest, Type::INT8),
                    (&max, Type::INT8),
                ],
            )
            .await?;
        let Some(row) = rows.first() else {
            if highest >= max {
                return Err(Fatal::CounterExhausted {
                    counter: highest as u64,
                    max: MAX_TOKEN,
                }
                .into());
            }
            // Another replica made the row after this statement began: it
            // holds the lease now. Read it.
            let held = self.read_lease().await?;
            return Ok(match held {
                Some(holder) => Attempt::Held(holder),
                None => Attempt::HeldOff {
                    retry_in: Duration::ZERO,
                    why: "the lease changed during the attempt",
                },
            });
        };
        let code: i32 = row.try_get(0).map_err(corrupt)?;
        let token = row.try_get::<_, i64>(1).map_err(corrupt)? as u64;
        self.saw(token);
        match code {
            1 => {
                // The record's place in line is cleared with the acquisition.
                self.link.unplace();
                Ok(Attempt::Acquired { token })
            }
            0 => {
                let ms: i64 = row.try_get(3).map_err(corrupt)?;
                Ok(Attempt::Held(Holder {
                    owner: row.try_get(2).map_err(corrupt)?,
                    token,
                    expires_in: Some(Duration::from_millis(ms.max(0) as u64)),
                }))
            }
            _ => {
                let counter = self.read_counter().await.unwrap_or(MAX_TOKEN);
                Err(Fatal::CounterExhausted {
                    counter,
                    max: MAX_TOKEN,
                }
                .into())
            }
        }
    }

    /// The live holder, if any.
    async fn read_lease(&self) -> Result<Option<Holder>, StoreError> {
        let rows = self
            .link
            .query(&self.sql.lease, &[(&self.key, Type::TEXT)])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let ms: i64 = row.try_get(3).map_err(corrupt)?;
        let token = row.try_get::<_, i64>(0).map_err(corrupt)? as u64;
        self.saw(token);
        Ok((ms >= 0).then(|| Holder {
            owner: row.try_get(1).unwrap_or_default(),
            token,
            expires_in: Some(Duration::from_millis(ms as u64)),
        }))
    }

    async fn read_counter(&self) -> Result<u64, StoreError> {
        let rows = self
            .link
            .query(&self.sql.lease, &[(&self.key, Type::TEXT)])
            .await?;
        Ok(rows
            .first()
            .map(|row| row.try_get::<_, i64>(2).unwrap_or(0) as u64)
            .unwrap_or(0))
    }

    async fn renew_once(&self, token: u64) -> Result<(), RenewError> {
        let token = i64::try_from(token).unwrap_or(i64::MAX);
        let rows = self
            .with_record(&self.sql.renew, &[(&token, Type::INT8)])
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("no answer to a renewal"))?;
        if row.try_get::<_, bool>(0).map_err(corrupt)? {
            return Ok(());
        }
        let holder_token = row.try_get::<_, i64>(1).map_err(corrupt)? as u64;
        self.saw(holder_token);
        let held = row.try_get::<_, bool>(3).map_err(corrupt)?;
        Err(RenewError::Lost(held.then(|| Holder {
            owner: row.try_get(2).unwrap_or_default(),
            token: holder_token,
            expires_in: None,
        })))
    }

    async fn check_once(&self) -> Result<Option<Unreachable>, Fatal> {
        match self.ensure_schema().await {
            Ok(()) => Ok(None),
            Err(StoreError::Fatal(fatal)) => Err(fatal),
            Err(StoreError::Unreachable(why)) => Ok(Some(why)),
        }
    }

    /// Creates what is missing of leaderrun's objects (when this replica
    /// may), then checks that its role holds every privilege it needs, so a
    /// missing one is named now, before any lease is taken.
    async fn ensure_schema(&self) -> Result<(), StoreError> {
        let names = [
            // A name, not an identifier: these functions take it as it is.
            self.schema.clone(),
            self.qualified("leaderrun_lease"),
            self.qualified("leaderrun_candidate"),
            self.qualified("leaderrun_fence(text, bigint)"),
        ];
        let params: Vec<Param<'_>> = names.iter().map(|n| (n as _, Type::TEXT)).collect();
        let mut made = false;
        loop {
            let rows = self.link.query(&self.sql.exists, &params).await?;
            let row = rows.first().ok_or_else(|| corrupt("no answer"))?;
            let found: Vec<bool> = (0..5)
                .map(|i| row.try_get(i))
                .collect::<Result<_, _>>()
                .map_err(corrupt)?;
            let (schema, usable, objects) = (found[0], found[1], &found[2..]);
            if schema && !usable {
                return Err(self.lacks(&[format!("USAGE on schema {}", self.schema)]));
            }
            if !schema || objects.iter().any(|f| !f) {
                if self.campaigns && !made {
                    self.make_schema(schema).await?;
                    made = true;
                    continue;
                }
                return Err(Fatal::Refused(format!(
                    "backend {}: leaderrun's tables are missing in schema {}; let a role that may create them start leaderrun once, or run: psql -v schema={} -f sql/postgres.sql (README, PostgreSQL)",
                    self.link.shown(),
                    self.schema,
                    self.schema
                ))
                .into());
            }
            let missing: Vec<String> = GRANTS
                .iter()
                .enumerate()
                .filter(|(i, _)| {
                    !row.try_get::<_, Option<bool>>(5 + i)
                        .ok()
                        .flatten()
                        .unwrap_or(false)
                })
                .map(|(_, (privilege, table))| format!("{privilege} on {}.{table}", self.schema))
                .collect();
            if !missing.is_empty() {
                return Err(self.lacks(&missing));
            }
            self.ready.store(true, Ordering::SeqCst);
            return Ok(());
        }
    }

    /// Runs `sql/postgres.sql`, one replica at a time.
    async fn make_schema(&self, schema_exists: bool) -> Result<(), StoreError> {
        let ddl = format!(
            "SELECT pg_advisory_xact_lock({DDL_LOCK}); {}",
            sql::schema_ddl(&self.schema, schema_exists)
        );
        let session = self.link.session().await?;
        match self.link.batch(&session, &ddl).await {
            Ok(()) => Ok(()),
            Err(StoreError::Fatal(Fatal::Refused(why))) => Err(Fatal::Refused(format!(
                "{why}; or create leaderrun's tables in schema {} as a role that may: psql -v schema={} -f sql/postgres.sql (README, PostgreSQL)",
                self.schema, self.schema
            ))
            .into()),
            Err(other) => Err(other),
        }
    }

    /// The privileges this replica's role lacks, as an error.
    fn lacks(&self, missing: &[String]) -> StoreError {
        Fatal::Refused(format!(
            "backend {}: the user lacks {}; grant them (sql/postgres-grant.sql grants all leaderrun needs)",
            self.link.shown(),
            missing.join(", ")
        ))
        .into()
    }

    /// Makes leaderrun's tables on first contact, if the check at startup
    /// could not (the server was down then).
    async fn ready(&self) -> Result<(), StoreError> {
        if self.campaigns && !self.ready.load(Ordering::SeqCst) {
            self.ensure_schema().await?;
        }
        Ok(())
    }

    /// A follower's wait: its connection listens and holds its place in
    /// line (taken again after a drop or a term), then the next wake.
    async fn wait_in_line(&self) {
        let placed = async {
            self.ready().await?;
            let session = self.link.session().await?;
            if !session.listening.load(Ordering::SeqCst) {
                let listen = format!("LISTEN {}", sql::ident(&self.channel));
                self.link.batch(&session, &listen).await?;
                session.listening.store(true, Ordering::SeqCst);
            }
            if !self.link.placed(&session) {
                self.with_record(&self.sql.place, &[]).await?;
                self.link.set_placed(&session);
                // A release may have come while this replica had no place.
                self.link.wake();
            }
            Ok::<_, StoreError>(())
        };
        if let Err(error) = placed.await {
            tracing::debug!(error = %error, "the follower's place in line could not be taken");
            // Never spin on a broken connection: the caller polls meanwhile.
            tokio::time::sleep(Duration::from_millis(500)).await;
            return;
        }
        self.link.woken().await;
    }
}

impl LeaseStore for PostgresStore {
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        Box::pin(self.check_once())
    }

    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        Box::pin(self.acquire_once(attempt))
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        Box::pin(self.renew_once(token))
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        Box::pin(async move {
            let token = i64::try_from(token).unwrap_or(i64::MAX);
            let rows = self
                .with_record(&self.sql.release, &[(&token, Type::INT8)])
                .await?;
            // The record's place in line is cleared with the release.
            self.link.unplace();
            let row = rows.first().ok_or_else(|| corrupt("no answer"))?;
            row.try_get(0).map_err(corrupt)
        })
    }

    fn advance_fence(&self, floor: u64) -> Call<'_, u64> {
        Box::pin(async move {
            if floor > MAX_TOKEN {
                return Err(Fatal::FloorOutOfRange {
                    floor,
                    max: MAX_TOKEN,
                }
                .into());
            }
            self.ready().await?;
            let floor = floor as i64;
            let rows = self
                .link
                .query(
                    &self.sql.advance,
                    &[(&self.key, Type::TEXT), (&floor, Type::INT8)],
                )
                .await?;
            let row = rows.first().ok_or_else(|| corrupt("no answer"))?;
            let counter = row.try_get::<_, i64>(0).map_err(corrupt)? as u64;
            self.saw(counter);
            Ok(counter)
        })
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        Box::pin(async move {
            self.ready().await?;
            self.with_record(&self.sql.heartbeat, &[]).await?;
            Ok(())
        })
    }

    fn withdraw(&self) -> Call<'_, ()> {
        Box::pin(async move {
            self.link
                .query(
                    &self.sql.withdraw,
                    &[(&self.key, Type::TEXT), (&self.me.instance, Type::TEXT)],
                )
                .await?;
            Ok(())
        })
    }

    fn observe(&self) -> Call<'_, Observation> {
        Box::pin(async move {
            let key: Param<'_> = (&self.key, Type::TEXT);
            let lease = self
                .link
                .query(&self.sql.lease, std::slice::from_ref(&key))
                .await?;
            let (holder, counter) = match lease.first() {
                None => (None, 0),
                Some(row) => {
                    let token = row.try_get::<_, i64>(0).map_err(corrupt)? as u64;
                    let ms: i64 = row.try_get(3).map_err(corrupt)?;
                    let holder = (ms >= 0).then(|| Holder {
                        owner: row.try_get(1).unwrap_or_default(),
                        token,
                        expires_in: Some(Duration::from_millis(ms as u64)),
                    });
                    (holder, row.try_get::<_, i64>(2).map_err(corrupt)? as u64)
                }
            };
            let rows = self.link.query(&self.sql.candidates, &[key]).await?;
            let candidates = rows
                .iter()
                .map(|row| {
                    let (host, shards) = split_record_host(row.try_get(1)?);
                    Ok(Candidate {
                        owner: row.try_get(0)?,
                        host,
                        shards,
                        pid: row.try_get::<_, i32>(2)? as u32,
                        since_ms: row.try_get::<_, i64>(3)? as u64,
                        last_seen_ms: row.try_get::<_, i64>(4)? as u64,
                        leading: row.try_get(5)?,
                    })
                })
                .collect::<Result<Vec<_>, tokio_postgres::Error>>()
                .map_err(corrupt)?;
            Ok(Observation {
                holder,
                counter,
                candidates,
            })
        })
    }

    fn notice(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.wait_in_line())
    }

    fn wakes_on_release(&self) -> bool {
        self.link
            .current()
            .is_some_and(|s| s.listening.load(Ordering::SeqCst) && self.link.placed(&s))
    }

    fn leading(&self) {
        // Its place is gone (a leader has none); a follower again takes a
        // new one, at the back of the line.
        self.link.unplace();
    }
}

/// A reply leaderrun cannot read: its tables are not what it made.
fn corrupt(error: impl fmt::Display) -> StoreError {
    Fatal::Corrupt(format!("unexpected reply from PostgreSQL: {error}")).into()
}
