//! The Redis backend: one lease shared by replicas on any number of hosts.
//!
//! - `url.rs`: the URL grammar (`redis://`, `rediss://`, `redis+unix://`,
//!   `redis+sentinel://`, `redis+cluster://`);
//! - `connection.rs`: the target (one server, a Sentinel service, a
//!   cluster), the command connection, error sorting;
//! - `acquisition.rs`: an acquisition attempt's request and answer, and the
//!   answer the line got before the campaign asked;
//! - `line.rs`: the followers' line (`BLPOP`, with an acquisition attempt
//!   right behind it, which Redis runs the moment a release's wake is
//!   served);
//! - `scripts/*.lua`: every operation, one script each, atomic on the server.
//!
//! The keys of a lease share a hash tag, so they live in one slot of a Redis
//! Cluster: `leaderrun:{KEY}:lease` (`"<token> <instance>/<attempt>
//! <owner>"` with a PX expiry), `:counter` (no expiry), `:candidates`,
//! `:line` (the one wake a release leaves), `:released` (the token of the
//! last release, for a ttl), `:history` (the replication id of the server
//! the lease was last written on), `:heldoff` (a ttl's hold-off after
//! another history was found).
//!
//! Four things guard against a Redis that lost its data (a restart without
//! persistence, a failover to a replica that missed writes, a `FLUSHALL`, an
//! eviction):
//!
//! - tokens only grow while any replica lives: each replica sends the highest
//!   token it has seen, and acquisition moves the counter past it first;
//! - a Redis that started less than one ttl ago, or whose run id changed
//!   under a replica's eyes, is not acquired from until one ttl has passed;
//! - a follower that saw a holder whose lease has not expired yet, and finds
//!   it gone without a release, waits for that expiry;
//! - a free lease whose `:history` names another replication id than the
//!   server's (a promoted replica: whoever asks, also a replica started after
//!   the failover) is not handed out for one ttl.
//!
//! In each case a leader from before the loss may still be stopping its
//! child; its next renewal finds the lease gone and its term is lost.

mod acquisition;
mod connection;
mod line;
mod url;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::Script;
use tracing::{debug, warn};

use self::acquisition::{Acquirer, Answer};
use self::connection::{Conn, Connection, Target, is_auth_error};
use self::line::Line;
use self::url::{Address, RedisUrl};
use super::{
    Attempt, Backend, BackendOptions, Bounded, Call, Candidate, Capabilities, Fatal, Holder,
    Identity, LeaseConfig, LeaseStore, Observation, RenewError, StoreError, Unreachable,
    split_record_host,
};
use crate::error::ConfigError;

/// Tokens are Lua numbers on the server: integers are exact up to 2^53.
pub const MAX_TOKEN: u64 = (1 << 53) - 1;

const BEAT: &str = include_str!("scripts/beat.lua");
const LIVE: &str = include_str!("scripts/live.lua");
/// How long a release sent with its reply skipped is left to work before it
/// is confirmed (`RedisStore::release_once`): the next leader's wake and
/// the start of its command, on this 2-core VM about 1.5 ms.
const QUIET_RELEASE: Duration = Duration::from_millis(3);

/// A Redis URL, parsed, with its target (one server, a Sentinel service or
/// a cluster).
pub struct RedisBackend {
    url: RedisUrl,
    target: Target,
}

pub fn parse(raw: &str, options: &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError> {
    let url = RedisUrl::parse(raw)?;
    let target = connection::target(
        &url,
        options.tls_ca_file.as_ref(),
        options.sentinel_password.as_deref(),
    )?;
    Ok(Arc::new(RedisBackend { url, target }))
}

impl fmt::Display for RedisBackend {
    /// The URL with the password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.url)
    }
}

impl Backend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            tokens: true,
            fence_advance: true,
            // Only with persistence, which leaderrun cannot see; replicas
            // carry the highest token seen, so tokens grow while any lives.
            durable_tokens: false,
            server_clock: true,
            max_token: MAX_TOKEN,
        }
    }

    fn lease(&self, lease: LeaseConfig) -> Result<Arc<dyn LeaseStore>, ConfigError> {
        let call_timeout = lease.call_timeout;
        Ok(Bounded::wrap(Arc::new(self.store(lease)), call_timeout))
    }
}

impl RedisBackend {
    fn store(&self, lease: LeaseConfig) -> RedisStore {
        let prefix = format!("leaderrun:{{{}}}", lease.key);
        let key = |name: &str| format!("{prefix}:{name}");
        let id = &lease.me;
        let keys = Keys {
            line: key("line"),
            lease: key("lease"),
            counter: key("counter"),
            candidates: key("candidates"),
            released: key("released"),
            probe: key("probe"),
            history: key("history"),
            heldoff: key("heldoff"),
        };
        let record = format!(
            "{} {} {} {}",
            id.since_ms,
            id.pid,
            id.record_host(),
            id.owner
        );
        let acquirer = Arc::new(Acquirer::new(
            [
                keys.lease.clone(),
                keys.counter.clone(),
                keys.candidates.clone(),
                keys.released.clone(),
                keys.history.clone(),
                keys.heldoff.clone(),
                keys.line.clone(),
            ],
            lease.me.clone(),
            lease.ttl,
            record.clone(),
        ));
        // The acquisition behind the line is one the release hands over:
        // not where taking a lease needs more than the backend's say-so,
        // nor where a write counts only once replicas have it (`WAIT` on
        // the line's connection would block every turn).
        let behind =
            (lease.hand_over && self.url.wait_replicas == 0).then(|| (acquirer.clone(), lease.ttl));
        RedisStore {
            conn: Connection::new(self.target.clone(), lease.call_timeout, &self.url),
            line: Arc::new(Line::new(
                keys.line.clone(),
                self.target.clone(),
                lease.call_timeout,
                behind,
            )),
            wait_replicas: self.url.wait_replicas,
            call_timeout: lease.call_timeout,
            service: match &self.url.address {
                Address::Sentinel { service, .. } => Some(service.clone()),
                _ => None,
            },
            keys,
            record,
            me: lease.me,
            ttl: lease.ttl,
            acquirer,
            handed_since: Mutex::new(None),
            withdrawn: AtomicBool::new(false),
            scripts: Scripts::new(),
        }
    }
}

/// One replica's lease on one key.
pub struct RedisStore {
    conn: Connection,
    line: Arc<Line>,
    /// Replicas that must acknowledge an acquisition or renewal (`?wait=`).
    wait_replicas: u32,
    call_timeout: Duration,
    /// The Sentinel service, behind Sentinel.
    service: Option<String>,
    keys: Keys,
    me: Identity,
    /// "<since ms> <pid> <host> <owner>": this replica's candidate record.
    record: String,
    ttl: Duration,
    /// Acquisition attempts: what they send, what they learnt, and the
    /// answer the line got to one it sent behind its `BLPOP`.
    acquirer: Arc<Acquirer>,
    /// The last acquisition was the line's, sent then: the term is counted
    /// from that moment (`acquired_since`).
    handed_since: Mutex<Option<std::time::Instant>>,
    scripts: Scripts,
    /// The last release removed the candidate record: `withdraw` has
    /// nothing left to do.
    withdrawn: AtomicBool,
}

struct Keys {
    lease: String,
    line: String,
    counter: String,
    candidates: String,
    released: String,
    probe: String,
    /// The replication id of the server the lease was last written on.
    history: String,
    /// Set for one ttl when a server with another history was found.
    heldoff: String,
}

struct Scripts {
    renew: Script,
    release: Script,
    heartbeat: Script,
    advance: Script,
    observe: Script,
    withdraw: Script,
    probe: Script,
}

impl Scripts {
    fn new() -> Scripts {
        let with = |prelude: &str, body: &str| Script::new(&[prelude, body].concat());
        Scripts {
            renew: with(BEAT, include_str!("scripts/renew.lua")),
            release: with(BEAT, include_str!("scripts/release.lua")),
            heartbeat: with(BEAT, include_str!("scripts/heartbeat.lua")),
            advance: Script::new(include_str!("scripts/advance.lua")),
            observe: with(LIVE, include_str!("scripts/observe.lua")),
            withdraw: with(&[BEAT, LIVE].concat(), include_str!("scripts/withdraw.lua")),
            probe: Script::new(include_str!("scripts/probe.lua")),
        }
    }
}

impl RedisStore {
    /// `?wait=N`: the write just made on this connection counts only once N
    /// replicas acknowledged it (`WAIT`, on the server of the lease's key),
    /// so a replica promoted by a failover already has it. Not acknowledged
    /// in time: the call could not be completed (an acquisition is then
    /// repeated as the same attempt, a renewal is retried).
    async fn acknowledged(&self) -> Result<(), StoreError> {
        if self.wait_replicas == 0 {
            return Ok(());
        }
        let within = (self.call_timeout / 2).as_millis().max(1) as u64;
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.wait_replicas).arg(within);
        let acknowledged: i64 = self.conn.on_key_node(wait, &self.keys.lease).await?;
        if acknowledged < i64::from(self.wait_replicas) {
            return Err(Unreachable::Server(format!(
                "redis: {acknowledged} of the {} replicas ?wait= asks for acknowledged the write within {within} ms",
                self.wait_replicas
            ))
            .into());
        }
        Ok(())
    }

    fn ttl_ms(&self) -> String {
        self.ttl.as_millis().to_string()
    }

    async fn acquire_once(&self, attempt: u64) -> Result<Attempt, StoreError> {
        let acquirer = &self.acquirer;
        acquirer.attempting(attempt);
        if let Some((answer, sent_at)) = acquirer.take_kept(attempt) {
            if let Some(sent_at) = sent_at {
                debug!("the lease was taken by the attempt sent behind the line's BLPOP");
                *self.handed_since.lock().unwrap() = Some(sent_at.into_std());
            }
            return Ok(answer);
        }
        *self.handed_since.lock().unwrap() = None;
        let request = match acquirer.request(attempt, None) {
            Ok(request) => request,
            Err(held_off) => return Ok(held_off),
        };
        let keys: Vec<&str> = acquirer.keys.iter().map(String::as_str).collect();
        let reply = self
            .conn
            .run(&acquirer.script, &keys, &request.args)
            .await?;
        match acquirer.answer(reply, &request)? {
            Answer::Attempt(answer) => {
                if let Attempt::Acquired { .. } = answer {
                    // Not acknowledged: an error, and the retry finds the
                    // lease already ours (acquire is idempotent for one
                    // attempt).
                    self.acknowledged().await?;
                }
                Ok(answer)
            }
            // Only an attempt behind the line is declined.
            Answer::Declined => Err(Fatal::Internal("an acquisition was declined".into()).into()),
        }
    }

    async fn renew_once(&self, token: u64) -> Result<(), RenewError> {
        let k = &self.keys;
        let (code, holder_token, owner): (i64, u64, String) = self
            .conn
            .run(
                &self.scripts.renew,
                &[&k.lease, &k.candidates, &k.history],
                &[
                    self.me.instance.clone(),
                    token.to_string(),
                    self.ttl_ms(),
                    self.record.clone(),
                ],
            )
            .await?;
        if code == 1 {
            self.acknowledged().await?;
            return Ok(());
        }
        self.acquirer.saw(holder_token);
        Err(RenewError::Lost((holder_token > 0).then_some(Holder {
            owner,
            token: holder_token,
            expires_in: None,
        })))
    }

    async fn check_once(&self) -> Result<Option<Unreachable>, Fatal> {
        if let Some(service) = &self.service {
            match self.conn.target().service_known(service).await {
                Ok(true) => {}
                Ok(false) => {
                    return Err(Fatal::Refused(format!(
                        "backend {}: the sentinels know no service {service:?}; name the one in their `sentinel monitor` line",
                        self.conn.shown()
                    )));
                }
                Err(error) if is_auth_error(&error) => {
                    return Err(Fatal::Refused(format!(
                        "backend {}: the sentinels refused the password: {error}; give theirs with --sentinel-password or LEADERRUN_SENTINEL_PASSWORD (the URL's password is the Redis servers')",
                        self.conn.shown()
                    )));
                }
                Err(error) => {
                    return Ok(Some(Unreachable::Server(format!(
                        "redis sentinels of {}: {error}",
                        self.conn.shown()
                    ))));
                }
            }
        }
        let k = &self.keys;
        let probe = self
            .conn
            .run_raw::<String>(
                &self.scripts.probe,
                &[&k.lease, &k.counter, &k.candidates, &k.released, &k.probe],
                &[],
            )
            .await;
        match probe {
            Ok(answer) if answer == "ok" => {}
            Ok(refused) => {
                return Err(Fatal::Refused(format!(
                    "backend {}: the user lacks a permission: {refused}; grant it (the README's ACL line lists every one leaderrun needs)",
                    self.conn.shown()
                )));
            }
            Err(error) if error.kind() == redis::ErrorKind::Parse => {
                let error = error.to_string();
                let first = error.lines().next().unwrap_or_default();
                return Err(Fatal::Refused(format!(
                    "backend {}: the server does not answer as a Redis server ({first}); is the port that of another service, such as an HTTP server?",
                    self.conn.shown()
                )));
            }
            Err(error) => match self.conn.classify(error) {
                StoreError::Fatal(fatal) => return Err(fatal),
                StoreError::Unreachable(why) => return Ok(Some(why)),
            },
        }
        // A lease key evicted before its expiry is a lost lease: say so now.
        let mut info_memory = redis::cmd("INFO");
        info_memory.arg("memory");
        let info: Result<String, _> = self.conn.on_key_node(info_memory, &k.lease).await;
        if let Ok(info) = info {
            let field = |name: &str| {
                info.lines()
                    .find_map(|line| line.strip_prefix(name))
                    .map(|v| v.trim().to_owned())
            };
            let limited = field("maxmemory:").is_some_and(|m| m != "0");
            let policy = field("maxmemory_policy:").unwrap_or_default();
            if limited && policy != "noeviction" {
                warn!(
                    policy,
                    "the Redis server evicts keys under memory pressure (maxmemory-policy {policy}): an evicted lease is lost data, which leaderrun waits out, and an evicted counter loses tokens; set maxmemory-policy noeviction"
                );
            }
        }
        Ok(None)
    }

    /// Gives the lease up; `last`: removes the candidate record too (the
    /// run is over) instead of refreshing it.
    ///
    /// A term that began with an acquisition behind the line sends its
    /// release first on the line's connection, idle since, with the reply
    /// skipped (`CLIENT REPLY SKIP`): Redis then has nothing to write back
    /// to this replica between serving the next follower its wake and going
    /// idle, and on a host shared with the next leader that write cut into
    /// the start of its command. For `QUIET_RELEASE` this replica does
    /// nothing else (its own teardown would compete the same way), then the
    /// release runs again on the command connection, answered: `2` when the
    /// quiet one took effect, `1` when it did not (a forgotten script, a
    /// broken connection), so the outcome is always known.
    async fn release_once(&self, token: u64, last: bool) -> Result<bool, StoreError> {
        let k = &self.keys;
        let keys = [&*k.lease, &k.candidates, &k.line, &k.released];
        let args = [
            self.me.instance.clone(),
            token.to_string(),
            self.ttl_ms(),
            self.record.clone(),
            if last { "1" } else { "0" }.to_owned(),
        ];
        if let Some(Conn::Server(mut line)) = self.line.take_kept() {
            let mut skip = redis::cmd("CLIENT");
            skip.arg("REPLY").arg("SKIP").set_no_response(true);
            let mut release = redis::cmd("EVALSHA");
            release
                .arg(self.scripts.release.get_hash())
                .arg(keys.len())
                .arg(&keys[..])
                .arg(&args[..])
                .set_no_response(true);
            // Both are only queued: the connection's task writes them while
            // this one waits.
            if skip.query_async::<()>(&mut line).await.is_ok()
                && release.query_async::<()>(&mut line).await.is_ok()
            {
                tokio::time::sleep(QUIET_RELEASE).await;
            }
        }
        let released: i64 = self.conn.run(&self.scripts.release, &keys, &args).await?;
        Ok(released != 0)
    }
}

impl LeaseStore for RedisStore {
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        Box::pin(self.check_once())
    }

    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        self.withdrawn.store(false, Ordering::SeqCst);
        Box::pin(self.acquire_once(attempt))
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        Box::pin(self.renew_once(token))
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        Box::pin(self.release_once(token, false))
    }

    /// The release and the candidate record's removal in one script: one
    /// round trip fewer at the end of every run.
    fn release_last(&self, token: u64) -> Call<'_, bool> {
        Box::pin(async move {
            let released = self.release_once(token, true).await?;
            self.withdrawn.store(true, Ordering::SeqCst);
            Ok(released)
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
            let counter: u64 = self
                .conn
                .run(
                    &self.scripts.advance,
                    &[&self.keys.counter],
                    &[floor.to_string()],
                )
                .await?;
            self.acquirer.saw(counter);
            Ok(counter)
        })
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        Box::pin(async move {
            let _: i64 = self
                .conn
                .run(
                    &self.scripts.heartbeat,
                    &[&self.keys.candidates],
                    &[self.me.instance.clone(), self.ttl_ms(), self.record.clone()],
                )
                .await?;
            Ok(())
        })
    }

    /// Also gives up a lease this replica holds without a term: one the
    /// line's attempt acquired that nobody took (the run ended first). An
    /// attempt behind the line that runs later finds the record gone and
    /// takes nothing.
    fn withdraw(&self) -> Call<'_, ()> {
        self.line.leave();
        if self.withdrawn.load(Ordering::SeqCst) {
            return Box::pin(async { Ok(()) });
        }
        Box::pin(async move {
            let k = &self.keys;
            let _: i64 = self
                .conn
                .run(
                    &self.scripts.withdraw,
                    &[&k.candidates, &k.lease, &k.line, &k.released],
                    &[self.me.instance.clone(), self.ttl_ms()],
                )
                .await?;
            Ok(())
        })
    }

    fn observe(&self) -> Call<'_, Observation> {
        Box::pin(async move {
            let k = &self.keys;
            let (value, pttl, counter, candidates): (String, i64, u64, Vec<String>) = self
                .conn
                .run(
                    &self.scripts.observe,
                    &[&k.lease, &k.counter, &k.candidates],
                    &[],
                )
                .await?;
            let holder = (!value.is_empty()).then(|| {
                let (token, owner) = parse_lease(&value).unwrap_or((0, value.clone()));
                Holder {
                    owner,
                    token,
                    expires_in: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                }
            });
            let mut candidates: Vec<Candidate> = candidates
                .iter()
                .filter_map(|c| parse_candidate(c))
                .collect();
            candidates.sort_by_key(|c| (c.since_ms, c.pid));
            Ok(Observation {
                holder,
                counter,
                candidates,
            })
        })
    }

    fn notice(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.line.wait())
    }

    fn leading(&self) {
        self.line.leave();
        self.acquirer.forget_kept();
    }

    fn acquired_since(&self) -> Option<std::time::Instant> {
        *self.handed_since.lock().unwrap()
    }

    fn wakes_on_release(&self) -> bool {
        self.line.waiting()
    }
}

/// A candidate value: "<expires> <seen> <leading> <since> <pid> <host> <owner>".
fn parse_candidate(value: &str) -> Option<Candidate> {
    let mut parts = value.splitn(7, ' ');
    let _expires = parts.next()?;
    let last_seen_ms = parts.next()?.parse().ok()?;
    let leading = parts.next()? == "1";
    let since_ms = parts.next()?.parse().ok()?;
    let pid = parts.next()?.parse().ok()?;
    let (host, shards) = split_record_host(parts.next()?);
    Some(Candidate {
        since_ms,
        pid,
        host,
        owner: parts.next()?.to_owned(),
        last_seen_ms,
        leading,
        shards,
    })
}

/// `(token, owner)` of a lease value `"<token> <instance>/<attempt> <owner>"`.
fn parse_lease(value: &str) -> Option<(u64, String)> {
    let mut parts = value.splitn(3, ' ');
    let token = parts.next()?.parse().ok()?;
    let _instance = parts.next()?;
    Some((token, parts.next()?.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_values_parse() {
        let candidate = parse_candidate("9 8 1 7 42 host-a owner:1").unwrap();
        assert_eq!(
            candidate,
            Candidate {
                owner: "owner:1".into(),
                host: "host-a".into(),
                shards: None,
                pid: 42,
                since_ms: 7,
                last_seen_ms: 8,
                leading: true
            }
        );
        assert_eq!(parse_candidate("9 8 1"), None);
    }

    #[test]
    fn lease_values_parse() {
        assert_eq!(parse_lease("7 00ff/3 host:1"), Some((7, "host:1".into())));
        assert_eq!(parse_lease(""), None);
        assert_eq!(parse_lease("x 00ff/1 host"), None);
    }

    #[test]
    fn keys_of_a_lease_share_one_hash_tag() {
        // The tag is the text between the first '{' and the next '}': the
        // same for every key of a lease, whatever the key contains.
        fn tag(key: &str) -> &str {
            let open = key.find('{').unwrap();
            let close = key[open + 1..].find('}').unwrap() + open + 1;
            &key[open + 1..close]
        }
        for key in ["plain", "a}b", "x{y", "}{"] {
            let prefix = format!("leaderrun:{{{key}}}");
            assert_eq!(
                tag(&format!("{prefix}:lease")),
                tag(&format!("{prefix}:released")),
                "{key}"
            );
        }
    }
}
