//! The command line as clap sees it: raw values, each with its environment
//! variable (SPEC §2). `spec` turns these into one validated `Spec`.

use std::ffi::OsString;
use std::time::Duration;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};

use crate::process::ContainmentMode;

#[derive(Debug, Parser)]
#[command(
    name = "leaderrun",
    version,
    about = "Run a command on exactly one replica at a time, behind a renewed lease with fencing tokens.",
    override_usage = "leaderrun [OPTIONS] --key <KEY> -- <COMMAND> [ARGS]...\n       leaderrun status [OPTIONS] --key <KEY>",
    args_conflicts_with_subcommands = true,
    args_override_self = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub subcommand: Option<SubcommandArgs>,

    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub enum SubcommandArgs {
    /// Print the current holder of a lease, its token, the time left, the counter and the candidates.
    Status(StatusArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), e.g. `leaderrun man > leaderrun.1`.
    Man,
}

/// Options shared by every subcommand: which lease, where, and how to log.
#[derive(Debug, Args)]
pub struct LeaseArgs {
    /// Lease name: 1–200 bytes, no whitespace or control characters.
    #[arg(short, long, env = "LEADERRUN_KEY", required = true)]
    pub key: Option<String>,

    /// Where the lease lives: file:///abs/dir (one host), redis://[user[:password]@]host[:port][/db], rediss://… (TLS), redis+unix:///path
    /// [default: file://$XDG_STATE_HOME/leaderrun, else file://$HOME/.local/state/leaderrun; file:///var/lib/leaderrun for root]
    #[arg(
        short,
        long,
        env = "LEADERRUN_BACKEND",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub backend: Option<String>,

    /// PEM file of the CA that signed a rediss://, etcds:// or postgres:// server's certificate (for private CAs).
    #[arg(long, env = "LEADERRUN_TLS_CA_FILE", value_name = "PATH")]
    pub tls_ca_file: Option<std::path::PathBuf>,

    /// PEM file of a client certificate to show an etcds:// server (with --tls-key-file).
    #[arg(
        long,
        env = "LEADERRUN_TLS_CERT_FILE",
        value_name = "PATH",
        requires = "tls_key_file"
    )]
    pub tls_cert_file: Option<std::path::PathBuf>,

    /// PEM file of the client certificate's private key (with --tls-cert-file).
    #[arg(
        long,
        env = "LEADERRUN_TLS_KEY_FILE",
        value_name = "PATH",
        requires = "tls_cert_file"
    )]
    pub tls_key_file: Option<std::path::PathBuf>,

    /// The Redis sentinels' own password (redis+sentinel://); prefer the environment variable.
    #[arg(
        long,
        env = "LEADERRUN_SENTINEL_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub sentinel_password: Option<String>,

    #[command(flatten)]
    pub log: LogArgs,
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log line format on stderr.
    #[arg(long, env = "LEADERRUN_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// More log detail (-v debug, -vv trace). Without -v or -q, LEADERRUN_LOG takes an env-filter directive (e.g. debug, warn).
    #[arg(short, long, action = ArgAction::Count, conflicts_with = "quiet")]
    pub verbose: u8,

    /// Less log detail (-q warnings only, -qq errors only). Overrides LEADERRUN_LOG.
    #[arg(short, long, action = ArgAction::Count)]
    pub quiet: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub lease: LeaseArgs,

    /// This replica's name in logs and status [default: <hostname>:<pid>]
    #[arg(long, env = "LEADERRUN_OWNER")]
    pub owner: Option<String>,

    /// Lease time to live.
    #[arg(long, env = "LEADERRUN_TTL", value_name = "D", value_parser = duration, default_value = "6s")]
    pub ttl: Duration,

    /// Renewal period while leading.
    #[arg(long, env = "LEADERRUN_RENEW_EVERY", value_name = "D", value_parser = duration, default_value = "2s")]
    pub renew_every: Duration,

    /// Acquisition attempt period while following (release notices and known expiry wake sooner).
    #[arg(long, env = "LEADERRUN_CAMPAIGN_EVERY", value_name = "D", value_parser = duration, default_value = "500ms")]
    pub campaign_every: Duration,

    /// Gap kept between the child's death and the lease's earliest possible lapse.
    #[arg(long, env = "LEADERRUN_MARGIN", value_name = "D", value_parser = duration, default_value = "500ms")]
    pub margin: Duration,

    /// How long before the term deadline the child is told to stop.
    #[arg(long, env = "LEADERRUN_YIELD_GRACE", value_name = "D", value_parser = duration, default_value = "1s")]
    pub yield_grace: Duration,

    /// How long after the deadline the child may take before it is killed.
    #[arg(long, env = "LEADERRUN_RELEASE_TIMEOUT", value_name = "D", value_parser = duration, default_value = "500ms")]
    pub release_timeout: Duration,

    /// Variable that carries the fencing token to the child.
    #[arg(
        long,
        env = "LEADERRUN_TOKEN_ENV",
        value_name = "NAME",
        default_value = "LEADERRUN_TOKEN"
    )]
    pub token_env: String,

    /// Signal that tells the child its term is ending (TERM, SIGTERM and 15 are all accepted).
    #[arg(
        long,
        env = "LEADERRUN_YIELD_SIGNAL",
        value_name = "SIG",
        default_value = "TERM"
    )]
    pub yield_signal: String,

    /// Make one acquisition attempt; if it fails exit 75 (held elsewhere) or 69 (backend unreachable).
    #[arg(long, conflicts_with = "wait")]
    pub no_wait: bool,

    /// Give up campaigning after D (exit 75, or 69 if the backend never answered) [default: forever]
    #[arg(long, env = "LEADERRUN_WAIT", value_name = "D", value_parser = duration)]
    pub wait: Option<Duration>,

    /// Keep (and renew) the lease until at least D after acquisition, even if the command exits sooner.
    #[arg(long, env = "LEADERRUN_HOLD_FOR", value_name = "D", value_parser = duration_or_zero, default_value = "0s")]
    pub hold_for: Duration,

    /// Shell command run while the lease is free; its output is a floor for the next token.
    #[arg(long, env = "LEADERRUN_FENCE_FLOOR_CMD", value_name = "CMD")]
    pub fence_floor_cmd: Option<String>,

    /// Shell command run after acquiring and before the command; a non-zero exit refuses the term.
    #[arg(long, env = "LEADERRUN_CLAIM_CMD", value_name = "CMD")]
    pub claim_cmd: Option<String>,

    /// Shard mode: run shard i of N (0 ≤ i < N) while holding it, with the shards split fairly among the replicas; the same N on every replica (1–4096). Runs until stopped.
    #[arg(long, value_name = "N")]
    pub shards: Option<String>,

    /// Serve /metrics, /leader (200 while leading) and /healthz on this address.
    #[arg(long, env = "LEADERRUN_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,

    /// Refuse to start on a backend that cannot issue fencing tokens or move its counter up.
    #[arg(long, env = "LEADERRUN_REQUIRE_FENCE_ADVANCE")]
    pub require_fence_advance: bool,

    /// How each term's processes are held together so none outlives it: a cgroup (where a writable cgroup2 exists), a keeper process (a subreaper per term), or auto.
    #[arg(long, env = "LEADERRUN_CONTAINMENT", value_enum, default_value_t = ContainmentMode::Auto, value_name = "MODE")]
    pub containment: ContainmentMode,

    /// The command to run while leading, and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub lease: LeaseArgs,

    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A humantime duration (`6s`, `1500ms`, `1m 30s`).
fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{e} (use a duration such as 6s, 1500ms or 1m 30s)"))
}

/// Like `duration`, for the options whose default is zero.
fn duration_or_zero(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    duration(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_accept_humantime_forms() {
        assert_eq!(duration("6s").unwrap(), Duration::from_secs(6));
        assert_eq!(duration("1500ms").unwrap(), Duration::from_millis(1500));
        assert_eq!(duration("1m 30s").unwrap(), Duration::from_secs(90));
        assert!(duration("6").unwrap_err().contains("such as 6s"));
        assert_eq!(duration_or_zero("0").unwrap(), Duration::ZERO);
    }
}
