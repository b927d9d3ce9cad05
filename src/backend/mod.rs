//! The lease backends behind one small interface: acquire, renew, release,
//! advance the fence counter, observe, and wait for a release notice.
//!
//! The supervisor never knows which backend it talks to. Every call is
//! bounded by the spec's call timeout here, in one place, so no caller can
//! forget it; a call that times out is "could not ask", never "lost".

pub mod file;

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
}

/// The current holder of a lease, as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub owner: String,
    pub token: u64,
    /// Time left before the lease lapses, when the backend knows it.
    pub expires_in: Option<Duration>,
}

/// What `observe` sees: the holder if any, and the token counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub holder: Option<Holder>,
    pub counter: u64,
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

/// One of the backends of SPEC §6.
#[derive(Clone)]
pub struct Backend {
    kind: Kind,
    call_timeout: Duration,
}

#[derive(Clone)]
enum Kind {
    File(file::FileBackend),
}

impl Backend {
    /// Opens the backend the spec names. Configuration problems (an unsafe
    /// state directory, a missing capability) are refused here, before any
    /// lease is taken.
    pub fn open(spec: &Spec) -> Result<Backend, ConfigError> {
        let kind = match &spec.backend {
            BackendUrl::File { dir } => Kind::File(file::FileBackend::open(
                dir,
                &spec.key,
                &spec.owner,
                spec.timing.ttl,
                spec.timing.call_timeout(),
            )?),
            BackendUrl::Redis(_) => {
                return Err(ConfigError::BackendUrl {
                    url: spec.backend.to_string(),
                    why: "the Redis backend is not built yet".into(),
                });
            }
        };
        let backend = Backend {
            kind,
            call_timeout: spec.timing.call_timeout(),
        };
        let caps = backend.capabilities();
        if spec.require_fence_advance && !(caps.tokens && caps.fence_advance) {
            return Err(ConfigError::Capability(format!(
                "--require-fence-advance: backend {} cannot issue fencing tokens and move its counter up",
                spec.backend
            )));
        }
        Ok(backend)
    }

    /// Opens a backend read-only for `leaderrun status`: nothing is created.
    pub fn observer(url: &BackendUrl, key: &str) -> Result<Backend, ConfigError> {
        let kind = match url {
            BackendUrl::File { dir } => Kind::File(file::FileBackend::observer(dir, key)?),
            BackendUrl::Redis(_) => {
                return Err(ConfigError::BackendUrl {
                    url: url.to_string(),
                    why: "the Redis backend is not built yet".into(),
                });
            }
        };
        Ok(Backend {
            kind,
            call_timeout: Duration::from_secs(2),
        })
    }

    pub fn capabilities(&self) -> Capabilities {
        match &self.kind {
            Kind::File(_) => Capabilities {
                tokens: true,
                fence_advance: true,
            },
        }
    }

    /// One acquisition attempt. Idempotent for this replica: repeating an
    /// attempt whose reply was lost returns the token it already drew.
    pub async fn acquire(&self) -> Result<Attempt, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.acquire().await,
            }
        })
        .await
    }

    /// Extends the lease of `token` by ttl from (no earlier than) now.
    pub async fn renew(&self, token: u64) -> Result<(), RenewError> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.renew(token).await,
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
            }
        })
        .await
    }

    /// Moves the token counter up to at least `floor`; returns the counter.
    #[allow(dead_code)] // The fence-floor hook arrives with the fencing work.
    pub async fn advance_fence(&self, floor: u64) -> Result<u64, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.advance_fence(floor).await,
            }
        })
        .await
    }

    pub async fn observe(&self) -> Result<Observation, Unreachable> {
        self.bounded(async {
            match &self.kind {
                Kind::File(file) => file.observe().await,
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
