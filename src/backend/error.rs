//! Why a backend call gave no answer, typed by what the caller can do about
//! it: `Unreachable` passes (retry with backoff), `Fatal` does not (stop
//! with a clear message and an exit code, never retry forever).

use std::io;
use std::time::Duration;

use super::Holder;
use crate::error::Exit;
use crate::timing::show;

/// A call that did not produce an answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Unreachable(#[from] Unreachable),
    #[error(transparent)]
    Fatal(#[from] Fatal),
}

/// The backend could not be asked. Never means "someone else holds it", and
/// never ends a term before its deadline.
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    #[error("backend call timed out after {}", show(*.0))]
    Timeout(Duration),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A server that answered with an error that may pass (loading,
    /// a dropped connection, a script error after a restart).
    #[error("{0}")]
    Server(String),
}

/// The backend answered, and what it said cannot change by retrying: an
/// operator has to act. Each maps to an exit status.
#[derive(Debug, thiserror::Error)]
pub enum Fatal {
    /// The configuration is refused: credentials, a missing permission, a
    /// database that does not exist, a server that speaks another protocol.
    #[error("{0}")]
    Refused(String),
    /// The stored lease cannot be read or belongs to something else.
    #[error("lease state is corrupt: {0}")]
    Corrupt(String),
    /// The counter reached the largest token the backend can issue.
    #[error(
        "the token counter is exhausted: it is at {counter} and the largest token this backend issues is {max}; move the key (a new --key) and its fenced store's records together"
    )]
    CounterExhausted { counter: u64, max: u64 },
    /// A fence floor the backend cannot represent.
    #[error(
        "fence floor {floor} is above the largest token this backend issues ({max}); check what --fence-floor-cmd prints"
    )]
    FloorOutOfRange { floor: u64, max: u64 },
    /// A bug: a panicked task, a broken invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Fatal {
    /// The exit status leaderrun ends with (SPEC §7, README "Exit status").
    pub fn exit_code(&self) -> u8 {
        match self {
            Fatal::Refused(_) => Exit::USAGE,
            Fatal::Corrupt(_) | Fatal::CounterExhausted { .. } | Fatal::FloorOutOfRange { .. } => {
                Exit::DATA
            }
            Fatal::Internal(_) => Exit::INTERNAL,
        }
    }
}

/// A renewal that did not go through.
#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    /// The backend answered that this replica no longer holds the lease.
    #[error("lease lost{}", .0.as_ref().map(|h| format!(" to {} (token {})", h.owner, h.token)).unwrap_or_default())]
    Lost(Option<Holder>),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<Unreachable> for RenewError {
    fn from(error: Unreachable) -> Self {
        RenewError::Store(error.into())
    }
}

impl From<Fatal> for RenewError {
    fn from(error: Fatal) -> Self {
        RenewError::Store(error.into())
    }
}

/// A timeout of the `Bounded` layer, in whichever error type a call has.
pub trait TimedOut {
    fn timed_out(after: Duration) -> Self;
}

impl TimedOut for StoreError {
    fn timed_out(after: Duration) -> Self {
        Unreachable::Timeout(after).into()
    }
}

impl TimedOut for RenewError {
    fn timed_out(after: Duration) -> Self {
        Unreachable::Timeout(after).into()
    }
}
