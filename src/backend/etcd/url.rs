//! The etcd URL grammar:
//!
//! ```text
//! etcd://[user[:password]@]host[:port][,host[:port]…][/prefix]
//! etcds://…                                                (TLS)
//! ```
//!
//! Every host is a member's client URL (port 2379 by default); each call
//! goes to the member that answered last and moves on to the next when it
//! cannot. The prefix (default `leaderrun`) is the root of every key
//! leaderrun writes. The user and password are etcd's (`etcdctl user add`);
//! the password is a `Secret`, and every message shows the URL masked.

use std::fmt;

use percent_encoding::percent_decode_str;

use crate::backend::url::{HostList, Secret, credentials};
use crate::error::ConfigError;

const FORM: &str =
    "etcd://[user[:password]@]host[:port][,host[:port]…][/prefix] (etcds:// for TLS)";

/// A parsed etcd URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    pub endpoints: Vec<(String, u16)>,
    pub tls: bool,
    pub prefix: String,
    pub username: Option<String>,
    pub password: Option<Secret>,
    shown: String,
}

impl EtcdUrl {
    pub fn parse(raw: &str) -> Result<EtcdUrl, ConfigError> {
        let list = HostList::parse(raw, 2379, FORM)?;
        let url = &list.url;
        let (username, password) = credentials(url).map_err(|why| list.refused(why))?;
        if password.is_some() && username.is_none() {
            return Err(list.refused(
                "a password needs a user: etcd://user:password@host (etcdctl user add)".into(),
            ));
        }
        if let Some((name, _)) = url.query_pairs().next() {
            return Err(list.refused(format!(
                "unknown query parameter {name:?}: an etcd URL takes none (the prefix is the path)"
            )));
        }
        let prefix = percent_decode_str(url.path()).decode_utf8().map_err(|_| {
            list.refused("the prefix is not valid UTF-8 once percent-decoded".into())
        })?;
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() {
            "leaderrun"
        } else {
            prefix
        };
        if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(list.refused(format!(
                "prefix {prefix:?}: no whitespace or control characters"
            )));
        }
        Ok(EtcdUrl {
            endpoints: list.hosts.clone(),
            tls: url.scheme() == "etcds",
            prefix: prefix.to_owned(),
            username,
            password,
            shown: list.shown.clone(),
        })
    }
}

impl fmt::Display for EtcdUrl {
    /// The URL as given, with the password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_is_named_and_the_prefix_defaults() {
        let url = EtcdUrl::parse("etcd://app:s3cret@m1:2380,m2,[::1]:2381/jobs").unwrap();
        assert_eq!(
            url.endpoints,
            [
                ("m1".to_owned(), 2380),
                ("m2".to_owned(), 2379),
                ("::1".to_owned(), 2381)
            ]
        );
        assert_eq!(url.prefix, "jobs");
        assert_eq!(url.username.as_deref(), Some("app"));
        assert_eq!(url.password.as_ref().unwrap().expose(), "s3cret");
        assert!(!url.to_string().contains("s3cret"), "{url}");
        let url = EtcdUrl::parse("etcds://127.0.0.1").unwrap();
        assert!(url.tls);
        assert_eq!(url.prefix, "leaderrun");
        for bad in [
            "etcd://:pw@host",
            "etcd://host?x=1",
            "etcd://host:0",
            "etcd://a,,b",
            "etcd://host/a b",
        ] {
            let message = EtcdUrl::parse(bad).unwrap_err().to_string();
            assert!(!message.contains("pw@"), "{message}");
        }
    }
}
