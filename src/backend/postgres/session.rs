//! One replica's connection to PostgreSQL: made on the first call (never
//! at construction: a store that never leads, as the guard's, makes none), made
//! again after it drops or a call on it times out, and bounded in every
//! step. A task drives it and passes on the notifications it receives: the
//! connection is also this replica's place in the followers' line.
//!
//! This is the one place that sorts the client's errors into "could not
//! ask" and "cannot ever work".

use std::error::Error as _;
use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, Notify};
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, Client, Config, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::backend::{Fatal, StoreError, Unreachable};

/// A parameter of a statement, with its type (so a statement is sent in one
/// round trip, never prepared first).
pub type Param<'a> = (&'a (dyn ToSql + Sync), Type);

pub struct Link {
    config: Config,
    tls: MakeRustlsConnect,
    /// The server, for messages: the URL with the password masked.
    shown: String,
    call_timeout: Duration,
    slot: Mutex<Option<Arc<Session>>>,
    /// Added to the message when the server asks for a password.
    pub password_hint: String,
    /// The connection this replica's candidate record names as its place in
    /// line (0: none). Taken by a follower's wait, given up by an
    /// acquisition or a release (the record's place is cleared then).
    placed: AtomicU64,
    sessions: AtomicU64,
    /// Signalled by the driver: a notification came, or the connection
    /// dropped (its place in line with it).
    woken: Arc<Notify>,
}

/// One connection.
pub struct Session {
    pub client: Client,
    closed: Arc<AtomicBool>,
    /// Tells it apart from the connections before it.
    id: u64,
    /// It listens on this replica's channel.
    pub listening: AtomicBool,
    driver: JoinHandle<()>,
}

impl Session {
    pub fn alive(&self) -> bool {
        !self.closed.load(Ordering::SeqCst)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Link {
    pub fn new(
        config: Config,
        tls: MakeRustlsConnect,
        shown: String,
        call_timeout: Duration,
    ) -> Link {
        Link {
            config,
            tls,
            shown,
            call_timeout,
            slot: Mutex::new(None),
            password_hint: String::new(),
            placed: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            woken: Arc::new(Notify::new()),
        }
    }

    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// The live connection, if there is one now (never waits).
    pub fn current(&self) -> Option<Arc<Session>> {
        let slot = self.slot.try_lock().ok()?;
        slot.as_ref().filter(|s| s.alive()).cloned()
    }

    /// Whether `session` holds this replica's place in line.
    pub fn placed(&self, session: &Session) -> bool {
        self.placed.load(Ordering::SeqCst) == session.id
    }

    /// `session` holds this replica's place in line now.
    pub fn set_placed(&self, session: &Session) {
        self.placed.store(session.id, Ordering::SeqCst);
    }

    /// This replica has no place in line (it leads, or it released).
    pub fn unplace(&self) {
        self.placed.store(0, Ordering::SeqCst);
    }

    /// Waits for a notification (or the connection's end).
    pub async fn woken(&self) {
        self.woken.notified().await;
    }

    /// Wakes a waiter: its place in line is new.
    pub fn wake(&self) {
        self.woken.notify_one();
    }

    /// The connection, made if there is none.
    pub async fn session(&self) -> Result<Arc<Session>, StoreError> {
        let mut slot = self.slot.lock().await;
        if let Some(session) = slot.as_ref().filter(|s| s.alive()) {
            return Ok(session.clone());
        }
        *slot = None;
        let connect = self.config.connect(self.tls.clone());
        let (client, mut connection) = match tokio::time::timeout(self.call_timeout, connect).await
        {
            Ok(Ok(made)) => made,
            Ok(Err(error)) => return Err(self.classify(error)),
            Err(_) => return Err(Unreachable::Timeout(self.call_timeout).into()),
        };
        let closed = Arc::new(AtomicBool::new(false));
        let (gone, woken) = (closed.clone(), self.woken.clone());
        let driver = tokio::spawn(async move {
            loop {
                match poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notification(_))) => woken.notify_one(),
                    Some(Ok(_)) => {}
                    Some(Err(error)) => {
                        tracing::debug!(error = %Chain(&error), "the PostgreSQL connection ended");
                        break;
                    }
                    None => break,
                }
            }
            gone.store(true, Ordering::SeqCst);
            woken.notify_one();
        });
        let session = Arc::new(Session {
            client,
            closed,
            id: self.sessions.fetch_add(1, Ordering::SeqCst) + 1,
            listening: AtomicBool::new(false),
            driver,
        });
        *slot = Some(session.clone());
        Ok(session)
    }

    /// Forgets a connection whose state is unknown; the next call makes a
    /// new one.
    fn forget(&self, session: &Arc<Session>) {
        session.closed.store(true, Ordering::SeqCst);
    }

    /// Runs one statement, bounded by the call timeout.
    pub async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, StoreError> {
        let session = self.session().await?;
        self.query_on(&session, sql, params).await
    }

    /// `query` on a given connection.
    pub async fn query_on(
        &self,
        session: &Arc<Session>,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, StoreError> {
        let typed: Vec<(&(dyn ToSql + Sync), Type)> = params
            .iter()
            .map(|(value, ty)| (*value, ty.clone()))
            .collect();
        self.bounded(session, session.client.query_typed(sql, &typed))
            .await
    }

    /// Runs statements without parameters (`LISTEN`, a schema's DDL).
    pub async fn batch(&self, session: &Arc<Session>, sql: &str) -> Result<(), StoreError> {
        self.bounded(session, session.client.batch_execute(sql))
            .await
    }

    /// A call on `session`, bounded by the call timeout; the connection is
    /// forgotten after a timeout (a server that hangs or a network that
    /// dropped: it may never answer again) or an error that closed it.
    async fn bounded<T>(
        &self,
        session: &Arc<Session>,
        call: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => {
                if error.is_closed() || error.code().is_none() {
                    self.forget(session);
                }
                Err(self.classify(error))
            }
            Err(_) => {
                self.forget(session);
                Err(Unreachable::Timeout(self.call_timeout).into())
            }
        }
    }

    pub fn classify(&self, error: tokio_postgres::Error) -> StoreError {
        let text = Chain(&error).to_string();
        let refused = |what: String| StoreError::Fatal(Fatal::Refused(what));
        let Some(code) = error.code() else {
            if text.contains("password missing") {
                return refused(format!(
                    "backend {}: the server asks for a password and none was found{}: put it in the URL, PGPASSWORD or the password file (~/.pgpass, PGPASSFILE or ?passfile=)",
                    self.shown, self.password_hint
                ));
            }
            if text.contains("invalid peer certificate")
                || text.contains("server does not support TLS")
                || text.contains("invalid configuration")
            {
                return refused(format!("backend {}: {text}", self.shown));
            }
            return Unreachable::Server(format!("postgres: {text}")).into();
        };
        let shown = &self.shown;
        if *code == SqlState::INVALID_PASSWORD
            || *code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        {
            return refused(format!(
                "backend {shown} refused the credentials: {text}; check the user and password (URL, PGPASSWORD or the password file) and pg_hba.conf"
            ));
        }
        if *code == SqlState::INVALID_CATALOG_NAME {
            return refused(format!(
                "backend {shown}: {text}; create the database, or name one that exists in the URL"
            ));
        }
        if *code == SqlState::INSUFFICIENT_PRIVILEGE {
            return refused(format!(
                "backend {shown}: the user lacks a permission: {text}; grant what the README's PostgreSQL section lists"
            ));
        }
        if *code == SqlState::UNDEFINED_TABLE
            || *code == SqlState::INVALID_SCHEMA_NAME
            || *code == SqlState::UNDEFINED_FUNCTION
        {
            return refused(format!(
                "backend {shown}: {text}; leaderrun's tables are missing: let a role that may create them start leaderrun once, or run the README's schema SQL"
            ));
        }
        // A statement leaderrun got wrong never works: say so, do not retry.
        if code.code().starts_with("42") {
            return Fatal::Internal(format!("postgres: {text}")).into();
        }
        Unreachable::Server(format!("postgres: {text}")).into()
    }
}

/// An error with its sources: tokio-postgres's own message is terse ("db
/// error"), the server's is in the source.
pub struct Chain<'a>(pub &'a tokio_postgres::Error);

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}
