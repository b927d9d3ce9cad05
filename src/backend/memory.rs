//! An in-memory backend, for tests of the core: the supervisor's term
//! machine on a paused clock, and the contract suite's reference.
//!
//! Never a stand-in for a real server in a test of a backend; it has no URL
//! scheme and cannot be chosen from the command line. Its clock is tokio's,
//! so it follows a paused test clock. A test can switch it off (calls fail
//! as "could not ask"), make it hang (calls never answer, so the caller's
//! timeout decides), or wipe it (a store that lost its data).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{
    Attempt, Backend, Bounded, Call, Candidate, Capabilities, Fatal, Holder, LeaseConfig,
    LeaseStore, Observation, RenewError, Unreachable, unix_ms,
};
use crate::error::ConfigError;

/// The largest token the in-memory backend issues.
pub const MAX_TOKEN: u64 = (1 << 63) - 1;

/// One in-memory "server", shared by every replica a test opens on it.
#[derive(Clone, Default)]
pub struct MemoryBackend {
    server: Arc<Server>,
}

#[derive(Default)]
struct Server {
    state: Mutex<State>,
    /// One per key: a release wakes one waiting follower.
    lines: Mutex<HashMap<String, Arc<Notify>>>,
}

#[derive(Default)]
struct State {
    keys: HashMap<String, Key>,
    mode: Mode,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Mode {
    #[default]
    Up,
    Down,
    Hanging,
}

#[derive(Default)]
struct Key {
    lease: Option<Lease>,
    counter: u64,
    candidates: HashMap<String, (Candidate, Instant)>,
}

struct Lease {
    token: u64,
    instance: String,
    attempt: u64,
    owner: String,
    expires: Instant,
}

impl MemoryBackend {
    pub fn new() -> MemoryBackend {
        MemoryBackend::default()
    }

    /// Calls fail as "could not ask" (`false`), or answer again (`true`).
    pub fn set_reachable(&self, reachable: bool) {
        self.server.state.lock().unwrap().mode = if reachable { Mode::Up } else { Mode::Down };
    }

    /// Calls never answer, so the caller's timeout decides.
    pub fn set_hanging(&self) {
        self.server.state.lock().unwrap().mode = Mode::Hanging;
    }

    /// Loses every lease, counter and candidate, as a store restarted
    /// without persistence would.
    pub fn wipe(&self) {
        self.server.state.lock().unwrap().keys.clear();
    }

    /// Takes the lease of `key` from whoever holds it, as another replica
    /// that ignored the rules would: the holder's next renewal is `Lost`.
    pub fn steal(&self, key: &str, owner: &str) -> u64 {
        let mut state = self.server.state.lock().unwrap();
        let entry = state.keys.entry(key.to_owned()).or_default();
        entry.counter += 1;
        entry.lease = Some(Lease {
            token: entry.counter,
            instance: "stolen".into(),
            attempt: 0,
            owner: owner.to_owned(),
            expires: Instant::now() + Duration::from_secs(3600),
        });
        entry.counter
    }

    fn line(&self, key: &str) -> Arc<Notify> {
        self.server
            .lines
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    fn store(&self, lease: LeaseConfig) -> MemoryStore {
        MemoryStore {
            line: self.line(&lease.key),
            server: self.server.clone(),
            lease,
        }
    }
}

impl fmt::Display for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "memory:{:p}", Arc::as_ptr(&self.server))
    }
}

impl Backend for MemoryBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            tokens: true,
            fence_advance: true,
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

/// One replica's view of one key.
pub struct MemoryStore {
    server: Arc<Server>,
    line: Arc<Notify>,
    lease: LeaseConfig,
}

impl MemoryStore {
    /// Runs `op` on this key's state, as the server would: not at all while
    /// it is down or hanging.
    async fn call<T>(
        &self,
        op: impl FnOnce(&mut Key, &LeaseConfig, Instant) -> T,
    ) -> Result<T, Unreachable> {
        let mode = self.server.state.lock().unwrap().mode;
        match mode {
            Mode::Up => {}
            Mode::Down => {
                return Err(Unreachable::Server(
                    "the memory backend is switched off".into(),
                ));
            }
            Mode::Hanging => std::future::pending().await,
        }
        let mut state = self.server.state.lock().unwrap();
        let key = state.keys.entry(self.lease.key.clone()).or_default();
        let now = Instant::now();
        if key.lease.as_ref().is_some_and(|l| l.expires <= now) {
            key.lease = None;
        }
        Ok(op(key, &self.lease, now))
    }

    fn beat(key: &mut Key, lease: &LeaseConfig, now: Instant, leading: bool) {
        let me = &lease.me;
        key.candidates.insert(
            me.instance.clone(),
            (
                Candidate {
                    owner: me.owner.clone(),
                    host: me.host.clone(),
                    pid: me.pid,
                    since_ms: me.since_ms,
                    last_seen_ms: unix_ms(),
                    leading,
                    shards: me.shards,
                },
                now + lease.ttl,
            ),
        );
    }
}

impl LeaseStore for MemoryStore {
    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        Box::pin(async move {
            let answer = self
                .call(|key, lease, now| {
                    let me = &lease.me;
                    match &key.lease {
                        Some(held) if held.instance == me.instance && held.attempt == attempt => {
                            // A repeat of an attempt whose reply was lost.
                            let token = held.token;
                            key.lease.as_mut().unwrap().expires = now + lease.ttl;
                            Self::beat(key, lease, now, true);
                            return Ok(Attempt::Acquired { token });
                        }
                        Some(held) if held.instance != me.instance => {
                            let holder = Holder {
                                owner: held.owner.clone(),
                                token: held.token,
                                expires_in: Some(held.expires - now),
                            };
                            Self::beat(key, lease, now, false);
                            return Ok(Attempt::Held(holder));
                        }
                        // Free, or held by an earlier attempt of ours, whose
                        // term is over: a new term draws a new token.
                        _ => {}
                    }
                    if key.counter >= MAX_TOKEN {
                        return Err(Fatal::CounterExhausted {
                            counter: key.counter,
                            max: MAX_TOKEN,
                        });
                    }
                    key.counter += 1;
                    key.lease = Some(Lease {
                        token: key.counter,
                        instance: me.instance.clone(),
                        attempt,
                        owner: me.owner.clone(),
                        expires: now + lease.ttl,
                    });
                    Self::beat(key, lease, now, true);
                    Ok(Attempt::Acquired { token: key.counter })
                })
                .await?;
            Ok(answer?)
        })
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        Box::pin(async move {
            let lost = self
                .call(|key, lease, now| {
                    let ours = key
                        .lease
                        .as_ref()
                        .is_some_and(|l| l.instance == lease.me.instance && l.token == token);
                    Self::beat(key, lease, now, ours);
                    if ours {
                        key.lease.as_mut().unwrap().expires = now + lease.ttl;
                        return None;
                    }
                    Some(key.lease.as_ref().map(|l| Holder {
                        owner: l.owner.clone(),
                        token: l.token,
                        expires_in: Some(l.expires - now),
                    }))
                })
                .await?;
            match lost {
                None => Ok(()),
                Some(holder) => Err(RenewError::Lost(holder)),
            }
        })
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        Box::pin(async move {
            let released = self
                .call(|key, lease, now| {
                    Self::beat(key, lease, now, false);
                    let ours = key
                        .lease
                        .as_ref()
                        .is_some_and(|l| l.instance == lease.me.instance && l.token == token);
                    if ours {
                        key.lease = None;
                    }
                    ours
                })
                .await?;
            if released {
                self.line.notify_one();
            }
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
            Ok(self
                .call(|key, _, _| {
                    key.counter = key.counter.max(floor);
                    key.counter
                })
                .await?)
        })
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        Box::pin(async move {
            Ok(self
                .call(|key, lease, now| Self::beat(key, lease, now, false))
                .await?)
        })
    }

    fn withdraw(&self) -> Call<'_, ()> {
        Box::pin(async move {
            Ok(self
                .call(|key, lease, now| {
                    key.candidates.remove(&lease.me.instance);
                    key.candidates.retain(|_, (_, expires)| *expires > now);
                })
                .await?)
        })
    }

    fn observe(&self) -> Call<'_, Observation> {
        Box::pin(async move {
            Ok(self
                .call(|key, _, now| {
                    let mut candidates: Vec<Candidate> = key
                        .candidates
                        .values()
                        .filter(|(_, expires)| *expires > now)
                        .map(|(candidate, _)| candidate.clone())
                        .collect();
                    candidates.sort_by_key(|c| (c.since_ms, c.pid));
                    Observation {
                        holder: key.lease.as_ref().map(|l| Holder {
                            owner: l.owner.clone(),
                            token: l.token,
                            expires_in: Some(l.expires - now),
                        }),
                        counter: key.counter,
                        candidates,
                    }
                })
                .await?)
        })
    }

    fn notice(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.line.notified())
    }

    fn leading(&self) {}

    fn wakes_on_release(&self) -> bool {
        true
    }
}
