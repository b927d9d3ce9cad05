//! One validated configuration value, built from the command line before any
//! work starts. Nothing downstream re-validates: a `Spec` that exists is one
//! leaderrun can run. The backend's URL is parsed here too, by the backend
//! the scheme names (`backend::parse`).

use std::ffi::OsString;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::backend::{self, Backend, BackendOptions};
use crate::cli::{LeaseArgs, RunArgs};
use crate::error::ConfigError;
use crate::process::{ContainmentMode, PARENT_ENV};
use crate::supervisor::Wait;
use crate::timing::{Timing, TimingError, bounded};

/// Everything a run of leaderrun needs, validated.
#[derive(Debug, Clone)]
pub struct Spec {
    pub key: String,
    pub backend: Arc<dyn Backend>,
    pub owner: String,
    pub timing: Timing,
    pub token_env: String,
    pub yield_signal: Signal,
    pub wait: Wait,
    pub hold_for: Duration,
    pub fence_floor_cmd: Option<String>,
    pub claim_cmd: Option<String>,
    pub require_fence_advance: bool,
    pub metrics_addr: Option<String>,
    pub containment: ContainmentMode,
    /// Shard mode (`--shards N`): the shard count.
    pub shards: Option<u32>,
    pub command: Vec<OsString>,
}

/// The largest shard count: 4096 leases per replica at most.
pub const MAX_SHARDS: u32 = 4096;

/// Where the key came from: a nested leaderrun must not take its parent's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    Flag,
    Environment,
}

impl Spec {
    pub fn from_args(args: RunArgs, key_source: KeySource) -> Result<Spec, ConfigError> {
        let timing = Timing {
            ttl: args.ttl,
            renew_every: args.renew_every,
            campaign_every: args.campaign_every,
            margin: args.margin,
            yield_grace: args.yield_grace,
            release_timeout: args.release_timeout,
        }
        .validate()?;
        let key = parse_key(args.lease.key.as_deref().unwrap_or_default())?;
        refuse_parents_key(&key, key_source)?;
        let owner = match args.owner {
            Some(owner) => parse_name(&owner).ok_or(ConfigError::Owner(owner))?,
            None => default_owner(),
        };
        let wait = match (args.no_wait, args.wait) {
            (true, _) => Wait::Once,
            (false, Some(d)) if d.is_zero() => {
                return Err(TimingError::Zero {
                    flag: "--wait",
                    value: "0s".into(),
                }
                .into());
            }
            (false, Some(d)) => Wait::For(bounded("--wait", d)?),
            (false, None) => Wait::Forever,
        };
        let shards = args
            .shards
            .as_deref()
            .map(|text| parse_shards(text, wait))
            .transpose()?;
        Ok(Spec {
            key,
            backend: parse_backend(&args.lease)?,
            owner,
            timing,
            token_env: parse_token_env(&args.token_env)?,
            yield_signal: parse_yield_signal(&args.yield_signal)?,
            wait,
            hold_for: bounded("--hold-for", args.hold_for)?,
            fence_floor_cmd: args.fence_floor_cmd,
            claim_cmd: args.claim_cmd,
            require_fence_advance: args.require_fence_advance,
            metrics_addr: args.metrics_addr,
            containment: args.containment,
            shards,
            command: args.command,
        })
    }
}

/// The backend the lease options name.
pub fn parse_backend(args: &LeaseArgs) -> Result<Arc<dyn Backend>, ConfigError> {
    let options = BackendOptions {
        tls_ca_file: args.tls_ca_file.clone(),
        tls_client: args.tls_cert_file.clone().zip(args.tls_key_file.clone()),
        sentinel_password: args.sentinel_password.clone(),
    };
    backend::parse(args.backend.as_deref(), &options)
}

/// `--shards N`: 1 to 4096. Shard mode runs until stopped (a replica
/// without a shard is a spare), so a wait to give up after means nothing.
fn parse_shards(text: &str, wait: Wait) -> Result<u32, ConfigError> {
    let refused = |why| ConfigError::Shards {
        value: text.to_owned(),
        why,
    };
    let n: u32 = text
        .trim()
        .parse()
        .map_err(|_| refused("expected a whole number of shards from 1 to 4096"))?;
    if !(1..=MAX_SHARDS).contains(&n) {
        return Err(refused("the shard count must be from 1 to 4096"));
    }
    if wait != Wait::Forever {
        return Err(refused(
            "shard mode runs until stopped (a replica without a shard is a spare), so --no-wait and --wait do not apply; drop them",
        ));
    }
    Ok(n)
}

/// A key: 1–200 bytes, no whitespace or control characters.
pub fn parse_key(text: &str) -> Result<String, ConfigError> {
    parse_name(text).ok_or_else(|| ConfigError::Key(text.to_owned()))
}

/// A leaderrun run by a leaderrun gets its parent's key in `LEADERRUN_KEY`
/// (the child's information, not a setting): taken as its own key, it
/// would wait forever for the lease its own parent holds.
fn refuse_parents_key(key: &str, source: KeySource) -> Result<(), ConfigError> {
    let Some(parent) = std::env::var_os(PARENT_ENV) else {
        return Ok(());
    };
    let parents_key = std::env::var_os("LEADERRUN_KEY");
    if parents_key.as_deref() != Some(key.as_ref()) {
        return Ok(());
    }
    let parent = parent.to_string_lossy();
    Err(ConfigError::Key(match source {
        KeySource::Environment => format!(
            "{key} (from LEADERRUN_KEY, which the leaderrun running this command, pid {parent}, sets to its own key for its child: not a setting; give this leaderrun its own --key)"
        ),
        KeySource::Flag => format!(
            "{key} (the key of the leaderrun running this command, pid {parent}: a nested leaderrun on it would wait for itself forever; use another key)"
        ),
    }))
}

fn parse_name(text: &str) -> Option<String> {
    let valid = !text.is_empty()
        && text.len() <= 200
        && !text.chars().any(|c| c.is_whitespace() || c.is_control());
    valid.then(|| text.to_owned())
}

fn default_owner() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| parse_name(h).is_some())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// Variables that change how programs run: a token there would break the
/// child, or worse.
const UNSAFE_ENV: [&str; 14] = [
    "PATH", "HOME", "SHELL", "IFS", "ENV", "BASH_ENV", "USER", "LOGNAME", "PWD", "TERM", "LANG",
    "TZ", "TMPDIR", "CDPATH",
];

fn parse_token_env(text: &str) -> Result<String, ConfigError> {
    let refused = |why| ConfigError::TokenEnv {
        name: text.to_owned(),
        why,
    };
    let mut chars = text.chars();
    let shaped = chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric());
    if !shaped {
        return Err(refused(
            "use a variable name of letters, digits and '_' that does not start with a digit",
        ));
    }
    if UNSAFE_ENV.contains(&text) || text.starts_with("LD_") || text.starts_with("LC_") {
        return Err(refused(
            "the child's programs read that variable themselves (the token would replace it); use a name of your own, such as FENCE",
        ));
    }
    if text.starts_with("LEADERRUN_") && text != "LEADERRUN_TOKEN" {
        return Err(refused(
            "names starting with LEADERRUN_ are leaderrun's own settings and variables; use a name of your own, such as FENCE",
        ));
    }
    Ok(text.to_owned())
}

/// The yield signal: `TERM`, `SIGTERM`, `term` and `15` all name SIGTERM.
/// Signals whose default action is to stop the child or to do nothing tell
/// it nothing, and are refused.
pub fn parse_yield_signal(text: &str) -> Result<Signal, ConfigError> {
    let refused = |why| ConfigError::Signal {
        name: text.to_owned(),
        why,
    };
    let signal = parse_signal(text)
        .ok_or_else(|| refused("give a signal name or number such as TERM, SIGINT or 15"))?;
    match signal {
        Signal::SIGSTOP | Signal::SIGTSTP | Signal::SIGTTIN | Signal::SIGTTOU => Err(refused(
            "it stops the child instead of telling it to finish; use TERM, INT, QUIT, HUP, USR1 or USR2",
        )),
        Signal::SIGCONT | Signal::SIGCHLD | Signal::SIGURG | Signal::SIGWINCH => Err(refused(
            "a child that does not handle it ignores it, so it would tell the child nothing; use TERM, INT, QUIT, HUP, USR1 or USR2",
        )),
        signal => Ok(signal),
    }
}

fn parse_signal(text: &str) -> Option<Signal> {
    if let Ok(number) = text.parse::<i32>() {
        return Signal::try_from(number).ok();
    }
    let upper = text.to_ascii_uppercase();
    let name = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    Signal::from_str(&name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bounded_and_free_of_whitespace() {
        assert!(parse_key("digest-publisher").is_ok());
        assert!(parse_key("a/../b").is_ok());
        assert!(parse_key("ключ").is_ok());
        assert!(parse_key(&"k".repeat(200)).is_ok());
        assert!(parse_key(&"k".repeat(201)).is_err());
        assert!(parse_key("").is_err());
        assert!(parse_key("two words").is_err());
        assert!(parse_key("tab\there").is_err());
        assert!(parse_key("bell\u{7}").is_err());
    }

    #[test]
    fn signals_by_name_prefix_and_number() {
        for text in ["TERM", "SIGTERM", "term", "15"] {
            assert_eq!(parse_yield_signal(text).unwrap(), Signal::SIGTERM, "{text}");
        }
        assert_eq!(parse_yield_signal("INT").unwrap(), Signal::SIGINT);
        assert_eq!(parse_yield_signal("usr1").unwrap(), Signal::SIGUSR1);
        assert!(parse_yield_signal("TERMINATE").is_err());
        assert!(parse_yield_signal("0").is_err());
        assert!(parse_yield_signal("99").is_err());
    }

    #[test]
    fn signals_that_tell_the_child_nothing_are_refused_with_a_reason() {
        for text in ["STOP", "TSTP", "CONT", "CHLD", "19", "WINCH"] {
            let message = parse_yield_signal(text).unwrap_err().to_string();
            assert!(message.contains("use TERM"), "{text}: {message}");
        }
    }

    #[test]
    fn token_env_must_be_a_plain_variable_name_of_the_users() {
        assert!(parse_token_env("LEADERRUN_TOKEN").is_ok());
        assert!(parse_token_env("_fence2").is_ok());
        assert!(parse_token_env("FENCE").is_ok());
        for bad in [
            "2FENCE",
            "MY-TOKEN",
            "",
            "LEADERRUN_BACKEND",
            "LEADERRUN_KEY",
            "PATH",
            "HOME",
            "LD_PRELOAD",
            "LC_ALL",
        ] {
            assert!(parse_token_env(bad).is_err(), "{bad}");
        }
    }
}
