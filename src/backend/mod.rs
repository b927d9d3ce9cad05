//! The lease backends behind one small interface: acquire, renew, release,
//! advance the fence counter, observe, and wait for a release notice.
//!
//! The supervisor never knows which backend it talks to. Every call is
//! bounded by the spec's call timeout here, in one place, so no caller can
//! forget it; a call that times out is "could not ask", never "lost".

pub mod file;
pub mod redis;

use std::path::PathBuf;
use std::time::Duration;

use crate::error::ConfigError;
use crate::spec::{BackendUrl, Spec};

/// The outcome of an acquisition attempt that reached the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This replica now holds the lease with a fresh fencing token.
    Acquired { token: u64 },
    /// Someone else holds it: a normal follower state, not an error.
    Held(Holder),
    /// The lease may be free, but the backend must not hand it out yet
    /// (a Redis that lost its data while a leader may still be stopping).
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
}

/// Who this replica is, in lease and candidate records.
#[derive(Debug, Clone)]
pub struct Identity {
    pub owner: String,
    /// Tells this process apart from an earlier one with the same owner.
    pub instance: String,
    pub host: String,
    pub pid: u32,
    pub since_ms: u64,
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
        }
    }

    /// An identity for `leaderrun status`, which writes nothing.
    fn observer() -> Identity {
        Identity::new("status")
    }
}

/// Milliseconds since the Unix epoch (wall clock: for display only).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The backend could not be asked. Never means "someone else holds it".
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    #[error("backend call timed out after {0:?}")]
    Timeout(Duration),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("lease state is corrupt: {0}")]
    Corrupt(String),
    #[error("redis: {0}")]
    Redis(String),
}

/// A renewal that did not go through.
#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    /// The backend answered that this replica no longer holds the lease.
    #[error("lease lost{}", .0.as_ref().map(|h| format!(" to {} (token {})", h.owner, h.token)).unwrap_or_default())]
    Lost(Option<Holder>),
    #[error(transparent)]
    Unreachable(#[from] Unreachable),
}

/// What a backend can do for fencing (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub tokens: bool,
    pub fence_advance: bool,
}

impl Capabilities {
    /// `--require-fence-advance`: refuse, at startup, a backend that cannot
    /// issue tokens or move its counter up.
    pub fn require_fence_advance(self, url: &BackendUrl) -> Result<(), ConfigError> {
        let missing = match (self.tokens, self.fence_advance) {
            (true, true) => return Ok(()),
            (false, _) => "cannot issue fencing tokens",
            (true, false) => "cannot move its token counter up",
        };
        Err(ConfigError::Capability(format!(
            "--require-fence-advance: backend {url} {missing}; use a backend that can, or drop the flag"
        )))
    }
}

/// One of the backends of SPEC §6.
#[derive(Clone)]
pub struct Backend {
    kind: Kind,
    call_timeout: Duration,
}

#[derive(Clone)]
enum Kind {
    File(file::FileBackend),
    Redis(redis::RedisBackend),
}

impl Backend {
    /// Opens the backend the spec names. Configuration problems (an unsafe
    /// state directory, a wrong Redis password, a missing capability) are
    /// refused here, before any lease is taken. A Redis server that cannot
    /// be reached is not a configuration problem: campaigning retries it.
    pub async fn open(spec: &Spec) -> Result<Backend, ConfigError> {
        let call_timeout = spec.timing.call_timeout();
        let me = Identity::new(&spec.owner);
        let kind = match &spec.backend {
            BackendUrl::File { dir } => Kind::File(file::FileBackend::open(
                dir,
                &spec.key,
                me,
                spec.timing.ttl,
                call_timeout,
            )?),
            BackendUrl::Redis(url) => {
                let redis = redis::RedisBackend::new(
                    url,
                    spec.tls_ca_file.as_ref(),
                    &spec.key,
                    me,
                    spec.timing.ttl,
                    call_timeout,
                )?;
                match redis.check().await {
                    Ok(()) => {}
                    Err(redis::CheckError::Auth(why)) => {
                        return Err(ConfigError::BackendAuth {
                            url: spec.backend.to_string(),
                            why,
                        });
                    }
                    Err(redis::CheckError::Unreachable(error)) => {
                        tracing::warn!(error = %error, "backend unreachable at startup; campaigning anyway");
                    }
                }
                Kind::Redis(redis)
            }
        };
        let backend = Backend { kind, call_timeout };
        if spec.require_fence_advance {
            backend
                .capabilities()
                .require_fence_advance(&spec.backend)?;
        }
        Ok(backend)
    }

    /// Opens a backend read-only for `leaderrun status`: nothing is created.
    pub fn observer(
        url: &BackendUrl,
        key: &str,
        tls_ca_file: Option<&PathBuf>,
    ) -> Result<Backend, ConfigError> {
        let call_timeout = Duration::from_secs(2);
        let kind = match url {
            BackendUrl::File { dir } => Kind::File(file::FileBackend::observer(dir, key)?),
            BackendUrl::Redis(url) => Kind::Redis(redis::RedisBackend::new(
                url,
                tls_ca_file,
                key,
                Identity::observer(),
                Duration::from_secs(1),
                call_timeout,
            )?),
        };
        Ok(Backend { kind, call_timeout })
    }

    pub fn capabilities(&self) -> Capabilities {
        // Both backends issue tokens from a counter that can be moved up.
        Capabilities {
            tokens: true,
            fence_advance: true,
        }
    }

    /// One acquisition attempt. Idempotent for this replica: repeating an
    /// attempt whose reply was lost returns the token it already drew.
    pub async fn acquire(&self) -> Result<Attempt, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.acquire().await,
                Kind::Redis(redis) => redis.acquire().await,
            }
        })
        .await
    }

    /// This replica leads and its term's first process has started: it
    /// gives its place in the followers' line to the next follower. Not at
    /// the acquisition, so that nothing the leaving sets off competes with
    /// that start. Called again before every release (it is idempotent),
    /// since the place must be given up before the release can wake anyone.
    pub fn leading(&self) {
        match &self.kind {
            Kind::File(file) => file.leave_line(),
            Kind::Redis(redis) => redis.leave_line(),
        }
    }

    /// Extends the lease of `token` by ttl from (no earlier than) now.
    pub async fn renew(&self, token: u64) -> Result<(), RenewError> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.renew(token).await,
                Kind::Redis(redis) => redis.renew(token).await,
            }
        })
        .await
    }

    /// Gives up the lease of `token` if this replica still holds it, and lets
    /// waiting replicas know. False if it was no longer held.
    pub async fn release(&self, token: u64) -> Result<bool, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.release(token).await,
                Kind::Redis(redis) => redis.release(token).await,
            }
        })
        .await
    }

    /// Moves the token counter up to at least `floor`; returns the counter.
    pub async fn advance_fence(&self, floor: u64) -> Result<u64, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.advance_fence(floor).await,
                Kind::Redis(redis) => redis.advance_fence(floor).await,
            }
        })
        .await
    }

    /// Refreshes this replica's candidate record as a follower, for an
    /// attempt that did not reach `acquire` (which refreshes it itself).
    pub async fn heartbeat(&self) -> Result<(), Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.heartbeat().await,
                Kind::Redis(redis) => redis.heartbeat().await,
            }
        })
        .await
    }

    /// Removes this replica's candidate record: the shutdown notice of a
    /// graceful exit.
    pub async fn withdraw(&self) -> Result<(), Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.withdraw().await,
                Kind::Redis(redis) => redis.withdraw().await,
            }
        })
        .await
    }

    pub async fn observe(&self) -> Result<Observation, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.observe().await,
                Kind::Redis(redis) => redis.observe().await,
            }
        })
        .await
    }

    /// Resolves when the lease may have become free: a release, a holder's
    /// death, or a change made by an operator. Cancel-safe; spurious wake-ups
    /// are allowed (the caller just attempts).
    pub async fn notice(&self) {
        match &self.kind {
            Kind::File(file) => file.notice().await,
            Kind::Redis(redis) => redis.notice().await,
        }
    }

    async fn bounded<T, E: From<Unreachable>>(
        &self,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        tokio::time::timeout(self.call_timeout, call)
            .await
            .unwrap_or(Err(Unreachable::Timeout(self.call_timeout).into()))
    }
}

/// A random id that tells this process apart from an earlier one with the
/// same owner name.
fn random_instance() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `len` bytes into the buffer we own.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        // Unreachable in practice; pid and time still tell processes apart.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        bytes = (u64::from(std::process::id()) ^ now.as_nanos() as u64).to_ne_bytes();
    }
    format!("{:016x}", u64::from_ne_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn require_fence_advance_refuses_a_backend_without_tokens_or_advance() {
        let url = BackendUrl::parse("file:/x").unwrap();
        let full = Capabilities {
            tokens: true,
            fence_advance: true,
        };
        assert!(full.require_fence_advance(&url).is_ok());
        let no_tokens = Capabilities {
            tokens: false,
            fence_advance: false,
        };
        let message = no_tokens
            .require_fence_advance(&url)
            .unwrap_err()
            .to_string();
        assert!(message.contains("cannot issue fencing tokens"), "{message}");
        let no_advance = Capabilities {
            tokens: true,
            fence_advance: false,
        };
        let message = no_advance
            .require_fence_advance(&url)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("cannot move its token counter up"),
            "{message}"
        );
    }
}
