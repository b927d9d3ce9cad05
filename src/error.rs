//! The ways leaderrun ends, and the errors it reacts to at its edge.
//!
//! Every exit status is listed here once, so the table in the README (and
//! SPEC §7) has a single source in the code.

use std::process::ExitCode;

use crate::timing::TimingError;

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
    /// The backend answered with something no retry can fix.
    Fatal(u8),
}

impl Exit {
    pub const USAGE: u8 = 2;
    pub const FREE: u8 = 3;
    /// The backend's state cannot be used as it is (a corrupt record, an
    /// exhausted counter, a fence floor above the largest token).
    pub const DATA: u8 = 65;
    pub const UNREACHABLE: u8 = 69;
    pub const INTERNAL: u8 = 70;
    pub const HELD_ELSEWHERE: u8 = 75;
    pub const NOT_EXECUTABLE: u8 = 126;
    pub const NOT_FOUND: u8 = 127;

    pub fn code(self) -> u8 {
        match self {
            Exit::Child(code) | Exit::Fatal(code) => code,
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
    #[error("invalid --token-env {name:?}: {why}")]
    TokenEnv { name: String, why: &'static str },
    #[error("invalid --yield-signal {name:?}: {why}")]
    Signal { name: String, why: &'static str },
    #[error(transparent)]
    Timing(#[from] TimingError),
    #[error("invalid backend URL \"{url}\": {why}")]
    BackendUrl { url: String, why: String },
    #[error("invalid --metrics-addr {address:?}: {why}")]
    MetricsAddr { address: String, why: String },
    #[error("cannot listen on --metrics-addr {address}: {why}")]
    MetricsBind { address: String, why: String },
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
    #[error("--containment cgroup: {0}")]
    Containment(String),
    #[error("invalid --shards {value:?}: {why}")]
    Shards { value: String, why: &'static str },
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

    /// The error of a spawn that failed at `exec` (the file went away or
    /// lost its x bit after `resolve` looked).
    pub fn from_spawn(error: &std::io::Error, program: &str) -> CommandError {
        match error.kind() {
            std::io::ErrorKind::NotFound => CommandError::NotFound(program.to_owned()),
            _ => CommandError::NotExecutable(program.to_owned()),
        }
    }
}
