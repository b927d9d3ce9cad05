//! Lease stores: the one interface every backend implements, the values it
//! speaks in, and the registry that picks a backend by URL scheme.
//!
//! A backend lives in a folder of its own (`file/`, `redis/`) and owns its
//! URL grammar, its options and its capabilities; `registry.rs` is the one
//! place that knows which schemes exist. The supervisor, the spec and
//! `status` only ever see `dyn Backend` and `dyn LeaseStore`.
//!
//! Every backend passes one contract suite (`tests/contract.rs`): tokens
//! strictly grow, an attempt is idempotent, "held" and "could not ask" are
//! told apart, a renewal after loss is `Lost`, a release wakes one waiting
//! follower, and so on. A backend that passes it works with the supervisor.

mod bounded;
mod counted;
mod error;
pub mod etcd;
pub mod file;
pub mod memory;
pub mod postgres;
pub mod redis;
mod registry;
mod tls;
pub mod url;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

pub use bounded::Bounded;
pub use counted::Counted;
pub use error::{Fatal, RenewError, StoreError, Unreachable};
pub use registry::{BackendOptions, parse, schemes};

use crate::error::ConfigError;

/// A backend call: a future that is `Send`, so a store may be shared by
/// tasks, and that yields the answer or why there is none.
pub type Call<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// A backend named by a URL, parsed and validated but not yet contacted.
pub trait Backend: Send + Sync + fmt::Display {
    /// What this backend can do for fencing (SPEC §5).
    fn capabilities(&self) -> Capabilities;

    /// The lease of one key, for a replica that campaigns and leads.
    /// Creates what the backend needs (a state directory, a client).
    fn lease(&self, lease: LeaseConfig) -> Result<Arc<dyn LeaseStore>, ConfigError>;

    /// A read-only view of one key for `leaderrun status`: creates nothing.
    /// By default, a store that never campaigns.
    fn observer(
        &self,
        key: &str,
        call_timeout: Duration,
    ) -> Result<Arc<dyn LeaseStore>, ConfigError> {
        self.lease(LeaseConfig::observer(key, call_timeout))
    }

    /// Variables of leaderrun's environment that hold a secret this backend
    /// used (`PGPASSWORD`): the command never inherits them.
    fn secret_env(&self) -> &'static [&'static str] {
        &[]
    }
}

impl fmt::Debug for dyn Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// What a lease store needs to know about the lease and about this replica.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub key: String,
    pub me: Identity,
    pub ttl: Duration,
    /// The bound on every call (`Bounded` enforces it; a backend also uses
    /// it for its own connection timeouts and lock waits).
    pub call_timeout: Duration,
    /// A release may hand the lease straight to this replica while it waits
    /// (on a backend that can): false where taking a lease needs more than
    /// the backend's say-so (a fence floor to apply first, a shard the
    /// replica may not want).
    pub hand_over: bool,
}

impl LeaseConfig {
    /// What `leaderrun status` reads `key` with: a read-only view that
    /// never campaigns, so its ttl does not matter.
    pub fn observer(key: &str, call_timeout: Duration) -> LeaseConfig {
        LeaseConfig {
            key: key.to_owned(),
            me: Identity::new("status"),
            ttl: Duration::from_secs(1),
            call_timeout,
            hand_over: false,
        }
    }
}

/// The lease of one key, as one replica sees it.
///
/// Every call that reaches the backend either answers or says why it could
/// not (`StoreError`): `Unreachable` is retried, `Fatal` never will work as
/// things are. No call kills, starts or waits for a process.
pub trait LeaseStore: Send + Sync {
    /// Asks the backend once, at startup, whether the configuration works:
    /// refused credentials or permissions are `Err(Fatal::Refused)`, naming
    /// what is missing; a backend that cannot be reached is `Ok(Some(why))`,
    /// a warning only (campaigning retries it).
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        Box::pin(async { Ok(None) })
    }

    /// One acquisition attempt. Idempotent within one `attempt`: repeating
    /// an attempt whose reply was lost returns the token it already drew.
    /// A new attempt never returns a token an earlier attempt was given, also
    /// when this replica still holds the lease from it (SPEC §5).
    fn acquire(&self, attempt: u64) -> Call<'_, Attempt>;

    /// Extends the lease of `token` by ttl from (no earlier than) now.
    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>>;

    /// Gives up the lease of `token` if this replica still holds it, and lets
    /// one waiting replica know. False if it was no longer held.
    fn release(&self, token: u64) -> Call<'_, bool>;

    /// Gives the lease up as `release` does, at the end of the run: only
    /// `withdraw` comes after, and a backend that can do both in one call
    /// does (its `withdraw` then has nothing left to do).
    fn release_last(&self, token: u64) -> Call<'_, bool> {
        self.release(token)
    }

    /// Moves the token counter up to at least `floor`; returns the counter.
    /// A floor above the backend's largest token is `Fatal::FloorOutOfRange`.
    fn advance_fence(&self, floor: u64) -> Call<'_, u64>;

    /// Refreshes this replica's candidate record as a follower, for an
    /// attempt that did not reach `acquire` (which refreshes it itself).
    fn heartbeat(&self) -> Call<'_, ()>;

    /// Removes this replica's candidate record: the shutdown notice of a
    /// graceful exit. Also prunes records that expired.
    fn withdraw(&self) -> Call<'_, ()>;

    /// The holder, the counter and the live candidates.
    fn observe(&self) -> Call<'_, Observation>;

    /// Resolves when the lease may have become free: a release handed to
    /// this replica, a holder's death, an operator's change. Cancel-safe;
    /// spurious wake-ups are allowed (the caller just attempts).
    fn notice(&self) -> BoxFuture<'_, ()>;

    /// Whether a release would wake this follower now (its place in a line,
    /// its watch, its notice connection is up). A follower that can rely on
    /// it attempts only when woken, at the holder's known expiry, and every
    /// half ttl (its heartbeat); one that cannot polls every campaign period.
    fn wakes_on_release(&self) -> bool {
        false
    }

    /// Whether a release wakes one follower only, the head of a line, which
    /// in shard mode passes on a wake it has no room for (see
    /// `campaign.rs`). The file backend's line does; where every follower
    /// hears of a release, a pass only takes the lease from under the one
    /// with room for a moment.
    fn release_wakes_one(&self) -> bool {
        false
    }

    /// Descriptors the store needs to act from another process (the guard,
    /// a fork of leaderrun's, which releases a running term's lease after
    /// leaderrun died). The file backend's lease file is one: its holder's
    /// lock lives as long as any descriptor of it.
    fn keep_fds(&self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }

    /// When the lease an attempt just acquired was last made to last a ttl
    /// on the server, if that was before the attempt began: a lease handed
    /// to this replica by the last holder hangs on its session, kept alive
    /// earlier. The term's deadline is counted from the earlier moment.
    fn acquired_since(&self) -> Option<Instant> {
        None
    }

    /// This replica leads and its term's first process has started: it gives
    /// its place among the waiting followers to the next one. Called again
    /// before every release (it is idempotent).
    fn leading(&self);
}

/// The outcome of an acquisition attempt that reached the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This replica now holds the lease with a fresh fencing token.
    Acquired { token: u64 },
    /// Someone else holds it: a normal follower state, not an error.
    Held(Holder),
    /// The lease may be free, but the backend must not hand it out yet: its
    /// data may be older than what a leader was told (a restart, a failover,
    /// a lease that vanished before its known expiry), and that leader may
    /// still be stopping its child.
    HeldOff {
        retry_in: Duration,
        why: &'static str,
    },
}

/// The current holder of a lease, as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub owner: String,
    pub token: u64,
    /// Time left before the lease lapses, when the backend knows it.
    pub expires_in: Option<Duration>,
}

/// What `observe` sees: the holder if any, the token counter, and every
/// running replica of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub holder: Option<Holder>,
    pub counter: u64,
    pub candidates: Vec<Candidate>,
}

/// A running leaderrun for a key, from the heartbeat record it refreshes on
/// every attempt (following) and renewal (leading). A graceful exit removes
/// it; a replica that dies stops refreshing it and it expires after ttl.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub owner: String,
    pub host: String,
    pub pid: u32,
    /// Unix time (ms) the replica started.
    pub since_ms: u64,
    /// Unix time (ms) of its last heartbeat.
    pub last_seen_ms: u64,
    pub leading: bool,
    /// The shard count it runs with (`--shards`), or None for one lease.
    pub shards: Option<u32>,
}

/// Who this replica is, in lease and candidate records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub owner: String,
    /// Tells this process apart from an earlier one with the same owner.
    pub instance: String,
    pub host: String,
    pub pid: u32,
    pub since_ms: u64,
    /// The shard count it runs with (`--shards`), carried in its candidate
    /// records so replicas started with another count are told apart.
    pub shards: Option<u32>,
}

impl Identity {
    pub fn new(owner: &str) -> Identity {
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .filter(|h| !h.is_empty() && !h.contains(char::is_whitespace))
            .unwrap_or_else(|| "-".into());
        Identity {
            owner: owner.to_owned(),
            instance: random_instance(),
            host,
            pid: std::process::id(),
            since_ms: unix_ms(),
            shards: None,
        }
    }

    /// The host field of this replica's candidate records: the host name,
    /// and in shard mode the shard count after it (`box/shards=8`). Host
    /// names have no '/', so every backend stores the count in the host
    /// text it already keeps, and `split_record_host` reads it back.
    pub fn record_host(&self) -> String {
        match self.shards {
            Some(n) => format!("{}{SHARDS_MARK}{n}", self.host),
            None => self.host.clone(),
        }
    }
}

const SHARDS_MARK: &str = "/shards=";

/// The host name and the shard count of a candidate record's host field.
pub fn split_record_host(field: &str) -> (String, Option<u32>) {
    match field.split_once(SHARDS_MARK) {
        Some((host, n)) => (host.to_owned(), n.parse().ok()),
        None => (field.to_owned(), None),
    }
}

/// What a backend can do (SPEC §5, §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// It issues fencing tokens.
    pub tokens: bool,
    /// It can move its token counter up (`--fence-floor-cmd`).
    pub fence_advance: bool,
    /// Tokens survive a restart of the store itself (not only of replicas).
    pub durable_tokens: bool,
    /// Expiry is judged by one clock of the backend's, not by each replica's.
    pub server_clock: bool,
    /// The largest token it can issue; a fence floor above it is refused.
    pub max_token: u64,
}

impl Capabilities {
    /// `--require-fence-advance`: refuse, at startup, a backend that cannot
    /// issue tokens or move its counter up.
    pub fn require_fence_advance(self, backend: &dyn Backend) -> Result<(), ConfigError> {
        let missing = match (self.tokens, self.fence_advance) {
            (true, true) => return Ok(()),
            (false, _) => "cannot issue fencing tokens",
            (true, false) => "cannot move its token counter up",
        };
        Err(ConfigError::Capability(format!(
            "--require-fence-advance: backend {backend} {missing}; use a backend that can, or drop the flag"
        )))
    }
}

/// Milliseconds since the Unix epoch (wall clock: for display only).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A random id that tells this process apart from an earlier one with the
/// same owner name. `RandomState` is seeded from the operating system's
/// randomness; pid and time are mixed in for good measure.
fn random_instance() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("{:016x}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn require_fence_advance_refuses_a_backend_without_tokens_or_advance() {
        let backend = parse(Some("file:///x"), &BackendOptions::default()).unwrap();
        let full = backend.capabilities();
        assert!(full.require_fence_advance(&*backend).is_ok());
        let no_tokens = Capabilities {
            tokens: false,
            fence_advance: false,
            ..full
        };
        let message = no_tokens
            .require_fence_advance(&*backend)
            .unwrap_err()
            .to_string();
        assert!(message.contains("cannot issue fencing tokens"), "{message}");
        let no_advance = Capabilities {
            fence_advance: false,
            ..full
        };
        let message = no_advance
            .require_fence_advance(&*backend)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("cannot move its token counter up"),
            "{message}"
        );
    }
}
