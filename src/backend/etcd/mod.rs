//! The etcd backend: leases on a consensus store.
//!
//! - `url.rs`: `etcd://host:port[,host:port…][/prefix]`, `etcds://` for TLS;
//! - `client.rs`: etcd's v3 JSON gateway over hyper, member by member;
//! - `ops.rs`: the operations and conditions transactions are made of;
//! - `watch.rs`: a follower's watch of the lease's folder, a holder's of
//!   its line.
//!
//! The keys of lease `K` live under `PREFIX/K/` (`K` percent-encoded where
//! it holds `/` or `%`):
//!
//! - `lease`: `TOKEN INSTANCE ATTEMPT OWNER`, attached to the holder's etcd
//!   lease, so it goes when that lease expires (attempt 0: handed over);
//! - `counter`: the last token drawn (or the fence floor), never deleted and
//!   attached to nothing: tokens only grow, across terms, member restarts
//!   and a whole cluster's restart;
//! - `candidates/INSTANCE`: a running replica's record;
//! - `line/INSTANCE`: a follower waiting, its place the key's creation
//!   revision, its value `h OWNER` if it takes a lease handed to it;
//! - `wake`: the follower a release named.
//!
//! Each replica has one etcd lease of the ttl (rounded up to whole seconds:
//! etcd's unit), granted at startup: its records and, while it leads, the
//! `lease` key hang on it. Renewing is a keep-alive of it, so the server
//! keeps the key at least a ttl from the moment the request left, and
//! usually longer (an etcd leader change extends every lease); the holder
//! judges its deadline by its own monotonic clock from that moment (for an
//! acquisition, the last keep-alive or grant: `acquired_since`), so its
//! command is dead before the server could let the key go.
//!
//! Acquisition is one transaction, guarded by the `lease` key being absent
//! (or this replica's, from an earlier term) and by the counter's revision,
//! as last seen (a failed condition reads both again, in the same
//! transaction): it writes the counter, the lease and the record at once.
//! A release hands the lease to the follower first in line, if it takes
//! handovers, in one transaction (the next token, the key on the
//! follower's etcd lease), or deletes it and names that follower in
//! `wake`; the release at the end of a run revokes the etcd lease, which
//! takes the key and the records with it. Each follower watches the key's
//! folder and wakes only for its own name, or, when the lease went without
//! one, only if it is first in line.

mod client;
mod ops;
mod url;
mod watch;

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use serde_json::{Value, json};

use self::client::{Client, EtcdError, b64, int, unb64};
use self::ops::{
    absent, counter_of, delete, kvs, lease_gone, put, range, range_local, range_prefix,
    same_revision,
};
use self::url::EtcdUrl;
use self::watch::{Line, Place, Waiter, watch, watch_line};
use super::{
    Attempt, Backend, BackendOptions, Bounded, Call, Candidate, Capabilities, Fatal, Holder,
    Identity, LeaseConfig, LeaseStore, Observation, RenewError, StoreError, Unreachable,
    split_record_host,
};
use crate::error::ConfigError;

/// Tokens are int64s in etcd's replies.
pub const MAX_TOKEN: u64 = i64::MAX as u64;

/// What a key name may not hold in a path segment.
const SEGMENT: &AsciiSet = &CONTROLS.add(b'/').add(b'%').add(b' ');

pub struct EtcdBackend {
    url: EtcdUrl,
    tls: Option<tokio_rustls::TlsConnector>,
}

pub fn parse(raw: &str, options: &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError> {
    let url = EtcdUrl::parse(raw)?;
    let refused = |why: String| ConfigError::BackendUrl {
        url: url.to_string(),
        why,
    };
    if !url.tls && (options.tls_ca_file.is_some() || options.tls_client.is_some()) {
        return Err(refused(
            "--tls-ca-file, --tls-cert-file and --tls-key-file need TLS: an etcds:// URL".into(),
        ));
    }
    let tls = match (url.tls, &options.tls_ca_file) {
        (false, _) => None,
        (true, ca_file) => {
            let roots = match ca_file {
                Some(file) => super::tls::roots_from(file).map_err(refused)?,
                None => super::tls::public_roots(),
            };
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let builder = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| refused(e.to_string()))?
                .with_root_certificates(roots);
            let config = match &options.tls_client {
                Some((cert, key)) => {
                    let (chain, key) = super::tls::client_identity(cert, key).map_err(&refused)?;
                    builder
                        .with_client_auth_cert(chain, key)
                        .map_err(|e| refused(format!("the client certificate: {e}")))?
                }
                None => builder.with_no_client_auth(),
            };
            Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
        }
    };
    Ok(Arc::new(EtcdBackend { url, tls }))
}

impl fmt::Display for EtcdBackend {
    /// The URL with the password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.url)
    }
}

impl Backend for EtcdBackend {
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
        Ok(Bounded::wrap(Arc::new(self.store(lease)), call_timeout))
    }
}

impl EtcdBackend {
    fn store(&self, lease: LeaseConfig) -> EtcdStore {
        let login = self.url.username.clone().zip(self.url.password.clone());
        let folder = format!(
            "{}/{}/",
            self.url.prefix,
            utf8_percent_encode(&lease.key, SEGMENT)
        );
        EtcdStore {
            client: Arc::new(Client::new(
                self.url.endpoints.clone(),
                self.tls.clone(),
                login,
                lease.call_timeout,
            )),
            keys: Keys::new(&folder, &lease.me.instance),
            ttl_secs: lease.ttl.as_secs() as i64 + i64::from(lease.ttl.subsec_nanos() > 0),
            me: lease.me,
            shown: self.url.to_string(),
            session: Mutex::new(None),
            alive_since: Mutex::new(None),
            granting: tokio::sync::Mutex::new(None),
            last_record: Mutex::new(None),
            highest_seen: AtomicU64::new(0),
            seen: Arc::new(Mutex::new(None)),
            term: Mutex::new(None),
            last_term: AtomicI64::new(0),
            hand_over: lease.hand_over,
            withdrawn: AtomicBool::new(false),
            wake: Arc::new(Waiter::default()),
            line: Arc::new(Line::default()),
        }
    }
}

/// The keys of one lease, and this replica's own.
#[derive(Clone)]
struct Keys {
    folder: String,
    lease: String,
    counter: String,
    wake: String,
    candidates: String,
    line: String,
    my_candidate: String,
    my_place: String,
}

impl Keys {
    fn new(folder: &str, instance: &str) -> Keys {
        Keys {
            folder: folder.to_owned(),
            lease: format!("{folder}lease"),
            counter: format!("{folder}counter"),
            wake: format!("{folder}wake"),
            candidates: format!("{folder}candidates/"),
            line: format!("{folder}line/"),
            my_candidate: format!("{folder}candidates/{instance}"),
            my_place: format!("{folder}line/{instance}"),
        }
    }
}

/// The lease record: `TOKEN INSTANCE ATTEMPT OWNER`. A lease handed over by
/// a release has attempt 0 (attempts count from 1).
#[derive(Clone)]
struct LeaseRecord {
    token: u64,
    instance: String,
    attempt: u64,
    owner: String,
    /// The etcd lease it hangs on.
    lease_id: i64,
    mod_revision: i64,
}

impl LeaseRecord {
    fn parse(kv: &Value) -> Result<LeaseRecord, StoreError> {
        let value = String::from_utf8_lossy(&unb64(&kv["value"])).into_owned();
        let mut parts = value.splitn(4, ' ');
        let mut next = || parts.next().unwrap_or_default().to_owned();
        let (token, instance, attempt, owner) = (next(), next(), next(), next());
        match (token.parse(), attempt.parse()) {
            (Ok(token), Ok(attempt)) if !instance.is_empty() => Ok(LeaseRecord {
                token,
                instance,
                attempt,
                owner,
                lease_id: int(&kv["lease"]),
                mod_revision: int(&kv["mod_revision"]),
            }),
            _ => Err(Fatal::Corrupt(format!("the lease key holds {value:?}")).into()),
        }
    }
}

/// What this replica last saw of the lease key and the counter: an
/// attempt that finds the lease free in it is one transaction, whose
/// conditions catch anything that changed since (and whose failure branch
/// reads both again).
#[derive(Clone)]
struct Seen {
    lease: Option<LeaseRecord>,
    counter: u64,
    counter_revision: i64,
}

impl Seen {
    fn parse(lease: &[Value], counter: &[Value]) -> Result<Seen, StoreError> {
        let (counter, counter_revision) = counter_of(counter.first())?;
        Ok(Seen {
            lease: lease.first().map(LeaseRecord::parse).transpose()?,
            counter,
            counter_revision,
        })
    }
}

/// A grant sent with the etcd lease id chosen for it, its reply to come.
type Granting = (i64, tokio::task::JoinHandle<Result<Value, EtcdError>>);

/// The etcd lease a grant's reply names.
fn granted_id(reply: &Value) -> Result<i64, StoreError> {
    match int(&reply["ID"]) {
        0 => Err(Unreachable::Server(format!("etcd: no lease granted: {reply}")).into()),
        id => Ok(id),
    }
}

/// One replica's lease on one key.
pub struct EtcdStore {
    client: Arc<Client>,
    keys: Keys,
    me: Identity,
    ttl_secs: i64,
    /// The URL, masked, for messages.
    shown: String,
    /// This replica's etcd lease, once granted.
    session: Mutex<Option<i64>>,
    /// When `session` was last granted or kept alive (the request's send):
    /// the server keeps it at least a ttl from then.
    alive_since: Mutex<Option<Instant>>,
    /// The grant `check` sent of `session` (an id chosen here), while its
    /// reply has not been read: only the first acquisition's transaction
    /// goes out before it is (see `settled`).
    granting: tokio::sync::Mutex<Option<Granting>>,
    /// When this replica's record was last written.
    last_record: Mutex<Option<Instant>>,
    /// The highest token this replica has seen, its own or a holder's.
    highest_seen: AtomicU64,
    /// What this replica last saw of the lease and the counter (none until
    /// it first looked).
    seen: Arc<Mutex<Option<Seen>>>,
    /// This replica's running term: its token and the revision that wrote
    /// its lease record.
    term: Mutex<Option<(u64, i64)>>,
    /// The revision of this replica's last term's record: a record handed
    /// to it is taken only if newer.
    last_term: AtomicI64,
    /// Whether a release may hand the lease to a follower that takes
    /// handovers, and this replica take one handed to it.
    hand_over: bool,
    /// A last release revoked this replica's etcd lease: nothing is left to
    /// withdraw.
    withdrawn: AtomicBool,
    wake: Arc<Waiter>,
    line: Arc<Line>,
}

impl EtcdStore {
    fn saw(&self, token: u64) {
        self.highest_seen.fetch_max(token, Ordering::SeqCst);
    }

    fn store_error(&self, error: EtcdError) -> StoreError {
        match error {
            EtcdError::Unreachable(why) => Unreachable::Server(why).into(),
            error if error.is_auth() => Fatal::Refused(format!(
                "backend {}: {error}; check the user and password in the URL, and the user's role (it needs read and write on the prefix)",
                self.shown
            ))
            .into(),
            error => Unreachable::Server(error.to_string()).into(),
        }
    }

    /// A call, once a grant `check` sent has been answered (the call may
    /// use the etcd lease).
    async fn call(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        self.settled().await?;
        self.call_now(path, body).await
    }

    /// A call that does not wait for a grant in flight.
    async fn call_now(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        self.client
            .call(path, &body)
            .await
            .map_err(|e| self.store_error(e))
    }

    async fn txn(
        &self,
        compare: Vec<Value>,
        success: Vec<Value>,
        failure: Vec<Value>,
    ) -> Result<Value, StoreError> {
        self.settled().await?;
        self.txn_now(compare, success, failure).await
    }

    /// A transaction that does not wait for a grant in flight.
    async fn txn_now(
        &self,
        compare: Vec<Value>,
        success: Vec<Value>,
        failure: Vec<Value>,
    ) -> Result<Value, StoreError> {
        self.call_now(
            "kv/txn",
            json!({"compare": compare, "success": success, "failure": failure}),
        )
        .await
    }

    /// Sends the grant of this replica's etcd lease, with an id chosen
    /// here, and does not wait for its reply: the first acquisition's
    /// transaction can go out as soon as the lease key has been read,
    /// while the grant is still on its way: etcd applies them in the order
    /// it received them. (One that arrived first would fail with "lease not
    /// found", as with an expired etcd lease: a lease is granted again, and
    /// the acquisition tried again.)
    async fn send_grant(&self) {
        let mut granting = self.granting.lock().await;
        if granting.is_some() || self.session.lock().unwrap().is_some() {
            return;
        }
        // A random positive int64: unique among the server's leases but
        // by a chance of one in 2^63 (a clash fails the grant: granted
        // again by the server's choice on next use).
        let id = (std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
            >> 1)
            .max(1) as i64;
        let sent = Instant::now();
        let client = self.client.clone();
        let mut body = self.grant_body();
        body["ID"] = json!(id.to_string());
        *granting = Some((
            id,
            tokio::spawn(async move { client.call("lease/grant", &body).await }),
        ));
        self.session_began(id, sent);
    }

    /// The body of a grant of a ttl's etcd lease.
    fn grant_body(&self) -> Value {
        json!({"TTL": self.ttl_secs.max(1)})
    }

    /// This replica's etcd lease is `id`, granted by a request sent at
    /// `sent`.
    fn session_began(&self, id: i64, sent: Instant) {
        *self.session.lock().unwrap() = Some(id);
        *self.alive_since.lock().unwrap() = Some(sent);
        self.withdrawn.store(false, Ordering::SeqCst);
    }

    /// Waits for the reply of a grant `send_grant` sent, if any: an error,
    /// or no lease granted, forgets the session (granted anew on next
    /// use).
    async fn settled(&self) -> Result<(), StoreError> {
        let mut granting = self.granting.lock().await;
        let Some((id, sent)) = granting.take() else {
            return Ok(());
        };
        let reply = match sent.await {
            Ok(reply) => reply.map_err(|e| self.store_error(e)),
            Err(gone) => {
                Err(Unreachable::Server(format!("etcd: the grant was lost: {gone}")).into())
            }
        };
        let granted = reply.and_then(|reply| granted_id(&reply)).map(drop);
        if granted.is_err() {
            self.forget_session(id);
        }
        granted
    }

    /// This replica's etcd lease: granted on first use, and again after it
    /// expired.
    async fn session(&self) -> Result<i64, StoreError> {
        if let Some(id) = *self.session.lock().unwrap() {
            return Ok(id);
        }
        let sent = Instant::now();
        let granted = self.call("lease/grant", self.grant_body()).await?;
        let id = granted_id(&granted)?;
        self.session_began(id, sent);
        Ok(id)
    }

    /// This replica's etcd lease, kept alive now unless that was done less
    /// than a third of a ttl ago (`acquired_since` tells the supervisor
    /// when), or granted anew if it had expired.
    async fn fresh_session(&self) -> Result<i64, StoreError> {
        let session = *self.session.lock().unwrap();
        match session {
            Some(id) if self.kept_alive_within(self.ttl() / 3) => Ok(id),
            _ => self.live_session().await,
        }
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs.max(1) as u64)
    }

    /// Forgets this replica's etcd lease after the server said it is gone.
    fn forget_session(&self, id: i64) {
        let mut session = self.session.lock().unwrap();
        if *session == Some(id) {
            *session = None;
            *self.alive_since.lock().unwrap() = None;
            *self.last_record.lock().unwrap() = None;
        }
    }

    /// This replica's etcd lease, kept alive now (a keep-alive is no etcd
    /// write), or granted anew if it had expired, with its records.
    async fn live_session(&self) -> Result<i64, StoreError> {
        let known = *self.session.lock().unwrap();
        if let Some(session) = known {
            if self.keep_alive(session).await? {
                return Ok(session);
            }
        }
        // Never granted, or expired: a new one lasts a ttl from its grant.
        self.session().await
    }

    /// Keeps this replica's etcd lease alive: false if it had expired (its
    /// keys are gone; a new one is granted on next use).
    async fn keep_alive(&self, id: i64) -> Result<bool, StoreError> {
        let sent = Instant::now();
        let reply = self
            .call("lease/keepalive", json!({"ID": id.to_string()}))
            .await?;
        let alive = int(&reply["result"]["TTL"]) > 0;
        if alive {
            if *self.session.lock().unwrap() == Some(id) {
                *self.alive_since.lock().unwrap() = Some(sent);
            }
        } else {
            self.forget_session(id);
        }
        Ok(alive)
    }

    /// Whether this replica's record was written a quarter ttl ago or
    /// more; if so, it counts as written now.
    fn record_due(&self) -> bool {
        let quarter = Duration::from_secs(self.ttl_secs.max(1) as u64) / 4;
        let mut last = self.last_record.lock().unwrap();
        let due = last.is_none_or(|at| at.elapsed() >= quarter);
        if due {
            *last = Some(Instant::now());
        }
        due
    }

    /// This replica's candidate record.
    fn record(&self, leading: bool) -> String {
        format!(
            "{} {} {} {} {} {}",
            self.me.since_ms,
            super::unix_ms(),
            u8::from(leading),
            self.me.pid,
            self.me.record_host(),
            self.me.owner
        )
    }

    /// Time left on an etcd lease (whole seconds, as etcd keeps it).
    async fn time_left(&self, lease_id: i64) -> Result<Option<Duration>, StoreError> {
        if lease_id == 0 {
            return Ok(None);
        }
        let reply = self
            .call("lease/timetolive", json!({"ID": lease_id.to_string()}))
            .await?;
        let left = int(&reply["TTL"]);
        Ok((left >= 0).then(|| Duration::from_secs(left as u64)))
    }

    /// The holder a record names. A follower whose watch runs hears of the
    /// key's expiry from it: it need not ask for the time left.
    async fn holder(&self, record: &LeaseRecord) -> Result<Holder, StoreError> {
        self.saw(record.token);
        let expires_in = if self.wake.watching.load(Ordering::SeqCst) {
            None
        } else {
            self.time_left(record.lease_id).await?
        };
        Ok(Holder {
            owner: record.owner.clone(),
            token: record.token,
            expires_in,
        })
    }

    /// The instance of the follower first in `line` (keys of the line,
    /// oldest first) other than this replica.
    fn first_other_in(&self, line: &[Value]) -> Option<String> {
        line.iter()
            .map(|kv| String::from_utf8_lossy(&unb64(&kv["key"])).into_owned())
            .find(|key| *key != self.keys.my_place)
            .and_then(|key| key.strip_prefix(&self.keys.line).map(str::to_owned))
    }

    /// Whether this replica's etcd lease was granted or kept alive within
    /// `within`.
    fn kept_alive_within(&self, within: Duration) -> bool {
        self.alive_since
            .lock()
            .unwrap()
            .is_some_and(|at| at.elapsed() < within)
    }

    /// Reads the lease key and the counter (and refreshes this replica's
    /// record as a follower's on `session` if it is due: an acquisition
    /// writes it again, leading).
    async fn look(&self, session: Option<i64>) -> Result<Seen, StoreError> {
        let mut read = vec![range(&self.keys.lease), range(&self.keys.counter)];
        let read = match session.filter(|_| self.record_due()) {
            Some(session) => {
                read.push(put(
                    &self.keys.my_candidate,
                    &self.record(false),
                    Some(session),
                ));
                self.txn(vec![], read, vec![]).await?
            }
            // The first look, at startup: touches no etcd lease, so need
            // not wait for a grant, and is read locally by the member (a
            // round of the etcd leader's less). What it sees is a guess:
            // the acquisition's conditions check a lease it saw free, and
            // one it saw held is looked at again (it is not `fresh`).
            None => {
                let read = vec![
                    range_local(&self.keys.lease),
                    range_local(&self.keys.counter),
                ];
                self.txn_now(vec![], read, vec![]).await?
            }
        };
        let seen = Seen::parse(&kvs(&read, 0), &kvs(&read, 1))?;
        *self.seen.lock().unwrap() = Some(seen.clone());
        Ok(seen)
    }

    /// This replica's term began at `revision` with `token`.
    fn began(&self, record: LeaseRecord, initial_line: Option<(Vec<Value>, i64)>) {
        let (token, revision) = (record.token, record.mod_revision);
        self.saw(token);
        *self.term.lock().unwrap() = Some((token, revision));
        self.last_term.fetch_max(revision, Ordering::SeqCst);
        *self.seen.lock().unwrap() = Some(Seen {
            lease: Some(record),
            counter: token,
            counter_revision: revision,
        });
        self.line.stop();
        *self.line.task.lock().unwrap() = Some(tokio::spawn(watch_line(
            self.client.clone(),
            self.keys.clone(),
            self.line.clone(),
            initial_line,
        )));
    }

    /// The term is over without a release.
    fn lost(&self) {
        *self.term.lock().unwrap() = None;
        self.line.stop();
    }

    /// The lease the last holder's release handed to this replica: no
    /// request at all if its etcd lease was kept alive within half a ttl
    /// (the term is counted from then), else a keep-alive.
    async fn take_handed(&self) -> Result<Option<u64>, StoreError> {
        let Some(record) = self.wake.handed.lock().unwrap().take() else {
            return Ok(None);
        };
        let Some(session) = *self.session.lock().unwrap() else {
            return Ok(None);
        };
        let handed = self.hand_over
            && record.instance == self.me.instance
            && record.attempt == 0
            && record.lease_id == session
            && record.mod_revision > self.last_term.load(Ordering::SeqCst);
        if !handed {
            return Ok(None);
        }
        if !self.kept_alive_within(self.ttl() / 2) && !self.keep_alive(session).await? {
            return Ok(None);
        }
        let token = record.token;
        self.began(record, None);
        Ok(Some(token))
    }

    async fn acquire_once(&self, attempt: u64) -> Result<Attempt, StoreError> {
        if let Some(token) = self.take_handed().await? {
            return Ok(Attempt::Acquired { token });
        }
        // The lease key will hang on this replica's etcd lease, which the
        // server keeps a ttl from its last keep-alive (or its grant): the
        // supervisor counts the term from then (`acquired_since`).
        let mut session = self.fresh_session().await?;
        let cached = self.seen.lock().unwrap().clone();
        let mut seen = match cached {
            Some(seen) => (seen, false),
            None => (self.look(Some(session)).await?, true),
        };
        for _ in 0..3 {
            let (current, fresh) = (&seen.0, seen.1);
            let mine = |record: &LeaseRecord| record.instance == self.me.instance;
            // The condition the lease key must meet, and the token of a
            // repeated attempt (it keeps its token).
            let (guard, repeated) = match &current.lease {
                Some(record) if mine(record) && record.attempt == attempt => {
                    // A repeat of an attempt whose reply was lost.
                    self.saw(record.token);
                    if record.lease_id == session && fresh {
                        let token = record.token;
                        self.began(record.clone(), None);
                        return Ok(Attempt::Acquired { token });
                    }
                    // Its etcd lease was replaced: the key goes with the old.
                    let guard = same_revision(&self.keys.lease, record.mod_revision);
                    (guard, Some(record.token))
                }
                // An earlier term of this replica, over now.
                Some(record) if mine(record) => {
                    (same_revision(&self.keys.lease, record.mod_revision), None)
                }
                // What this replica saw last may be old: look again.
                Some(_) if !fresh => {
                    seen = (self.look(Some(session)).await?, true);
                    continue;
                }
                Some(record) => {
                    if self.record_due() {
                        let record =
                            put(&self.keys.my_candidate, &self.record(false), Some(session));
                        self.call("kv/put", record["request_put"].clone()).await?;
                    }
                    return Ok(Attempt::Held(self.holder(record).await?));
                }
                None => (absent(&self.keys.lease), None),
            };
            let highest = self
                .highest_seen
                .load(Ordering::SeqCst)
                .max(current.counter);
            if highest >= MAX_TOKEN {
                return Err(Fatal::CounterExhausted {
                    counter: highest,
                    max: MAX_TOKEN,
                }
                .into());
            }
            let token = repeated.unwrap_or(highest + 1);
            let value = format!("{token} {} {attempt} {}", self.me.instance, self.me.owner);
            *self.last_record.lock().unwrap() = Some(Instant::now());
            // Sent even while a grant `check` sent is unanswered.
            let reply = self
                .txn_now(
                    vec![
                        guard,
                        same_revision(&self.keys.counter, current.counter_revision),
                    ],
                    vec![
                        put(&self.keys.counter, &token.to_string(), None),
                        put(&self.keys.lease, &value, Some(session)),
                        put(&self.keys.my_candidate, &self.record(true), Some(session)),
                        delete(&self.keys.my_place),
                        range_prefix(&self.keys.line, 0),
                    ],
                    vec![range(&self.keys.lease), range(&self.keys.counter)],
                )
                .await;
            let won = match reply {
                Err(e) if lease_gone(&e) => {
                    // This replica's etcd lease expired: grant another.
                    self.forget_session(session);
                    session = self.fresh_session().await?;
                    seen = (self.look(Some(session)).await?, true);
                    continue;
                }
                reply => reply?,
            };
            if won["succeeded"].as_bool().unwrap_or(false) {
                let revision = int(&won["header"]["revision"]);
                let record = LeaseRecord {
                    token,
                    instance: self.me.instance.clone(),
                    attempt,
                    owner: self.me.owner.clone(),
                    lease_id: session,
                    mod_revision: revision,
                };
                self.began(record, Some((kvs(&won, 4), revision)));
                return Ok(Attempt::Acquired { token });
            }
            // Another replica got there first, or the counter moved: again,
            // with what the failure branch read.
            seen = (Seen::parse(&kvs(&won, 0), &kvs(&won, 1))?, true);
            *self.seen.lock().unwrap() = Some(seen.0.clone());
        }
        Ok(Attempt::HeldOff {
            retry_in: Duration::ZERO,
            why: "the lease changed during the attempt",
        })
    }

    async fn renew_once(&self, token: u64) -> Result<(), RenewError> {
        let session = *self.session.lock().unwrap();
        let alive = match session {
            Some(id) => self.keep_alive(id).await?,
            None => false,
        };
        let read = self
            .txn(vec![], vec![range(&self.keys.lease)], vec![])
            .await?;
        let current = kvs(&read, 0).first().map(LeaseRecord::parse).transpose()?;
        match current {
            Some(record)
                if alive
                    && record.token == token
                    && record.instance == self.me.instance
                    && Some(record.lease_id) == session =>
            {
                Ok(())
            }
            Some(record) => {
                self.lost();
                Err(RenewError::Lost(Some(self.holder(&record).await?)))
            }
            None => {
                self.lost();
                Err(RenewError::Lost(None))
            }
        }
    }

    async fn release_once(&self, token: u64) -> Result<bool, StoreError> {
        let term = *self.term.lock().unwrap();
        let Some((_, revision)) = term.filter(|(held, _)| *held == token) else {
            // A term this copy of the store did not begin (the guard's).
            return self.release_looked_up(token).await;
        };
        let next = self.line.first(&self.me.instance);
        self.line.stop();
        let mut record = vec![];
        if let Some(session) = *self.session.lock().unwrap() {
            record.push(put(
                &self.keys.my_candidate,
                &self.record(false),
                Some(session),
            ));
        }
        if let Some(next) = next.as_ref().filter(|n| self.hand_over && n.takes_handover) {
            if self.hand_to(token, revision, next, &record).await? {
                *self.term.lock().unwrap() = None;
                return Ok(true);
            }
        }
        // The lease key goes; the follower first in line is named in `wake`
        // (or, if the holder's watch of the line missed it, right after).
        let mut success = vec![delete(&self.keys.lease)];
        success.extend(record);
        if let Some(next) = &next {
            success.push(put(&self.keys.wake, &next.instance, None));
        }
        let line_read = success.len();
        success.push(range_prefix(&self.keys.line, 2));
        let done = self
            .txn(
                vec![same_revision(&self.keys.lease, revision)],
                success,
                vec![],
            )
            .await?;
        *self.term.lock().unwrap() = None;
        if !done["succeeded"].as_bool().unwrap_or(false) {
            return Ok(false);
        }
        if let Some(seen) = self.seen.lock().unwrap().as_mut() {
            seen.lease = None;
        }
        if next.is_none() {
            if let Some(first) = self.first_other_in(&kvs(&done, line_read)) {
                let wake = put(&self.keys.wake, &first, None);
                self.call("kv/put", wake["request_put"].clone()).await?;
            }
        }
        Ok(true)
    }

    /// The release at the end of the run: the lease goes to the follower
    /// first in line if it takes handovers, then one revocation of this
    /// replica's etcd lease deletes the lease key (if still this replica's:
    /// it hangs on that etcd lease) and its records at once. Followers see
    /// the lease key go and the first in line wakes.
    async fn release_last_once(&self, token: u64) -> Result<bool, StoreError> {
        let term = *self.term.lock().unwrap();
        let session = *self.session.lock().unwrap();
        let (Some((_, revision)), Some(session)) =
            (term.filter(|(held, _)| *held == token), session)
        else {
            return self.release_once(token).await;
        };
        let next = self.line.first(&self.me.instance);
        self.line.stop();
        self.wake.stop();
        if let Some(next) = next.as_ref().filter(|n| self.hand_over && n.takes_handover) {
            // Handed or not (an error included), the revocation comes next:
            // it cannot touch a key handed over (on the follower's lease).
            let _ = self.hand_to(token, revision, next, &[]).await;
        }
        let revoked = self
            .call("lease/revoke", json!({"ID": session.to_string()}))
            .await;
        *self.term.lock().unwrap() = None;
        match revoked {
            Ok(_) => {
                self.forget_session(session);
                self.withdrawn.store(true, Ordering::SeqCst);
                Ok(true)
            }
            // It had expired, and the lease key with it.
            Err(e) if lease_gone(&e) => {
                self.forget_session(session);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Hands the lease of `token` (written at `revision`) to `next`, in one
    /// transaction: the next token, the lease key on `next`'s etcd lease
    /// and out of line, if this replica still holds the lease, the counter
    /// has not moved and `next` still waits. False if any of that changed
    /// (or `next`'s etcd lease is gone): the caller releases plainly.
    async fn hand_to(
        &self,
        token: u64,
        revision: i64,
        next: &Place,
        record: &[Value],
    ) -> Result<bool, StoreError> {
        let handed = token + 1;
        if handed > MAX_TOKEN {
            return Ok(false);
        }
        let place = format!("{}{}", self.keys.line, next.instance);
        let value = format!("{handed} {} 0 {}", next.instance, next.owner);
        let mut success = vec![
            put(&self.keys.counter, &handed.to_string(), None),
            put(&self.keys.lease, &value, Some(next.session)),
            delete(&place),
            put(&self.keys.wake, &next.instance, None),
        ];
        success.extend(record.iter().cloned());
        let reply = self
            .txn(
                vec![
                    same_revision(&self.keys.lease, revision),
                    same_revision(&self.keys.counter, revision),
                    same_revision(&place, next.revision),
                ],
                success,
                vec![],
            )
            .await;
        match reply {
            Ok(reply) if reply["succeeded"].as_bool().unwrap_or(false) => {
                tracing::debug!(to = %next.owner, token = handed, "lease handed over");
                self.saw(handed);
                *self.seen.lock().unwrap() = None;
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(e) if lease_gone(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Releases `token` after reading who holds the lease and who waits.
    async fn release_looked_up(&self, token: u64) -> Result<bool, StoreError> {
        let read = self
            .txn(
                vec![],
                vec![range(&self.keys.lease), range_prefix(&self.keys.line, 2)],
                vec![],
            )
            .await?;
        let Some(record) = kvs(&read, 0).first().map(LeaseRecord::parse).transpose()? else {
            return Ok(false);
        };
        if record.token != token || record.instance != self.me.instance {
            return Ok(false);
        }
        let next = self.first_other_in(&kvs(&read, 1));
        let mut success = vec![delete(&self.keys.lease)];
        if let Some(next) = &next {
            success.push(put(&self.keys.wake, next, None));
        }
        let session = *self.session.lock().unwrap();
        if let Some(session) = session {
            success.push(put(
                &self.keys.my_candidate,
                &self.record(false),
                Some(session),
            ));
        }
        let done = self
            .txn(
                vec![same_revision(&self.keys.lease, record.mod_revision)],
                success,
                vec![],
            )
            .await?;
        Ok(done["succeeded"].as_bool().unwrap_or(false))
    }

    async fn advance_once(&self, floor: u64) -> Result<u64, StoreError> {
        if floor > MAX_TOKEN {
            return Err(Fatal::FloorOutOfRange {
                floor,
                max: MAX_TOKEN,
            }
            .into());
        }
        for _ in 0..5 {
            let read = self
                .txn(vec![], vec![range(&self.keys.counter)], vec![])
                .await?;
            let (counter, revision) = counter_of(kvs(&read, 0).first())?;
            if counter >= floor {
                self.saw(counter);
                return Ok(counter);
            }
            let moved = self
                .txn(
                    vec![same_revision(&self.keys.counter, revision)],
                    vec![put(&self.keys.counter, &floor.to_string(), None)],
                    vec![],
                )
                .await?;
            if moved["succeeded"].as_bool().unwrap_or(false) {
                self.saw(floor);
                return Ok(floor);
            }
        }
        Err(Unreachable::Server("etcd: the counter kept changing; try again".into()).into())
    }

    async fn observe_once(&self) -> Result<Observation, StoreError> {
        let read = self
            .txn(
                vec![],
                vec![
                    range(&self.keys.lease),
                    range(&self.keys.counter),
                    range_prefix(&self.keys.candidates, 0),
                ],
                vec![],
            )
            .await?;
        let holder = match kvs(&read, 0).first().map(LeaseRecord::parse).transpose()? {
            Some(record) => Some(self.holder(&record).await?),
            None => None,
        };
        let counter = counter_of(kvs(&read, 1).first()).map_or(0, |(counter, _)| counter);
        let mut candidates: Vec<Candidate> = kvs(&read, 2)
            .iter()
            .filter_map(|kv| {
                let value = String::from_utf8_lossy(&unb64(&kv["value"])).into_owned();
                let mut parts = value.splitn(6, ' ');
                let mut next = || parts.next().unwrap_or_default().to_owned();
                let (since, seen, leading, pid, host, owner) =
                    (next(), next(), next(), next(), next(), next());
                let (host, shards) = split_record_host(&host);
                Some(Candidate {
                    owner,
                    host,
                    shards,
                    pid: pid.parse().ok()?,
                    since_ms: since.parse().ok()?,
                    last_seen_ms: seen.parse().ok()?,
                    leading: leading == "1",
                })
            })
            .collect();
        candidates.sort_by_key(|c| c.since_ms);
        Ok(Observation {
            holder,
            counter,
            candidates,
        })
    }

    /// Takes a place in line and starts the watch that wakes this follower,
    /// once.
    async fn follow(&self) -> Result<(), StoreError> {
        let running = self
            .wake
            .task
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|task| !task.is_finished());
        if running {
            return Ok(());
        }
        let session = self.session().await?;
        let flag = if self.hand_over { "h" } else { "-" };
        let place = format!("{flag} {}", self.me.owner);
        let placed = self
            .call(
                "kv/put",
                put(&self.keys.my_place, &place, Some(session))["request_put"].clone(),
            )
            .await?;
        let from = int(&placed["header"]["revision"]) + 1;
        let mut task = self.wake.task.lock().unwrap();
        if let Some(running) = task.take() {
            running.abort();
        }
        *task = Some(tokio::spawn(watch(
            self.client.clone(),
            self.keys.clone(),
            self.me.instance.clone(),
            self.wake.clone(),
            self.seen.clone(),
            from,
        )));
        Ok(())
    }
}

impl LeaseStore for EtcdStore {
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        Box::pin(async move {
            // The etcd lease is granted at the same time: an acquisition
            // then needs one transaction, sent without waiting for the
            // grant's reply.
            self.send_grant().await;
            match self.look(None).await {
                Ok(_) => Ok(None),
                Err(StoreError::Fatal(fatal)) => Err(fatal),
                Err(StoreError::Unreachable(why)) => Ok(Some(why)),
            }
        })
    }

    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        Box::pin(self.acquire_once(attempt))
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        Box::pin(self.renew_once(token))
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        Box::pin(self.release_once(token))
    }

    fn release_last(&self, token: u64) -> Call<'_, bool> {
        Box::pin(self.release_last_once(token))
    }

    fn advance_fence(&self, floor: u64) -> Call<'_, u64> {
        Box::pin(self.advance_once(floor))
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        Box::pin(async move {
            // Refreshes this replica's record, on its etcd lease kept alive.
            let session = self.live_session().await?;
            let record = put(&self.keys.my_candidate, &self.record(false), Some(session));
            self.call("kv/put", record["request_put"].clone()).await?;
            Ok(())
        })
    }

    fn withdraw(&self) -> Call<'_, ()> {
        Box::pin(async move {
            self.wake.stop();
            self.line.stop();
            if self.withdrawn.load(Ordering::SeqCst) {
                return Ok(());
            }
            let session = self.session.lock().unwrap().take();
            match session {
                // Its records (and a lease key not released) go with it.
                Some(id) => {
                    self.call("lease/revoke", json!({"ID": id.to_string()}))
                        .await?;
                }
                // A store whose session never began (the guard's, made
                // again after leaderrun is gone): its records by name.
                None => {
                    for key in [&self.keys.my_candidate, &self.keys.my_place] {
                        self.call("kv/deleterange", json!({"key": b64(key.as_bytes())}))
                            .await?;
                    }
                }
            }
            Ok(())
        })
    }

    fn observe(&self) -> Call<'_, Observation> {
        Box::pin(self.observe_once())
    }

    fn notice(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.follow().await.is_err() {
                // No watch: the campaign's own period applies.
                tokio::time::sleep(Duration::from_millis(500)).await;
                return;
            }
            self.wake.notify.notified().await;
        })
    }

    fn wakes_on_release(&self) -> bool {
        self.wake.watching.load(Ordering::SeqCst)
    }

    fn acquired_since(&self) -> Option<Instant> {
        *self.alive_since.lock().unwrap()
    }

    fn leading(&self) {
        // The acquisition took this replica out of line.
        self.wake.stop();
        self.wake.handed.lock().unwrap().take();
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.wake.stop();
        self.line.stop();
    }
}
