//! The etcd backend: leases on a consensus store.
//!
//! - `url.rs`: `etcd://host:port[,host:port…][/prefix]`, `etcds://` for TLS;
//! - `client.rs`: etcd's v3 JSON gateway over hyper, member by member.
//!
//! The keys of lease `K` live under `PREFIX/K/` (`K` percent-encoded where
//! it holds `/` or `%`):
//!
//! - `lease`: `TOKEN INSTANCE ATTEMPT OWNER`, attached to the holder's etcd
//!   lease, so it goes when that lease expires;
//! - `counter`: the last token drawn (or the fence floor), never deleted and
//!   attached to nothing: tokens only grow, across terms, member restarts
//!   and a whole cluster's restart;
//! - `candidates/INSTANCE`: a running replica's record;
//! - `line/INSTANCE`: a follower waiting, its place the key's creation
//!   revision;
//! - `wake`: the follower a release handed the lease to.
//!
//! Each replica has one etcd lease of the ttl (rounded up to whole seconds:
//! etcd's unit), granted on first use: its records and, while it leads,
//! the `lease` key hang on it. Renewing is a keep-alive of it, so the server
//! keeps the key at least a ttl from the moment the request left, and
//! usually longer (an etcd leader change extends every lease); the holder
//! judges its deadline by its own monotonic clock from the request's send,
//! so its command is dead before the server could let the key go.
//!
//! Acquisition is one transaction, guarded by the `lease` key being absent
//! (or this replica's, from an earlier term) and by the counter's revision:
//! it writes the counter, the lease and the record at once. A release
//! deletes the lease and names, in `wake`, the follower first in line; each
//! follower watches the key's folder and wakes only for its own name, or,
//! when the lease went without a release (its holder's etcd lease expired),
//! only if it is first in line.

mod client;
mod url;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use serde_json::{Value, json};
use tokio::sync::Notify;

use self::client::{Client, EtcdError, b64, int, unb64};
use self::url::EtcdUrl;
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
            last_record: Mutex::new(None),
            highest_seen: AtomicU64::new(0),
            wake: Arc::new(Waiter::default()),
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

/// The lease record: `TOKEN INSTANCE ATTEMPT OWNER`.
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

/// A follower's wake-ups, from its watch.
#[derive(Default)]
struct Waiter {
    notify: Notify,
    /// The watch runs and this replica has a place in line.
    watching: AtomicBool,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Waiter {
    /// Stops the watch (and so the wake-ups) of this replica.
    fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        self.watching.store(false, Ordering::SeqCst);
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
    /// When this replica's record was last written.
    last_record: Mutex<Option<Instant>>,
    /// The highest token this replica has seen, its own or a holder's.
    highest_seen: AtomicU64,
    wake: Arc<Waiter>,
}

fn put(key: &str, value: &str, lease: Option<i64>) -> Value {
    let mut put = json!({"key": b64(key.as_bytes()), "value": b64(value.as_bytes())});
    if let Some(lease) = lease {
        put["lease"] = json!(lease.to_string());
    }
    json!({ "request_put": put })
}

fn range(key: &str) -> Value {
    json!({ "request_range": {"key": b64(key.as_bytes())} })
}

/// Every key that starts with `prefix`, oldest first.
fn range_prefix(prefix: &str, limit: i64) -> Value {
    json!({ "request_range": {
        "key": b64(prefix.as_bytes()),
        "range_end": b64(&prefix_end(prefix.as_bytes())),
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
        "limit": limit,
    }})
}

/// A transaction's condition: `key` last changed at `revision` (0: absent).
fn same_revision(key: &str, revision: i64) -> Value {
    json!({"key": b64(key.as_bytes()), "target": "MOD", "result": "EQUAL", "mod_revision": revision.to_string()})
}

/// A transaction's condition: `key` does not exist.
fn absent(key: &str) -> Value {
    json!({"key": b64(key.as_bytes()), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
}

/// The counter key's value and revision (0 and 0 when absent).
fn counter_of(kv: Option<&Value>) -> Result<(u64, i64), StoreError> {
    let Some(kv) = kv else {
        return Ok((0, 0));
    };
    let counter = String::from_utf8_lossy(&unb64(&kv["value"]))
        .parse()
        .map_err(|_| Fatal::Corrupt("the counter key is not a number".into()))?;
    Ok((counter, int(&kv["mod_revision"])))
}

fn delete(key: &str) -> Value {
    json!({ "request_delete_range": {"key": b64(key.as_bytes())} })
}

/// The end of the range of keys that start with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The key-values of the `n`th response of a transaction.
fn kvs(reply: &Value, n: usize) -> Vec<Value> {
    reply["responses"][n]["response_range"]["kvs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
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

    async fn call(&self, path: &str, body: Value) -> Result<Value, StoreError> {
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
        self.call(
            "kv/txn",
            json!({"compare": compare, "success": success, "failure": failure}),
        )
        .await
    }

    /// This replica's etcd lease: granted on first use, and again after it
    /// expired.
    async fn session(&self) -> Result<i64, StoreError> {
        if let Some(id) = *self.session.lock().unwrap() {
            return Ok(id);
        }
        let granted = self
            .call("lease/grant", json!({"TTL": self.ttl_secs.max(1)}))
            .await?;
        let id = int(&granted["ID"]);
        if id == 0 {
            return Err(Unreachable::Server(format!("etcd: no lease granted: {granted}")).into());
        }
        *self.session.lock().unwrap() = Some(id);
        Ok(id)
    }

    /// This replica's etcd lease, kept alive now (a keep-alive is no etcd
    /// write), or granted anew if it had expired, with its records.
    async fn live_session(&self) -> Result<i64, StoreError> {
        let session = self.session().await?;
        if self.keep_alive(session).await? {
            return Ok(session);
        }
        *self.last_record.lock().unwrap() = None;
        self.session().await
    }

    /// Keeps this replica's etcd lease alive: false if it had expired (its
    /// keys are gone; a new one is granted on next use).
    async fn keep_alive(&self, id: i64) -> Result<bool, StoreError> {
        let reply = self
            .call("lease/keepalive", json!({"ID": id.to_string()}))
            .await?;
        let alive = int(&reply["result"]["TTL"]) > 0;
        if !alive {
            let mut session = self.session.lock().unwrap();
            if *session == Some(id) {
                *session = None;
            }
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

    async fn holder(&self, record: &LeaseRecord) -> Result<Holder, StoreError> {
        self.saw(record.token);
        Ok(Holder {
            owner: record.owner.clone(),
            token: record.token,
            expires_in: self.time_left(record.lease_id).await?,
        })
    }

    async fn acquire_once(&self, attempt: u64) -> Result<Attempt, StoreError> {
        // The lease key will hang on this replica's etcd lease, which the
        // server keeps a ttl from its last keep-alive. That must be no
        // earlier than this call's start, from which the supervisor counts
        // the term: keep it alive first.
        let session = self.live_session().await?;
        for _ in 0..3 {
            // The read refreshes this replica's record as a follower's (an
            // acquisition writes it again, leading), unless it was written
            // within a quarter ttl: a follower woken by a release spares
            // the write.
            let mut read = vec![range(&self.keys.lease), range(&self.keys.counter)];
            if self.record_due() {
                read.push(put(
                    &self.keys.my_candidate,
                    &self.record(false),
                    Some(session),
                ));
            }
            let read = self.txn(vec![], read, vec![]).await?;
            let current = kvs(&read, 0).first().map(LeaseRecord::parse).transpose()?;
            let (counter, counter_revision) = counter_of(kvs(&read, 1).first())?;
            self.saw(counter);
            let mine = |record: &LeaseRecord| record.instance == self.me.instance;
            // The condition the lease key must meet, and the token of a
            // repeated attempt (it keeps its token).
            let (guard, repeated) = match &current {
                Some(record) if mine(record) && record.attempt == attempt => {
                    // A repeat of an attempt whose reply was lost.
                    self.saw(record.token);
                    if record.lease_id == session {
                        return Ok(Attempt::Acquired {
                            token: record.token,
                        });
                    }
                    // Its etcd lease was replaced: the key goes with the old.
                    let guard = same_revision(&self.keys.lease, record.mod_revision);
                    (guard, Some(record.token))
                }
                // An earlier term of this replica, over now.
                Some(record) if mine(record) => {
                    (same_revision(&self.keys.lease, record.mod_revision), None)
                }
                Some(record) => {
                    return Ok(Attempt::Held(self.holder(record).await?));
                }
                None => (absent(&self.keys.lease), None),
            };
            let highest = self.highest_seen.load(Ordering::SeqCst).max(counter);
            if highest >= MAX_TOKEN {
                return Err(Fatal::CounterExhausted {
                    counter: highest,
                    max: MAX_TOKEN,
                }
                .into());
            }
            let token = repeated.unwrap_or(highest + 1);
            let value = format!("{token} {} {attempt} {}", self.me.instance, self.me.owner);
            let won = self
                .txn(
                    vec![guard, same_revision(&self.keys.counter, counter_revision)],
                    vec![
                        put(&self.keys.counter, &token.to_string(), None),
                        put(&self.keys.lease, &value, Some(session)),
                        put(&self.keys.my_candidate, &self.record(true), Some(session)),
                        delete(&self.keys.my_place),
                    ],
                    vec![],
                )
                .await?;
            if won["succeeded"].as_bool().unwrap_or(false) {
                self.saw(token);
                return Ok(Attempt::Acquired { token });
            }
            // Another replica got there first, or the counter moved: again.
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
            Some(record) => Err(RenewError::Lost(Some(self.holder(&record).await?))),
            None => Err(RenewError::Lost(None)),
        }
    }

    async fn release_once(&self, token: u64) -> Result<bool, StoreError> {
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
        let next = kvs(&read, 1)
            .iter()
            .map(|kv| String::from_utf8_lossy(&unb64(&kv["key"])).into_owned())
            .find(|key| *key != self.keys.my_place)
            .and_then(|key| key.strip_prefix(&self.keys.line).map(str::to_owned));
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
        let placed = self
            .call(
                "kv/put",
                put(&self.keys.my_place, "", Some(session))["request_put"].clone(),
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
            from,
        )));
        Ok(())
    }
}

/// Watches the lease's folder from revision `from`, and wakes this follower
/// when a release names it, or when the lease went without a release and
/// it is first in line. Re-opened after a break, from where it stopped.
async fn watch(
    client: Arc<Client>,
    keys: Keys,
    instance: String,
    waiter: Arc<Waiter>,
    mut from: i64,
) {
    let create = |from: i64| {
        json!({
            "key": b64(keys.folder.as_bytes()),
            "range_end": b64(&prefix_end(keys.folder.as_bytes())),
            "start_revision": from.to_string(),
        })
    };
    loop {
        let mut stream = match client.watch(create(from)).await {
            Ok(stream) => stream,
            Err(_) => {
                waiter.watching.store(false, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        loop {
            let result = match stream.next().await {
                Ok(result) => result,
                Err(_) => break,
            };
            if result["created"].as_bool().unwrap_or(false) {
                waiter.watching.store(true, Ordering::SeqCst);
            }
            if result["canceled"].as_bool().unwrap_or(false) {
                // Compacted past `from`: start again from now, and look.
                from = 0;
                waiter.notify.notify_one();
                break;
            }
            let events = result["events"].as_array().cloned().unwrap_or_default();
            let mut named = false;
            let mut lease_gone = false;
            for event in &events {
                let key = String::from_utf8_lossy(&unb64(&event["kv"]["key"])).into_owned();
                let deleted = event["type"].as_str() == Some("DELETE");
                from = from.max(int(&event["kv"]["mod_revision"]) + 1);
                if key == keys.wake && !deleted {
                    named |= unb64(&event["kv"]["value"]) == instance.as_bytes();
                    lease_gone = false;
                } else if key == keys.lease && deleted {
                    lease_gone = !events
                        .iter()
                        .any(|e| unb64(&e["kv"]["key"]) == keys.wake.as_bytes());
                }
            }
            if named || (lease_gone && first_in_line(&client, &keys, &instance).await) {
                waiter.notify.notify_one();
            }
        }
        waiter.watching.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether this follower has waited longest.
async fn first_in_line(client: &Client, keys: &Keys, instance: &str) -> bool {
    let reply = client
        .call("kv/range", &range_prefix(&keys.line, 1)["request_range"])
        .await;
    match reply {
        Ok(reply) => reply["kvs"][0]["key"]
            .as_str()
            .map(|k| unb64(&json!(k)) == format!("{}{instance}", keys.line).as_bytes())
            // Nobody in line (a race): wake, the attempt tells.
            .unwrap_or(true),
        Err(_) => true,
    }
}

impl LeaseStore for EtcdStore {
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        Box::pin(async move {
            match self
                .txn(vec![], vec![range(&self.keys.counter)], vec![])
                .await
            {
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
            let session = self.session.lock().unwrap().take();
            match session {
                // Its records (and a lease key not released) go with it.
                Some(id) => {
                    self.call("lease/revoke", json!({"ID": id.to_string()}))
                        .await?;
                }
                // A copy of the store made before its session began (the
                // guard's, forked at startup): its records by name.
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

    fn leading(&self) {
        // The acquisition took this replica out of line.
        self.wake.stop();
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.wake.stop();
    }
}
