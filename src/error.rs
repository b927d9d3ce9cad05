//! The errors leaderrun reacts to, and the exit status each one maps to.
//!
//! Every way the program can end is listed here once, so the table in the
//! README (and SPEC §7) has a single source in the code.

use std::process::ExitCode;

use crate::timeline::{Timing, show};

/// How a run of leaderrun ends. `main` turns this into the process status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The child ran; its exit code, or 128+N if it died of signal N.
    Child(u8),
    /// Stopped by a signal while not leading.
    Stopped,
    /// `leaderrun status`: the lease is free.
    Free,
    /// Gave up (`--no-wait` / `--wait`) without the backend ever answering.
    Unreachable,
    /// Gave up (`--no-wait` / `--wait`) because another replica holds the lease.
    HeldElsewhere,
}

impl Exit {
    pub const USAGE: u8 = 2;
    pub const FREE: u8 = 3;
    pub const UNREACHABLE: u8 = 69;
    pub const INTERNAL: u8 = 70;
    pub const HELD_ELSEWHERE: u8 = 75;
    pub const NOT_EXECUTABLE: u8 = 126;
    pub const NOT_FOUND: u8 = 127;

    pub fn code(self) -> u8 {
        match self {
            Exit::Child(code) => code,
            Exit::Stopped => 0,
            Exit::Free => Self::FREE,
            Exit::Unreachable => Self::UNREACHABLE,
            Exit::HeldElsewhere => Self::HELD_ELSEWHERE,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> Self {
        ExitCode::from(exit.code())
    }
}

/// Something wrong with what the operator asked for: exit 2, nothing started.
///
/// Each message names the offending value and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid key {0:?}: a key is 1–200 bytes with no whitespace or control characters")]
    Key(String),
    #[error(
        "invalid owner {0:?}: an owner is 1–200 bytes with no whitespace or control characters"
    )]
    Owner(String),
    #[error(
        "invalid --token-env {0:?}: use a variable name of letters, digits and '_' that does not start with a digit and is not LEADERRUN_KEY, LEADERRUN_OWNER or LEADERRUN_BACKEND"
    )]
    TokenEnv(String),
    #[error(
        "invalid --yield-signal {0:?}: give a signal name or number such as TERM, SIGINT or 15"
    )]
    Signal(String),
    #[error("{flag} must be greater than zero (got {value})")]
    ZeroDuration { flag: &'static str, value: String },
    #[error("{}", invariant_message(.0))]
    Invariant(Timing),
    #[error("invalid backend URL {url:?}: {why}")]
    BackendUrl { url: String, why: String },
    #[error("backend {url} refused the credentials: {why}; check the user and password in the URL")]
    BackendAuth { url: String, why: String },
    #[error("invalid --metrics-addr {address:?}: {why}")]
    MetricsAddr { address: String, why: String },
    #[error("unsafe state directory {path}: {why}")]
    UnsafeStateDir { path: String, why: String },
    #[error("cannot use state directory {path}: {source}")]
    StateDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no state directory: set --backend, XDG_STATE_HOME or HOME")]
    NoStateDir,
    #[error("invalid LEADERRUN_LOG directive {directive:?}: {why}")]
    LogDirective { directive: String, why: String },
    #[error("{0}")]
    Capability(String),
}

/// The command cannot be run: checked before campaigning, so no lease is taken.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("command not found: {0}")]
    NotFound(String),
    #[error("command not executable: {0}")]
    NotExecutable(String),
}

impl CommandError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CommandError::NotFound(_) => Exit::NOT_FOUND,
            CommandError::NotExecutable(_) => Exit::NOT_EXECUTABLE,
        }
    }
}

fn invariant_message(t: &Timing) -> String {
    let sum = show(t.renew_every + t.yield_grace + t.release_timeout + t.margin);
    format!(
        "timing invariant violated: renew_every ({}) + yield_grace ({}) + release_timeout ({}) + margin ({}) = {sum}, which must be less than ttl ({}); raise --ttl above {sum} or shorten the others",
        show(t.renew_every),
        show(t.yield_grace),
        show(t.release_timeout),
        show(t.margin),
        show(t.ttl),
    )
}
