//! The Redis URL grammar, on the `url` crate:
//!
//! ```text
//! redis://[user[:password]@]host[:port][/db]
//! rediss://[user[:password]@]host[:port][/db]        (TLS)
//! redis+unix:///path/to/socket[?db=N][&user=U][&password=P]
//! ```
//!
//! The password is a `Secret`: no `Display`, a `Debug` of `***`, and every
//! message shows the URL masked.

use std::fmt;
use std::path::PathBuf;

use percent_encoding::percent_decode_str;
use url::Url;

use crate::backend::url::{masked, redact};
use crate::error::ConfigError;

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

/// A parsed Redis URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    pub address: Address,
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub db: i64,
    /// The URL as given, with the password masked: for every message.
    shown: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Tcp { host: String, port: u16, tls: bool },
    Unix { path: PathBuf },
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl RedisUrl {
    pub fn parse(raw: &str) -> Result<RedisUrl, ConfigError> {
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
        if url.fragment().is_some() {
            return Err(refused(
                "a '#' ends the URL early; percent-encode it as %23 in a password".into(),
            ));
        }
        let decode = |text: &str, what: &str| {
            percent_decode_str(text)
                .decode_utf8()
                .map(|t| t.into_owned())
                .map_err(|_| {
                    refused(format!(
                        "the {what} is not valid UTF-8 once percent-decoded"
                    ))
                })
        };
        let mut username = Some(decode(url.username(), "user")?).filter(|u| !u.is_empty());
        let mut password = url
            .password()
            .map(|p| decode(p, "password"))
            .transpose()?
            .map(Secret);
        let mut db = 0;
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
                    "password" => password = Some(Secret(value.into_owned())),
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
            if let Some(query) = url.query() {
                let name = query.split(['=', '&']).next().unwrap_or_default();
                return Err(refused(format!(
                    "unknown query parameter {name:?}: a {}:// URL takes none (the database is /DB)",
                    url.scheme()
                )));
            }
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
            shown,
        })
    }
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
