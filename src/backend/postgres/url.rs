//! The PostgreSQL URL, in libpq's form: `postgres://` or `postgresql://`,
//! user, password, host (or `host=/socket/dir`), port, database, and the
//! query parameters libpq takes. tokio-postgres parses most of it; what it
//! does not take is handled here first:
//!
//! - `sslmode`, as libpq reads it: `disable`; `allow` and `prefer` (the
//!   default: TLS if the server offers it); `require` (TLS or nothing);
//!   `verify-ca` (the certificate is signed by a trusted CA) and
//!   `verify-full` (and names the host). `prefer` and `require` verify
//!   nothing, as in libpq, unless a CA is given, when `require` is
//!   `verify-ca` (also as in libpq).
//! - `sslrootcert`: the CA's PEM file (else `--tls-ca-file`, else
//!   `~/.postgresql/root.crt`, else the well-known public roots).
//! - `passfile`: the password file, instead of `$PGPASSFILE` / `~/.pgpass`.
//! - `schema`: leaderrun's own: the schema of its tables (`public` by
//!   default).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use url::Url;

use crate::backend::url::{masked, redact};
use crate::error::ConfigError;

/// How a connection uses TLS: libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    Disable,
    /// TLS when the server offers it; the certificate is not checked.
    Prefer,
    /// TLS or nothing; the certificate is not checked.
    Require,
    /// TLS, with a certificate signed by a trusted CA.
    VerifyCa,
    /// TLS, with a certificate signed by a trusted CA that names the host.
    VerifyFull,
}

/// A parsed PostgreSQL URL.
#[derive(Clone)]
pub struct PostgresUrl {
    /// For tokio-postgres, without the parameters handled here.
    pub config: tokio_postgres::Config,
    pub tls: Tls,
    pub ca_file: Option<PathBuf>,
    pub passfile: Option<PathBuf>,
    pub schema: String,
    /// The URL as given, password masked: for every message.
    shown: String,
}

impl fmt::Display for PostgresUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl PostgresUrl {
    pub fn parse(raw: &str) -> Result<PostgresUrl, ConfigError> {
        let mut url = Url::parse(raw).map_err(|e| ConfigError::BackendUrl {
            url: redact(raw),
            why: format!(
                "{e}; a PostgreSQL URL is postgres://[user[:password]@]host[:port][/database][?param=value&…], with '/', '@' and ':' in a user or password percent-encoded (%2F, %40, %3A)"
            ),
        })?;
        let shown = masked(&url);
        let refused = |why: String| ConfigError::BackendUrl {
            url: shown.clone(),
            why,
        };
        let mut tls = Tls::Prefer;
        let (mut ca_file, mut passfile) = (None, None);
        let mut schema = "public".to_owned();
        let mut kept = Vec::new();
        for (name, value) in url.query_pairs() {
            match &*name {
                "sslmode" => {
                    tls = match &*value {
                        "disable" => Tls::Disable,
                        "allow" | "prefer" => Tls::Prefer,
                        "require" => Tls::Require,
                        "verify-ca" => Tls::VerifyCa,
                        "verify-full" => Tls::VerifyFull,
                        other => {
                            return Err(refused(format!(
                                "sslmode {other:?}: use disable, prefer, require, verify-ca or verify-full"
                            )));
                        }
                    }
                }
                "sslrootcert" => ca_file = Some(PathBuf::from(&*value)),
                "passfile" => passfile = Some(PathBuf::from(&*value)),
                "schema" => {
                    let valid = value
                        .chars()
                        .next()
                        .is_some_and(|c| c == '_' || c.is_ascii_lowercase())
                        && value
                            .chars()
                            .all(|c| c == '_' || c.is_ascii_lowercase() || c.is_ascii_digit())
                        && value.len() <= 63;
                    if !valid {
                        return Err(refused(format!(
                            "schema {value:?}: use a lower-case name of letters, digits and '_'"
                        )));
                    }
                    schema = value.into_owned();
                }
                "sslcert" | "sslkey" | "sslpassword" | "service" | "requiressl" => {
                    return Err(refused(format!(
                        "{name} is not supported: leaderrun connects with a password (in the URL, PGPASSWORD or the password file) over TLS it verifies"
                    )));
                }
                _ => kept.push((name.into_owned(), value.into_owned())),
            }
        }
        // What tokio-postgres reads: the rest, with sslmode as it knows it.
        kept.push((
            "sslmode".into(),
            match tls {
                Tls::Disable => "disable",
                Tls::Prefer => "prefer",
                Tls::Require | Tls::VerifyCa | Tls::VerifyFull => "require",
            }
            .into(),
        ));
        url.query_pairs_mut().clear().extend_pairs(kept);
        let mut config = tokio_postgres::Config::from_str(url.as_str()).map_err(|e| {
            // Its messages name the option, never the password.
            refused(e.to_string())
        })?;
        if config.get_hosts().is_empty() {
            return Err(refused(
                "no host given: postgres://host[:port]/database, or ?host=/socket/dir".into(),
            ));
        }
        // libpq ignores sslmode on a unix socket (there is no TLS there).
        let sockets_only = config
            .get_hosts()
            .iter()
            .all(|host| matches!(host, tokio_postgres::config::Host::Unix(_)));
        if sockets_only {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
        }
        Ok(PostgresUrl {
            config,
            tls,
            ca_file,
            passfile,
            schema,
            shown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_postgres::config::Host;

    #[test]
    fn libpq_urls() {
        let url = PostgresUrl::parse(
            "postgres://app:s3cr%40t@db.local:6543/jobs?sslmode=verify-full&sslrootcert=/ca.pem&schema=lr&application_name=x",
        )
        .unwrap();
        assert_eq!(url.config.get_user(), Some("app"));
        assert_eq!(url.config.get_password(), Some(&b"s3cr@t"[..]));
        assert_eq!(url.config.get_dbname(), Some("jobs"));
        assert_eq!(url.config.get_ports(), [6543]);
        assert_eq!(url.tls, Tls::VerifyFull);
        assert_eq!(url.ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(url.schema, "lr");
        assert_eq!(url.config.get_application_name(), Some("x"));
        assert_eq!(
            url.to_string(),
            "postgres://app:***@db.local:6543/jobs?sslmode=verify-full&sslrootcert=/ca.pem&schema=lr&application_name=x"
        );

        let socket = PostgresUrl::parse("postgresql:///app?host=/run/postgresql&user=u").unwrap();
        assert_eq!(
            socket.config.get_hosts(),
            [Host::Unix("/run/postgresql".into())]
        );
        assert_eq!(socket.schema, "public");
        assert_eq!(socket.tls, Tls::Prefer);
    }

    #[test]
    fn bad_urls_say_why_never_the_password() {
        for (raw, says) in [
            ("postgres://u:hunter2@h/db?sslmode=sometimes", "sslmode"),
            ("postgres://u:hunter2@h/db?schema=Bad-Name", "schema"),
            ("postgres://u:hunter2@h/db?sslkey=/k", "not supported"),
            ("postgres://u:hunter2/x@h/db", "percent-encoded"),
            ("postgres://u:hunter2@h/db?nonsense=1", "nonsense"),
        ] {
            let message = PostgresUrl::parse(raw).unwrap_err().to_string();
            assert!(!message.contains("hunter2"), "{message}");
            assert!(message.contains(says), "{raw}: {message}");
        }
    }
}
