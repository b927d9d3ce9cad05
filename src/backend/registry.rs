//! The one place that knows which backends exist: a URL scheme names one,
//! and its own module parses the rest. Adding a backend is a line here.

use std::path::PathBuf;
use std::sync::Arc;

use super::{Backend, etcd, file, postgres, redis};
use crate::error::ConfigError;

/// Options given beside the URL, for the backends that take them.
#[derive(Debug, Clone, Default)]
pub struct BackendOptions {
    /// `--tls-ca-file`: the CA that signed a TLS server's certificate.
    pub tls_ca_file: Option<PathBuf>,
    /// `--tls-cert-file` and `--tls-key-file`: a client certificate (etcd).
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// `--sentinel-password`: the Redis sentinels' own password.
    pub sentinel_password: Option<String>,
}

type Parse = fn(&str, &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError>;

/// Every backend: its schemes, the URL forms it takes (for messages and
/// help), and its parser.
const BACKENDS: &[(&[&str], &str, Parse)] = &[
    (&["file"], "file:///abs/dir", file::parse),
    (
        &[
            "redis",
            "rediss",
            "redis+unix",
            "redis+sentinel",
            "rediss+sentinel",
            "redis+cluster",
            "rediss+cluster",
        ],
        "redis://[user[:password]@]host[:port][/db], rediss://…, redis+unix:///path, redis+sentinel://host:port[,…]/SERVICE[/db] or redis+cluster://host:port[,…]",
        redis::parse,
    ),
    (
        &["etcd", "etcds"],
        "etcd://[user[:password]@]host[:port][,host[:port]…][/prefix], etcds://…",
        etcd::parse,
    ),
    (
        &["postgres", "postgresql"],
        "postgres://[user[:password]@]host[:port][/database][?sslmode=…&schema=…]",
        postgres::parse,
    ),
];

/// The backend a URL names; with none, the file backend in the default
/// state directory (SPEC §2).
pub fn parse(url: Option<&str>, options: &BackendOptions) -> Result<Arc<dyn Backend>, ConfigError> {
    let Some(url) = url else {
        return file::default(options);
    };
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    let parse = scheme.as_deref().and_then(|scheme| {
        BACKENDS
            .iter()
            .find(|(schemes, _, _)| schemes.contains(&scheme))
            .map(|(_, _, parse)| parse)
    });
    if options.tls_client.is_some() && scheme.as_deref() != Some("etcds") {
        return Err(ConfigError::BackendUrl {
            url: super::url::redact(url),
            why: "--tls-cert-file and --tls-key-file are for etcds:// only".into(),
        });
    }
    match parse {
        Some(parse) => parse(url, options),
        None => Err(ConfigError::BackendUrl {
            url: super::url::redact(url),
            why: format!("unknown scheme: use {}", schemes()),
        }),
    }
}

/// The URL forms of every backend, for messages and `--help`.
pub fn schemes() -> String {
    BACKENDS
        .iter()
        .map(|(_, forms, _)| *forms)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_scheme_lists_the_known_ones() {
        let message = parse(Some("bogus://x"), &BackendOptions::default())
            .unwrap_err()
            .to_string();
        assert!(message.contains("file:///abs/dir"), "{message}");
        assert!(message.contains("rediss://"), "{message}");
        let message = parse(Some("nothing"), &BackendOptions::default())
            .unwrap_err()
            .to_string();
        assert!(message.contains("unknown scheme"), "{message}");
    }
}
