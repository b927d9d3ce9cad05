//! The Redis backend: one lease shared by replicas on any number of hosts.
//!
//! Every operation is one Lua script, atomic on the server. The keys of a
//! lease share a hash tag, so they live in one slot of a Redis Cluster:
//!
//! - `leaderrun:{KEY}:lease`: `"<token> <instance> <owner>"` with a PX expiry;
//! - `leaderrun:{KEY}:counter`: the token counter (no expiry);
//! - `leaderrun:{KEY}:line`: the followers' line: a release leaves one wake
//!   (the token) there, and the follower that has waited longest in `BLPOP`
//!   takes it. A wake nobody takes lapses after a ttl.
//!
//! "Someone else holds it" and "could not ask" never mix: a script's answer
//! is an `Attempt` or a `RenewError::Lost`, anything else (refused
//! connection, timeout, authentication, script error) is `Unreachable`.
//!
//! Two things guard against a Redis that lost its data (a restart without
//! persistence, a failover to a replica that missed the last writes):
//!
//! - tokens only grow while any replica lives: each replica sends the highest
//!   token it has seen, and acquisition moves the counter past it first;
//! - a Redis that started less than one ttl ago, or whose run id changed
//!   under a replica's eyes, is not acquired from until one ttl has passed,
//!   because a leader from before the loss may still be stopping its child.
//!   That leader's next renewal finds the lease gone and its term is lost.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, Script,
};
use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;

use super::{Attempt, Candidate, Holder, Identity, Observation, RenewError, Unreachable};
use crate::error::ConfigError;
use crate::spec::{RedisAddress, RedisUrl};

/// Tokens are Lua numbers on the server: integers are exact below 2^53.
pub const MAX_TOKEN: u64 = (1 << 53) - 1;
/// How long a follower's `BLPOP` blocks before it asks again: a socket that
/// died without a reset is noticed within this (plus a call timeout).
const BLOCK_SECS: u64 = 5;

/// Shared by the scripts that refresh the caller's candidate record in the
/// hash `leaderrun:{KEY}:candidates` (field: instance; value: "<expires ms>
/// <seen ms> <leading 0|1> <since ms> <pid> <host> <owner>", server time).
const BEAT: &str = r#"
local function beat(candidates, instance, ttl_ms, leading, record)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', candidates, instance,
    string.format('%d %d %d %s', now + tonumber(ttl_ms), now, leading, record))
end
"#;

const ACQUIRE: &str = r#"
-- KEYS: lease, counter, candidates. ARGV: instance, owner, ttl_ms, highest
-- token seen, run id the caller knows ("" if none), ttl in whole seconds,
-- candidate record.
local current = redis.call('GET', KEYS[1])
if current then
  local token, instance, owner = string.match(current, '^(%d+) (%S+) (.*)$')
  if instance == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    beat(KEYS[3], ARGV[1], ARGV[3], 1, ARGV[7])
    return {1, tonumber(token), '', tonumber(ARGV[3])}
  end
  beat(KEYS[3], ARGV[1], ARGV[3], 0, ARGV[7])
  return {0, tonumber(token), owner, redis.call('PTTL', KEYS[1])}
end
beat(KEYS[3], ARGV[1], ARGV[3], 0, ARGV[7])
-- Free: only now does the server's history matter.
local info = redis.call('INFO', 'server')
local run_id = string.match(info, 'run_id:(%w+)')
if ARGV[5] ~= '' and ARGV[5] ~= run_id then
  return {3, 0, run_id, 0}
end
local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
if uptime < tonumber(ARGV[6]) then
  return {2, 0, run_id, (tonumber(ARGV[6]) - uptime) * 1000}
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if counter < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[2], ARGV[4])
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
beat(KEYS[3], ARGV[1], ARGV[3], 1, ARGV[7])
return {1, token, run_id, tonumber(ARGV[3])}
"#;

const RENEW: &str = r#"
-- KEYS: lease, candidates. ARGV: instance, token, ttl_ms, candidate record.
local current = redis.call('GET', KEYS[1])
if not current then
  beat(KEYS[2], ARGV[1], ARGV[3], 0, ARGV[4])
  return {0, 0, ''}
end
local token, instance, owner = string.match(current, '^(%d+) (%S+) (.*)$')
if instance == ARGV[1] and token == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  beat(KEYS[2], ARGV[1], ARGV[3], 1, ARGV[4])
  return {1, 0, ''}
end
beat(KEYS[2], ARGV[1], ARGV[3], 0, ARGV[4])
return {0, tonumber(token), owner}
"#;

const RELEASE: &str = r#"
-- KEYS: lease, candidates, line. ARGV: instance, token, ttl_ms, record.
beat(KEYS[2], ARGV[1], ARGV[3], 0, ARGV[4])
local current = redis.call('GET', KEYS[1])
if current then
  local token, instance = string.match(current, '^(%d+) (%S+)')
  if instance == ARGV[1] and token == ARGV[2] then
    redis.call('DEL', KEYS[1])
    -- One wake, for the follower first in line; never more than one.
    redis.call('DEL', KEYS[3])
    redis.call('RPUSH', KEYS[3], token)
    redis.call('PEXPIRE', KEYS[3], ARGV[3])
    return 1
  end
end
return 0
"#;

const HEARTBEAT: &str = r#"
-- KEYS: candidates. ARGV: instance, ttl_ms, record.
beat(KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3])
return 1
"#;

const ADVANCE: &str = r#"
-- KEYS: counter. ARGV: floor.
local counter = tonumber(redis.call('GET', KEYS[1]) or '0')
if counter < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return counter
"#;

/// Lists the live candidates and drops the expired ones.
const LIVE: &str = r#"
local function live(candidates)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local all = redis.call('HGETALL', candidates)
  local found = {}
  for i = 1, #all, 2 do
    local expires = tonumber(string.match(all[i + 1], '^(%d+)'))
    if expires and expires > now then
      table.insert(found, all[i + 1])
    else
      redis.call('HDEL', candidates, all[i])
    end
  end
  return found
end
"#;

const OBSERVE: &str = r#"
-- KEYS: lease, counter, candidates.
local current = redis.call('GET', KEYS[1]) or ''
return {current, redis.call('PTTL', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0'), live(KEYS[3])}
"#;

const WITHDRAW: &str = r#"
-- KEYS: candidates. ARGV: instance.
redis.call('HDEL', KEYS[1], ARGV[1])
live(KEYS[1])
return 1
"#;

#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    config: AsyncConnectionConfig,
    lease_key: String,
    counter_key: String,
    candidates_key: String,
    line_key: String,
    id: Identity,
    /// "<since ms> <pid> <host> <owner>": this replica's candidate record.
    record: String,
    ttl: Duration,
    call_timeout: Duration,
    /// The command connection, reopened after an I/O error or a timeout.
    commands: Mutex<Option<MultiplexedConnection>>,
    /// The follower's place in line: a task that waits in `BLPOP` on a
    /// connection of its own while this replica follows. Never cancelled by
    /// a wait that ends (a wake it took would be lost); aborted when this
    /// replica leads, which closes its connection and so its place.
    line: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Signalled by the line task: a wake was taken, or the place is new
    /// (a release may have come while there was none).
    woken: Notify,
    /// The highest token this replica has seen, its own or a holder's.
    highest_seen: AtomicU64,
    /// The server's run id as last seen, and until when acquisition is held
    /// off after it changed.
    server: std::sync::Mutex<ServerView>,
    scripts: Scripts,
}

#[derive(Default)]
struct ServerView {
    run_id: String,
    held_off_until: Option<Instant>,
}

struct Scripts {
    acquire: Script,
    renew: Script,
    release: Script,
    heartbeat: Script,
    advance: Script,
    observe: Script,
    withdraw: Script,
}

impl RedisBackend {
    /// Builds the client (no connection yet: see `check`).
    pub fn new(
        url: &RedisUrl,
        tls_ca_file: Option<&PathBuf>,
        key: &str,
        id: Identity,
        ttl: Duration,
        call_timeout: Duration,
    ) -> Result<RedisBackend, ConfigError> {
        let client = client(url, tls_ca_file)?;
        let prefix = format!("leaderrun:{{{key}}}");
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                client,
                config: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(call_timeout))
                    .set_response_timeout(Some(call_timeout)),
                lease_key: format!("{prefix}:lease"),
                counter_key: format!("{prefix}:counter"),
                candidates_key: format!("{prefix}:candidates"),
                line_key: format!("{prefix}:line"),
                record: format!("{} {} {} {}", id.since_ms, id.pid, id.host, id.owner),
                id,
                ttl,
                call_timeout,
                commands: Mutex::new(None),
                line: std::sync::Mutex::new(None),
                woken: Notify::new(),
                highest_seen: AtomicU64::new(0),
                server: std::sync::Mutex::new(ServerView::default()),
                scripts: Scripts {
                    acquire: Script::new(&[BEAT, ACQUIRE].concat()),
                    renew: Script::new(&[BEAT, RENEW].concat()),
                    release: Script::new(&[BEAT, RELEASE].concat()),
                    heartbeat: Script::new(&[BEAT, HEARTBEAT].concat()),
                    advance: Script::new(ADVANCE),
                    observe: Script::new(&[LIVE, OBSERVE].concat()),
                    withdraw: Script::new(&[LIVE, WITHDRAW].concat()),
                },
            }),
        })
    }

    /// Connects once at startup. A wrong password or user is a configuration
    /// error; a server that cannot be reached is only a warning (the
    /// supervisor keeps campaigning).
    pub async fn check(&self) -> Result<(), CheckError> {
        match tokio::time::timeout(self.inner.call_timeout, self.connection()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(Failure::Auth(why))) => Err(CheckError::Auth(why)),
            Ok(Err(Failure::Other(e))) => Err(CheckError::Unreachable(e)),
            Err(_) => Err(CheckError::Unreachable(Unreachable::Timeout(
                self.inner.call_timeout,
            ))),
        }
    }

    pub async fn acquire(&self) -> Result<Attempt, Unreachable> {
        let inner = &self.inner;
        let (known_run_id, held_off) = {
            let server = inner.server.lock().unwrap();
            (server.run_id.clone(), server.held_off_until)
        };
        if let Some(until) = held_off {
            let now = Instant::now();
            if now < until {
                return Ok(Attempt::HeldOff {
                    retry_in: until - now,
                    why: "the Redis server changed (new run id); waiting one ttl for a stale leader to stop",
                });
            }
        }
        let ttl_ms = inner.ttl.as_millis() as u64;
        let ttl_secs = inner.ttl.as_secs() + u64::from(inner.ttl.subsec_nanos() > 0);
        let (code, token, text, ms): (i64, u64, String, i64) = self
            .run(
                &inner.scripts.acquire,
                &[&inner.lease_key, &inner.counter_key, &inner.candidates_key],
                &[
                    inner.id.instance.clone(),
                    inner.id.owner.clone(),
                    ttl_ms.to_string(),
                    inner.highest_seen.load(Ordering::SeqCst).to_string(),
                    known_run_id.to_string(),
                    ttl_secs.to_string(),
                    inner.record.clone(),
                ],
            )
            .await?;
        let remaining = Duration::from_millis(ms.max(0) as u64);
        match code {
            1 => {
                self.saw(token);
                if !text.is_empty() {
                    self.inner.server.lock().unwrap().run_id = text;
                }
                Ok(Attempt::Acquired { token })
            }
            0 => {
                self.saw(token);
                Ok(Attempt::Held(Holder {
                    owner: text,
                    token,
                    // PTTL is -1 for a key without expiry (an operator's SET).
                    expires_in: (ms >= 0).then_some(remaining),
                }))
            }
            2 => {
                self.inner.server.lock().unwrap().run_id = text;
                Ok(Attempt::HeldOff {
                    retry_in: remaining,
                    why: "the Redis server started less than one ttl ago; waiting for a stale leader to stop",
                })
            }
            _ => {
                // The run id changed: the data may be older than what a
                // leader was told. Hold off one ttl from now.
                let mut server = self.inner.server.lock().unwrap();
                server.run_id = text;
                server.held_off_until = Some(Instant::now() + self.inner.ttl);
                Ok(Attempt::HeldOff {
                    retry_in: self.inner.ttl,
                    why: "the Redis server changed (new run id); waiting one ttl for a stale leader to stop",
                })
            }
        }
    }

    pub async fn renew(&self, token: u64) -> Result<(), RenewError> {
        let inner = &self.inner;
        let ttl_ms = inner.ttl.as_millis() as u64;
        let (code, holder_token, owner): (i64, u64, String) = self
            .run(
                &inner.scripts.renew,
                &[&inner.lease_key, &inner.candidates_key],
                &[
                    inner.id.instance.clone(),
                    token.to_string(),
                    ttl_ms.to_string(),
                    inner.record.clone(),
                ],
            )
            .await?;
        if code == 1 {
            return Ok(());
        }
        self.saw(holder_token);
        Err(RenewError::Lost((holder_token > 0).then_some(Holder {
            owner,
            token: holder_token,
            expires_in: None,
        })))
    }

    pub async fn release(&self, token: u64) -> Result<bool, Unreachable> {
        let inner = &self.inner;
        let ttl_ms = inner.ttl.as_millis() as u64;
        let released: i64 = self
            .run(
                &inner.scripts.release,
                &[&inner.lease_key, &inner.candidates_key, &inner.line_key],
                &[
                    inner.id.instance.clone(),
                    token.to_string(),
                    ttl_ms.to_string(),
                    inner.record.clone(),
                ],
            )
            .await?;
        Ok(released == 1)
    }

    pub async fn heartbeat(&self) -> Result<(), Unreachable> {
        let inner = &self.inner;
        let ttl_ms = inner.ttl.as_millis() as u64;
        let _: i64 = self
            .run(
                &inner.scripts.heartbeat,
                &[&inner.candidates_key],
                &[
                    inner.id.instance.clone(),
                    ttl_ms.to_string(),
                    inner.record.clone(),
                ],
            )
            .await?;
        Ok(())
    }

    pub async fn withdraw(&self) -> Result<(), Unreachable> {
        let inner = &self.inner;
        let _: i64 = self
            .run(
                &inner.scripts.withdraw,
                &[&inner.candidates_key],
                std::slice::from_ref(&inner.id.instance),
            )
            .await?;
        Ok(())
    }

    pub async fn advance_fence(&self, floor: u64) -> Result<u64, Unreachable> {
        if floor > MAX_TOKEN {
            return Err(Unreachable::Corrupt(format!(
                "fence floor {floor} is above the largest token Redis keeps exactly ({MAX_TOKEN})"
            )));
        }
        let inner = &self.inner;
        let counter: u64 = self
            .run(
                &inner.scripts.advance,
                &[&inner.counter_key],
                &[floor.to_string()],
            )
            .await?;
        self.saw(counter);
        Ok(counter)
    }

    pub async fn observe(&self) -> Result<Observation, Unreachable> {
        let inner = &self.inner;
        let (value, pttl, counter, candidates): (String, i64, u64, Vec<String>) = self
            .run(
                &inner.scripts.observe,
                &[&inner.lease_key, &inner.counter_key, &inner.candidates_key],
                &[],
            )
            .await?;
        let holder = parse_lease(&value).map(|(token, owner)| Holder {
            owner,
            token,
            expires_in: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
        });
        let mut candidates: Vec<Candidate> = candidates
            .iter()
            .filter_map(|c| parse_candidate(c))
            .collect();
        candidates.sort_by(|a, b| a.since_ms.cmp(&b.since_ms).then(a.pid.cmp(&b.pid)));
        Ok(Observation {
            holder,
            counter,
            candidates,
        })
    }

    /// Waits for a wake from the line: a release handed to this replica,
    /// or a new place in line. Joins the line on the first wait of a
    /// campaign.
    pub async fn notice(&self) {
        {
            let mut line = self.inner.line.lock().unwrap();
            if line.as_ref().is_none_or(|task| task.is_finished()) {
                *line = Some(tokio::spawn(queue(self.inner.clone())));
            }
        }
        self.inner.woken.notified().await;
    }

    /// Gives up this replica's place in line (it leads now): closing the
    /// connection takes its `BLPOP` off the server, so the wake of its own
    /// next release goes to a follower.
    pub fn leave_line(&self) {
        if let Some(task) = self.inner.line.lock().unwrap().take() {
            task.abort();
        }
    }

    /// Remembers a token seen on the server, so the counter is never let
    /// fall behind it.
    fn saw(&self, token: u64) {
        self.inner.highest_seen.fetch_max(token, Ordering::SeqCst);
    }

    async fn connection(&self) -> Result<MultiplexedConnection, Failure> {
        let mut slot = self.inner.commands.lock().await;
        if let Some(connection) = slot.as_ref() {
            return Ok(connection.clone());
        }
        let connection = self
            .inner
            .client
            .get_multiplexed_async_connection_with_config(&self.inner.config)
            .await
            .map_err(Failure::from)?;
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// Runs one script (EVALSHA, loaded again if the server forgot it);
    /// drops the connection after an error that leaves its state unknown, so
    /// the next call reconnects.
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[String],
    ) -> Result<T, Unreachable> {
        let mut connection = self.connection().await.map_err(Failure::into_unreachable)?;
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(arg);
        }
        match invocation.invoke_async(&mut connection).await {
            Ok(value) => Ok(value),
            Err(error) => {
                if error.is_io_error()
                    || error.is_timeout()
                    || error.is_connection_dropped()
                    || error.is_unrecoverable_error()
                {
                    *self.inner.commands.lock().await = None;
                }
                Err(Failure::from(error).into_unreachable())
            }
        }
    }
}

/// The line task: waits in `BLPOP` on its own connection, made again after
/// an error, and passes on every wake it takes. Failures back off (up to
/// 2 s), also when the connection is made but `BLPOP` is refused (an ACL
/// without it), so a broken line never spins.
async fn queue(inner: Arc<Inner>) {
    let config = inner
        .config
        .clone()
        .set_response_timeout(Some(Duration::from_secs(BLOCK_SECS) + inner.call_timeout));
    let mut failures: u64 = 0;
    loop {
        if failures > 0 {
            tokio::time::sleep(Duration::from_millis(100 * failures.min(20))).await;
        }
        failures += 1;
        let connect = inner
            .client
            .get_multiplexed_async_connection_with_config(&config);
        let Ok(Ok(mut connection)) = tokio::time::timeout(inner.call_timeout, connect).await else {
            continue;
        };
        // A new place in line: a release may have come while there was none.
        inner.woken.notify_one();
        loop {
            let popped: redis::RedisResult<Option<(String, String)>> = redis::cmd("BLPOP")
                .arg(&inner.line_key)
                .arg(BLOCK_SECS)
                .query_async(&mut connection)
                .await;
            match popped {
                Ok(Some(_)) => {
                    failures = 0;
                    inner.woken.notify_one();
                    // Let the attempt go out before this replica queues again.
                    tokio::task::yield_now().await;
                }
                // Timed out: the connection is alive; wait again.
                Ok(None) => failures = 0,
                Err(error) => {
                    tracing::debug!(error = %error, "the follower's line connection failed");
                    break;
                }
            }
        }
    }
}

/// What the startup check found.
pub enum CheckError {
    Auth(String),
    Unreachable(Unreachable),
}

enum Failure {
    Auth(String),
    Other(Unreachable),
}

impl From<redis::RedisError> for Failure {
    fn from(error: redis::RedisError) -> Self {
        // redis-rs errors name the server's reply or the OS error, never the
        // URL or its password.
        if error.kind() == redis::ErrorKind::AuthenticationFailed
            || error
                .code()
                .is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH" || c == "NOPERM")
        {
            return Failure::Auth(error.to_string());
        }
        Failure::Other(Unreachable::Redis(error.to_string()))
    }
}

impl Failure {
    fn into_unreachable(self) -> Unreachable {
        match self {
            Failure::Auth(why) => Unreachable::Redis(why),
            Failure::Other(e) => e,
        }
    }
}

/// A candidate value: "<expires> <seen> <leading> <since> <pid> <host> <owner>".
fn parse_candidate(value: &str) -> Option<Candidate> {
    let mut parts = value.splitn(7, ' ');
    let _expires = parts.next()?;
    let last_seen_ms = parts.next()?.parse().ok()?;
    let leading = parts.next()? == "1";
    Some(Candidate {
        since_ms: parts.next()?.parse().ok()?,
        pid: parts.next()?.parse().ok()?,
        host: parts.next()?.to_owned(),
        owner: parts.next()?.to_owned(),
        last_seen_ms,
        leading,
    })
}

/// `(token, owner)` of a lease value `"<token> <instance> <owner>"`.
fn parse_lease(value: &str) -> Option<(u64, String)> {
    let mut parts = value.splitn(3, ' ');
    let token = parts.next()?.parse().ok()?;
    let _instance = parts.next()?;
    Some((token, parts.next()?.to_owned()))
}

fn client(url: &RedisUrl, tls_ca_file: Option<&PathBuf>) -> Result<Client, ConfigError> {
    if matches!(url.address, RedisAddress::Tcp { tls: true, .. }) {
        // rustls needs a process-wide crypto provider; ring is the one built
        // in. An error only means one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let address = match &url.address {
        RedisAddress::Tcp {
            host,
            port,
            tls: false,
        } => ConnectionAddr::Tcp(host.clone(), *port),
        RedisAddress::Tcp {
            host,
            port,
            tls: true,
        } => ConnectionAddr::TcpTls {
            host: host.clone(),
            port: *port,
            insecure: false,
            tls_params: None,
        },
        RedisAddress::Unix { path } => ConnectionAddr::Unix(path.clone()),
    };
    let mut settings = RedisConnectionInfo::default().set_db(url.db);
    if let Some(user) = &url.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &url.password {
        settings = settings.set_password(password.expose());
    }
    let refused = |why: String| ConfigError::BackendUrl {
        url: url.to_string(),
        why,
    };
    let info = address
        .into_connection_info()
        .map_err(|e| refused(e.to_string()))?
        .set_redis_settings(settings);
    match (tls_ca_file, &url.address) {
        (Some(ca), RedisAddress::Tcp { tls: true, .. }) => {
            let pem = std::fs::read(ca)
                .map_err(|e| refused(format!("cannot read --tls-ca-file {}: {e}", ca.display())))?;
            Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
            .map_err(|e| refused(format!("--tls-ca-file {}: {e}", ca.display())))
        }
        (Some(_), _) => Err(refused("--tls-ca-file needs a rediss:// URL".into())),
        (None, _) => Client::open(info).map_err(|e| refused(e.to_string())),
    }
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
        assert_eq!(parse_lease("7 00ff host:1"), Some((7, "host:1".into())));
        assert_eq!(parse_lease(""), None);
        assert_eq!(parse_lease("x 00ff host"), None);
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
                tag(&format!("{prefix}:counter")),
                "{key}"
            );
        }
    }
}
