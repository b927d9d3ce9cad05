//! One validated configuration value, built from the command line before any
//! work starts. Nothing downstream re-validates: a `Spec` that exists is one
//! leaderrun can run.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::cli::RunArgs;
use crate::error::ConfigError;
use crate::timeline::Timing;

/// Everything a run of leaderrun needs, validated.
#[derive(Debug, Clone)]
pub struct Spec {
    pub key: String,
    pub backend: BackendUrl,
    pub tls_ca_file: Option<PathBuf>,
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
    pub command: Vec<OsString>,
}

/// How long to campaign before giving up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    Forever,
    /// One attempt (`--no-wait`).
    Once,
    For(Duration),
}

impl Spec {
    pub fn from_args(args: RunArgs) -> Result<Spec, ConfigError> {
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
        let owner = match args.owner {
            Some(owner) => parse_name(&owner).ok_or(ConfigError::Owner(owner))?,
            None => default_owner(),
        };
        let wait = match (args.no_wait, args.wait) {
            (true, _) => Wait::Once,
            (false, Some(d)) if d.is_zero() => {
                return Err(ConfigError::ZeroDuration {
                    flag: "--wait",
                    value: "0s".into(),
                });
            }
            (false, Some(d)) => Wait::For(d),
            (false, None) => Wait::Forever,
        };
        Ok(Spec {
            key,
            backend: BackendUrl::parse_or_default(args.lease.backend.as_deref())?,
            tls_ca_file: args.lease.tls_ca_file,
            owner,
            timing,
            token_env: parse_token_env(&args.token_env)?,
            yield_signal: parse_signal(&args.yield_signal)?,
            wait,
            hold_for: args.hold_for,
            fence_floor_cmd: args.fence_floor_cmd,
            claim_cmd: args.claim_cmd,
            require_fence_advance: args.require_fence_advance,
            metrics_addr: args.metrics_addr,
            command: args.command,
        })
    }
}

/// A key: 1–200 bytes, no whitespace or control characters.
pub fn parse_key(text: &str) -> Result<String, ConfigError> {
    parse_name(text).ok_or_else(|| ConfigError::Key(text.to_owned()))
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

/// The child's variables that the token variable must not overwrite.
const RESERVED_ENV: [&str; 3] = ["LEADERRUN_KEY", "LEADERRUN_OWNER", "LEADERRUN_BACKEND"];

fn parse_token_env(text: &str) -> Result<String, ConfigError> {
    let mut chars = text.chars();
    let valid = chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
        && !RESERVED_ENV.contains(&text);
    if valid {
        Ok(text.to_owned())
    } else {
        Err(ConfigError::TokenEnv(text.to_owned()))
    }
}

/// `TERM`, `SIGTERM`, `term` and `15` all name SIGTERM.
pub fn parse_signal(text: &str) -> Result<Signal, ConfigError> {
    let refused = || ConfigError::Signal(text.to_owned());
    if let Ok(number) = text.parse::<i32>() {
        return Signal::try_from(number).map_err(|_| refused());
    }
    let upper = text.to_ascii_uppercase();
    let name = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    Signal::from_str(&name).map_err(|_| refused())
}

/// Where the lease lives (SPEC §6).
#[derive(Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// The embedded backend: a private directory on this host.
    File { dir: PathBuf },
    /// A Redis server shared by replicas on any number of hosts.
    Redis(RedisUrl),
}

impl fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for BackendUrl {
    /// The URL with any password replaced, safe for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendUrl::File { dir } => write!(f, "file://{}", dir.display()),
            BackendUrl::Redis(redis) => write!(f, "{redis}"),
        }
    }
}

impl BackendUrl {
    pub fn parse_or_default(url: Option<&str>) -> Result<BackendUrl, ConfigError> {
        match url {
            Some(url) => BackendUrl::parse(url),
            None => Ok(BackendUrl::File {
                dir: default_state_dir()?,
            }),
        }
    }

    pub fn parse(url: &str) -> Result<BackendUrl, ConfigError> {
        let refused = |why: &str| ConfigError::BackendUrl {
            url: redact(url),
            why: why.to_owned(),
        };
        let Some((scheme, rest)) = url.split_once(':') else {
            return Err(refused(
                "expected file:DIR, file:///abs/dir, redis://host[:port][/db], rediss://… or redis+unix:///path",
            ));
        };
        match scheme {
            "file" => {
                let dir = match rest.strip_prefix("//") {
                    Some(path) if path.starts_with('/') => path,
                    Some("") => {
                        return Ok(BackendUrl::File {
                            dir: default_state_dir()?,
                        });
                    }
                    Some(_) => {
                        return Err(refused(
                            "a file:// URL needs an absolute path: file:///abs/dir, or file:DIR",
                        ));
                    }
                    None => rest,
                };
                if dir.is_empty() {
                    return Err(refused(
                        "no directory given: use file:DIR or file:///abs/dir",
                    ));
                }
                Ok(BackendUrl::File { dir: dir.into() })
            }
            "redis" | "rediss" | "redis+unix" => RedisUrl::parse(scheme, rest)
                .map(BackendUrl::Redis)
                .map_err(|why| refused(&why)),
            _ => Err(refused(
                "unknown scheme: use file:, redis://, rediss:// or redis+unix://",
            )),
        }
    }
}

/// `$XDG_STATE_HOME/leaderrun`, else `/var/lib/leaderrun` for root, else
/// `~/.local/state/leaderrun`.
fn default_state_dir() -> Result<PathBuf, ConfigError> {
    let absolute = |var: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    if let Some(state) = absolute("XDG_STATE_HOME") {
        return Ok(state.join("leaderrun"));
    }
    if nix::unistd::geteuid().is_root() {
        return Ok("/var/lib/leaderrun".into());
    }
    absolute("HOME")
        .map(|home| home.join(".local/state/leaderrun"))
        .ok_or(ConfigError::NoStateDir)
}

/// A password: never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// A parsed `redis://`, `rediss://` or `redis+unix://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    pub address: RedisAddress,
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub db: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisAddress {
    Tcp { host: String, port: u16, tls: bool },
    Unix { path: PathBuf },
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let auth = match (&self.username, &self.password) {
            (Some(user), Some(_)) => format!("{user}:***@"),
            (Some(user), None) => format!("{user}@"),
            (None, Some(_)) => ":***@".to_owned(),
            (None, None) => String::new(),
        };
        match &self.address {
            RedisAddress::Tcp { host, port, tls } => {
                let scheme = if *tls { "rediss" } else { "redis" };
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                write!(f, "{scheme}://{auth}{host}:{port}/{}", self.db)
            }
            RedisAddress::Unix { path } => {
                write!(f, "redis+unix://{auth}{}?db={}", path.display(), self.db)
            }
        }
    }
}

impl RedisUrl {
    fn parse(scheme: &str, rest: &str) -> Result<RedisUrl, String> {
        let rest = rest
            .strip_prefix("//")
            .ok_or_else(|| format!("expected {scheme}://…"))?;
        if scheme == "redis+unix" {
            return Self::parse_unix(rest);
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (username, password, hostport) = split_userinfo(authority)?;
        let (host, port) = split_host_port(&hostport)?;
        let db = match path {
            "" => 0,
            db => db
                .parse::<i64>()
                .ok()
                .filter(|db| *db >= 0)
                .ok_or_else(|| format!("database {db:?} is not a non-negative number"))?,
        };
        Ok(RedisUrl {
            address: RedisAddress::Tcp {
                host,
                port,
                tls: scheme == "rediss",
            },
            username,
            password,
            db,
        })
    }

    fn parse_unix(rest: &str) -> Result<RedisUrl, String> {
        let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (username, password, path) = split_userinfo(location)?;
        if !path.starts_with('/') {
            return Err(
                "a redis+unix URL needs an absolute socket path: redis+unix:///path/to/socket"
                    .into(),
            );
        }
        let mut db = 0;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("db", value)) => {
                    db = value
                        .parse::<i64>()
                        .ok()
                        .filter(|db| *db >= 0)
                        .ok_or_else(|| {
                            format!("database {value:?} is not a non-negative number")
                        })?;
                }
                _ => {
                    return Err(format!(
                        "unknown query parameter {pair:?}: only db=N is understood"
                    ));
                }
            }
        }
        Ok(RedisUrl {
            address: RedisAddress::Unix {
                path: percent_decode(&path)?.into(),
            },
            username,
            password,
            db,
        })
    }
}

type UserInfo = (Option<String>, Option<Secret>, String);

fn split_userinfo(authority: &str) -> Result<UserInfo, String> {
    let Some((userinfo, rest)) = authority.rsplit_once('@') else {
        return Ok((None, None, authority.to_owned()));
    };
    let (user, password) = match userinfo.split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (userinfo, None),
    };
    let user = Some(percent_decode(user)?).filter(|u| !u.is_empty());
    let password = password.map(percent_decode).transpose()?.map(Secret);
    Ok((user, password, rest.to_owned()))
}

fn split_host_port(hostport: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(bracketed) = hostport.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or("unclosed '[' in IPv6 host")?;
        (host, after.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err("no host given".into());
    }
    let port = match port {
        None => 6379,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("port {port:?} is not a number from 1 to 65535"))?,
    };
    Ok((host.to_owned(), port))
}

fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or("a '%' in the URL is not followed by two hex digits")?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "percent-encoding in the URL is not valid UTF-8".into())
}

/// The URL with anything between `://` and `@` that follows a `:` hidden, for
/// error messages about URLs that did not parse.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            format!("{scheme}://{user}{hidden}@{host}")
        }
        None => url.to_owned(),
    }
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
            assert_eq!(parse_signal(text).unwrap(), Signal::SIGTERM, "{text}");
        }
        assert_eq!(parse_signal("INT").unwrap(), Signal::SIGINT);
        assert_eq!(parse_signal("usr1").unwrap(), Signal::SIGUSR1);
        assert!(parse_signal("TERMINATE").is_err());
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("99").is_err());
    }

    #[test]
    fn token_env_must_be_a_plain_variable_name() {
        assert!(parse_token_env("LEADERRUN_TOKEN").is_ok());
        assert!(parse_token_env("_fence2").is_ok());
        assert!(parse_token_env("2FENCE").is_err());
        assert!(parse_token_env("MY-TOKEN").is_err());
        assert!(parse_token_env("").is_err());
        assert!(parse_token_env("LEADERRUN_BACKEND").is_err());
    }

    #[test]
    fn file_urls() {
        let dir = |url| match BackendUrl::parse(url).unwrap() {
            BackendUrl::File { dir } => dir,
            other => panic!("{other}"),
        };
        assert_eq!(dir("file:///var/lib/x"), PathBuf::from("/var/lib/x"));
        assert_eq!(dir("file:state"), PathBuf::from("state"));
        assert_eq!(dir("file:/abs"), PathBuf::from("/abs"));
        assert!(BackendUrl::parse("file://host/path").is_err());
        assert!(BackendUrl::parse("file:").is_err());
    }

    #[test]
    fn redis_urls() {
        let url = BackendUrl::parse("redis://app:s3cr%40t@cache.local:6380/2").unwrap();
        let BackendUrl::Redis(redis) = &url else {
            panic!()
        };
        assert_eq!(redis.username.as_deref(), Some("app"));
        assert_eq!(redis.password.as_ref().unwrap().expose(), "s3cr@t");
        assert_eq!(redis.db, 2);
        assert_eq!(
            redis.address,
            RedisAddress::Tcp {
                host: "cache.local".into(),
                port: 6380,
                tls: false
            }
        );
        assert_eq!(url.to_string(), "redis://app:***@cache.local:6380/2");
        assert!(!format!("{url:?}").contains("s3cr"));

        let BackendUrl::Redis(tls) = BackendUrl::parse("rediss://[::1]").unwrap() else {
            panic!()
        };
        assert_eq!(
            tls.address,
            RedisAddress::Tcp {
                host: "::1".into(),
                port: 6379,
                tls: true
            }
        );

        let BackendUrl::Redis(unix) =
            BackendUrl::parse("redis+unix:///run/redis.sock?db=3").unwrap()
        else {
            panic!()
        };
        assert_eq!(
            unix.address,
            RedisAddress::Unix {
                path: "/run/redis.sock".into()
            }
        );
        assert_eq!(unix.db, 3);
    }

    #[test]
    fn bad_urls_are_refused_without_showing_the_password() {
        for url in [
            "bogus://x",
            "redis://:hunter2@host:notaport",
            "redis://u:hunter2@host/x",
            "redis://",
            "redis+unix://relative.sock",
            "nothing",
        ] {
            let message = BackendUrl::parse(url).unwrap_err().to_string();
            assert!(!message.contains("hunter2"), "{message}");
            assert!(message.contains("invalid backend URL"), "{message}");
        }
    }
}
