//! The Redis URL grammar, on the `url` crate:
//!
//! ```text
//! redis://[user[:password]@]host[:port][/db]
//! rediss://[user[:password]@]host[:port][/db]        (TLS)
//! redis+unix:///path/to/socket[?db=N][&user=U][&password=P]
//! redis+sentinel://[user[:password]@]host[:port][,host[:port]…]/SERVICE[/db]
//! redis+cluster://[user[:password]@]host[:port][,host[:port]…]
//! ```
//!
//! (`rediss+sentinel://` and `rediss+cluster://` with TLS.) A URL naming
//! several hosts is cut at the commas: the `url` crate parses it with the
//! first host, and each host on its own. The user and password are the
//! Redis servers'; a sentinel's own password comes from
//! `--sentinel-password`. Every TCP form takes `?wait=N`: each acquisition
//! and renewal counts only once N replicas acknowledged it (`WAIT`).
//!
//! The password is a `Secret`: no `Display`, a `Debug` of `***`, and every
//! message shows the URL masked.

use std::fmt;
use std::path::PathBuf;

use url::Url;

pub use crate::backend::url::Secret;
use crate::backend::url::{HostList, credentials, masked, no_fragment, redact};
use crate::error::ConfigError;

/// A parsed Redis URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    pub address: Address,
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub db: i64,
    /// Replicas that must acknowledge an acquisition or a renewal (`?wait=`).
    pub wait_replicas: u32,
    /// The URL as given, with the password masked: for every message.
    shown: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Tcp {
        host: String,
        port: u16,
        tls: bool,
    },
    Unix {
        path: PathBuf,
    },
    /// The sentinels to ask for the primary of `service`.
    Sentinel {
        sentinels: Vec<(String, u16)>,
        service: String,
        tls: bool,
    },
    /// Seed nodes of a Redis Cluster.
    Cluster {
        nodes: Vec<(String, u16)>,
        tls: bool,
    },
}

impl Address {
    pub fn tls(&self) -> bool {
        match self {
            Address::Tcp { tls, .. }
            | Address::Sentinel { tls, .. }
            | Address::Cluster { tls, .. } => *tls,
            Address::Unix { .. } => false,
        }
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl RedisUrl {
    pub fn parse(raw: &str) -> Result<RedisUrl, ConfigError> {
        let scheme = raw.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        let many = matches!(
            scheme.as_deref(),
            Some("redis+sentinel" | "rediss+sentinel" | "redis+cluster" | "rediss+cluster")
        );
        if many {
            return Self::parse_many(raw);
        }
        Self::parse_one(raw)
    }

    fn parse_one(raw: &str) -> Result<RedisUrl, ConfigError> {
        let url = Url::parse(raw).map_err(|e| ConfigError::BackendUrl {
            url: redact(raw),
            why: format!(
                "{e}; a redis URL is redis://[user[:password]@]host[:port][/db], with '/', '@' and ':' in a user or password percent-encoded (%2F, %40, %3A)"
            ),
        })?;
        let shown = masked(&url);
        let refused = |why: String| ConfigError::BackendUrl {
            url: shown.clone(),
            why,
        };
        no_fragment(&url).map_err(&refused)?;
        let (mut username, mut password) = credentials(&url).map_err(&refused)?;
        let mut db = 0;
        let mut wait_replicas = 0;
        let address = if url.scheme() == "redis+unix" {
            if url.path().is_empty() || !url.path().starts_with('/') || url.host().is_some() {
                return Err(refused(
                    "a redis+unix URL names an absolute socket path: redis+unix:///path/to/socket"
                        .into(),
                ));
            }
            for (name, value) in url.query_pairs() {
                match &*name {
                    "db" => db = parse_db(&value).map_err(&refused)?,
                    "user" => username = Some(value.into_owned()).filter(|u| !u.is_empty()),
                    "password" => password = Some(Secret::new(value.into_owned())),
                    other => {
                        return Err(refused(format!(
                            "unknown query parameter {other:?}: a redis+unix URL takes db, user and password"
                        )));
                    }
                }
            }
            let path = url
                .to_file_path()
                .map_err(|()| refused("not a valid socket path".into()))?;
            Address::Unix { path }
        } else {
            let host = match url.host() {
                Some(url::Host::Ipv6(ip)) => ip.to_string(),
                Some(host) => host.to_string(),
                None => return Err(refused("no host given".into())),
            };
            if host.is_empty() {
                return Err(refused("no host given".into()));
            }
            let port = url.port().unwrap_or(6379);
            if port == 0 {
                return Err(refused(
                    "port 0 is not a port: use 1 to 65535 (6379 by default)".into(),
                ));
            }
            wait_replicas = parse_wait(&url).map_err(&refused)?;
            db = match url.path() {
                "" | "/" => 0,
                path => parse_db(&path[1..]).map_err(&refused)?,
            };
            Address::Tcp {
                host,
                port,
                tls: url.scheme() == "rediss",
            }
        };
        Ok(RedisUrl {
            address,
            username,
            password,
            db,
            wait_replicas,
            shown,
        })
    }

    /// A Sentinel or Cluster URL: several hosts, cut at the commas.
    fn parse_many(raw: &str) -> Result<RedisUrl, ConfigError> {
        let scheme = raw
            .split_once("://")
            .unwrap_or_default()
            .0
            .to_ascii_lowercase();
        let sentinel = scheme.ends_with("sentinel");
        let form = format!(
            "{scheme}://[user[:password]@]host[:port][,host[:port]…]{}",
            if sentinel { "/SERVICE[/db]" } else { "" }
        );
        let list = HostList::parse(raw, if sentinel { 26379 } else { 6379 }, &form)?;
        let refused = |why: String| list.refused(why);
        let (url, addresses, shown) = (&list.url, list.hosts.clone(), list.shown.clone());
        let (username, password) = credentials(url).map_err(&refused)?;
        let wait_replicas = parse_wait(url).map_err(&refused)?;
        let tls = scheme.starts_with("rediss");
        let path: Vec<&str> = url.path().trim_start_matches('/').split('/').collect();
        let (address, db) = if sentinel {
            let service = path[0].to_owned();
            if service.is_empty() || path.len() > 2 {
                return Err(refused(
                    "name the service: redis+sentinel://host:port[,host:port…]/SERVICE[/db]".into(),
                ));
            }
            let db = match path.get(1) {
                None | Some(&"") => 0,
                Some(db) => parse_db(db).map_err(&refused)?,
            };
            let address = Address::Sentinel {
                sentinels: addresses,
                service,
                tls,
            };
            (address, db)
        } else {
            if path != [""] {
                return Err(refused(
                    "a Redis Cluster has database 0 only: no /db in a cluster URL".into(),
                ));
            }
            let address = Address::Cluster {
                nodes: addresses,
                tls,
            };
            (address, 0)
        };
        Ok(RedisUrl {
            address,
            username,
            password,
            db,
            wait_replicas,
            shown,
        })
    }
}

/// `?wait=N`, the only query parameter of a TCP URL.
fn parse_wait(url: &Url) -> Result<u32, String> {
    let mut wait = 0;
    for (name, value) in url.query_pairs() {
        match &*name {
            "wait" => {
                wait = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| *n <= 64)
                    .ok_or_else(|| format!("wait={value}: a number of replicas, 0 to 64"))?;
            }
            other => {
                return Err(format!(
                    "unknown query parameter {other:?}: a {}:// URL takes only wait=N (the database is /DB)",
                    url.scheme()
                ));
            }
        }
    }
    Ok(wait)
}

fn parse_db(text: &str) -> Result<i64, String> {
    text.parse::<i64>()
        .ok()
        .filter(|db| *db >= 0)
        .ok_or_else(|| format!("database {text:?} is not a non-negative number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_urls() {
        let url = RedisUrl::parse("redis://app:s3cr%40t@cache.local:6380/2").unwrap();
        assert_eq!(url.username.as_deref(), Some("app"));
        assert_eq!(url.password.as_ref().unwrap().expose(), "s3cr@t");
        assert_eq!(url.db, 2);
        assert_eq!(
            url.address,
            Address::Tcp {
                host: "cache.local".into(),
                port: 6380,
                tls: false
            }
        );
        assert_eq!(url.to_string(), "redis://app:***@cache.local:6380/2");
        assert!(!format!("{url:?}").contains("s3cr"));

        let tls = RedisUrl::parse("rediss://[::1]").unwrap();
        assert_eq!(
            tls.address,
            Address::Tcp {
                host: "::1".into(),
                port: 6379,
                tls: true
            }
        );
        let slash = RedisUrl::parse("redis://app:c2VjcmV0%2FcGFzcw==@host:6379/0").unwrap();
        assert_eq!(slash.password.unwrap().expose(), "c2VjcmV0/cGFzcw==");
    }

    #[test]
    fn unix_urls() {
        let unix =
            RedisUrl::parse("redis+unix:///run/redis.sock?db=3&user=u&password=p%2Fw").unwrap();
        assert_eq!(
            unix.address,
            Address::Unix {
                path: "/run/redis.sock".into()
            }
        );
        assert_eq!(unix.db, 3);
        assert_eq!(unix.username.as_deref(), Some("u"));
        assert_eq!(unix.password.unwrap().expose(), "p/w");
        assert!(RedisUrl::parse("redis+unix:///x.sock?pass=1").is_err());
    }

    #[test]
    fn sentinel_and_cluster_urls_name_every_host() {
        let url = RedisUrl::parse(
            "redis+sentinel://app:s3cr%40t@10.0.0.1,10.0.0.2:26380,[::1]:26381/mymaster/2?wait=1",
        )
        .unwrap();
        assert_eq!(
            url.address,
            Address::Sentinel {
                sentinels: vec![
                    ("10.0.0.1".into(), 26379),
                    ("10.0.0.2".into(), 26380),
                    ("::1".into(), 26381)
                ],
                service: "mymaster".into(),
                tls: false
            }
        );
        assert_eq!((url.db, url.wait_replicas), (2, 1));
        assert_eq!(url.password.as_ref().unwrap().expose(), "s3cr@t");
        assert_eq!(
            url.to_string(),
            "redis+sentinel://app:***@10.0.0.1,10.0.0.2:26380,[::1]:26381/mymaster/2?wait=1"
        );
        let cluster = RedisUrl::parse("rediss+cluster://n1:7000,n2:7001").unwrap();
        assert_eq!(
            cluster.address,
            Address::Cluster {
                nodes: vec![("n1".into(), 7000), ("n2".into(), 7001)],
                tls: true
            }
        );
        assert_eq!(cluster.to_string(), "rediss+cluster://n1:7000,n2:7001");
        for (raw, says) in [
            ("redis+sentinel://:hunter2@h1,h2", "name the service"),
            ("redis+cluster://:hunter2@h1,h2/3", "database 0 only"),
            ("redis+cluster://:hunter2@h1,,h2", "is not a host"),
            ("redis+cluster://:hunter2@h1,h2:0", "port 0"),
            ("redis+cluster://:hunter2@h1?wait=x", "wait=x"),
        ] {
            let message = RedisUrl::parse(raw).unwrap_err().to_string();
            assert!(!message.contains("hunter2"), "{message}");
            assert!(message.contains(says), "{raw}: {message}");
        }
    }

    #[test]
    fn bad_urls_name_the_problem_never_the_password() {
        for (raw, says) in [
            (
                "redis://app:c2VjcmV0/cGFzcw==@host:6379/0",
                "percent-encoded",
            ),
            ("redis://app:hunter2/x@h", "percent-encoded"),
            ("rediss://:hunter2", "empty host"),
            ("redis://:hunter2@host:notaport", "invalid port"),
            ("redis://u:hunter2@host/x", "database \"x\""),
            (
                "redis://u:hunter2@host:6399?x=1",
                "unknown query parameter \"x\"",
            ),
            ("redis://u:hunter2@host:6399?wait=65", "0 to 64"),
            ("redis://u:hunter2@host:0", "port 0"),
            ("redis://", "no host"),
            ("redis+unix://relative.sock", "absolute socket path"),
        ] {
            let message = RedisUrl::parse(raw).unwrap_err().to_string();
            assert!(!message.contains("hunter2"), "{message}");
            assert!(!message.contains("c2VjcmV0"), "{message}");
            assert!(message.contains(says), "{raw}: {message}");
        }
    }
}
