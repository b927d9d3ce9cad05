//! What every backend's URL grammar shares: the `url` crate does the
//! parsing and percent-decoding; this module only makes sure no password
//! reaches a message, also from a URL that did not parse.

use std::fmt;

use percent_encoding::percent_decode_str;
use url::Url;

use crate::error::ConfigError;

/// A password: never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(text: String) -> Secret {
        Secret(text)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The user and password of a URL, percent-decoded.
pub fn credentials(url: &Url) -> Result<(Option<String>, Option<Secret>), String> {
    let decode = |text: &str, what: &str| {
        percent_decode_str(text)
            .decode_utf8()
            .map(|t| t.into_owned())
            .map_err(|_| format!("the {what} is not valid UTF-8 once percent-decoded"))
    };
    let username = Some(decode(url.username(), "user")?).filter(|u| !u.is_empty());
    let password = url
        .password()
        .map(|p| decode(p, "password"))
        .transpose()?
        .map(Secret);
    Ok((username, password))
}

/// A '#' in a URL cuts it short: refused, with the fix.
pub fn no_fragment(url: &Url) -> Result<(), String> {
    match url.fragment() {
        Some(_) => Err("a '#' ends the URL early; percent-encode it as %23 in a password".into()),
        None => Ok(()),
    }
}

/// A URL naming several hosts, `scheme://[userinfo@]host[:port][,host[:port]…][/path][?query]`,
/// cut at the commas: the `url` crate parses it with the first host (for
/// the user-info, path and query) and each host on its own.
pub struct HostList {
    /// The URL with the first host standing in for all of them.
    pub url: Url,
    /// Every host, with `default_port` where none is given.
    pub hosts: Vec<(String, u16)>,
    /// The URL as given, with the password masked: for every message.
    pub shown: String,
}

impl HostList {
    /// `form` is the grammar, for the message of a URL that does not parse.
    pub fn parse(raw: &str, default_port: u16, form: &str) -> Result<HostList, ConfigError> {
        let (scheme, rest) = raw.split_once("://").unwrap_or_default();
        let scheme = scheme.to_ascii_lowercase();
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
            None => (String::new(), authority),
        };
        let hosts: Vec<&str> = hosts.split(',').collect();
        let url = Url::parse(&format!("{scheme}://{userinfo}{}{tail}", hosts[0])).map_err(|e| {
            ConfigError::BackendUrl {
                url: redact(raw),
                why: format!(
                    "{e}; a {scheme} URL is {form}, with '/', '@' and ':' in a user or password percent-encoded"
                ),
            }
        })?;
        let shown_userinfo = match (url.username(), url.password()) {
            (user, Some(_)) => format!("{user}:***@"),
            ("", None) => String::new(),
            (user, None) => format!("{user}@"),
        };
        let shown = format!("{scheme}://{shown_userinfo}{}{tail}", hosts.join(","));
        let refused = |why: String| ConfigError::BackendUrl {
            url: shown.clone(),
            why,
        };
        no_fragment(&url).map_err(&refused)?;
        let mut addresses = Vec::new();
        for host in &hosts {
            let one = Url::parse(&format!("{scheme}://{host}"))
                .ok()
                .filter(|u| u.username().is_empty() && matches!(u.path(), "" | "/"))
                .and_then(|u| {
                    let name = match u.host()? {
                        url::Host::Ipv6(ip) => ip.to_string(),
                        host => host.to_string(),
                    };
                    (!name.is_empty()).then(|| (name, u.port().unwrap_or(default_port)))
                });
            match one {
                Some((_, 0)) => return Err(refused(format!("{host:?}: port 0 is not a port"))),
                Some(address) => addresses.push(address),
                None => return Err(refused(format!("{host:?} is not a host[:port]"))),
            }
        }
        Ok(HostList {
            url,
            hosts: addresses,
            shown,
        })
    }

    /// A refusal of this URL, for `why`.
    pub fn refused(&self, why: String) -> ConfigError {
        ConfigError::BackendUrl {
            url: self.shown.clone(),
            why,
        }
    }
}

/// A parsed URL for messages: the password, if any, replaced by `***`.
pub fn masked(url: &Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        // Cannot fail: a URL with a password has a host.
        let _ = shown.set_password(Some("***"));
    }
    shown.to_string()
}

/// A URL that did not parse, for messages: nothing that may be a password.
///
/// Without a parse there is no telling where a password ends (an unencoded
/// `/` or `@` in it moves every boundary), so everything between the first
/// `:` after `://` (the user before it is shown) and the last `@` is hidden,
/// and so is a user-info with no `:` at all (it may be a lone password);
/// with no `@`, an authority whose "port" is not a number
/// (`rediss://:hunter2`) is hidden too.
pub fn redact(raw: &str) -> String {
    let Some((scheme, rest)) = raw.split_once("://") else {
        // `file:DIR` and the like: no authority, so no password.
        return raw.to_owned();
    };
    if let Some((userinfo, after)) = rest.rsplit_once('@') {
        return match userinfo.split_once(':') {
            Some((user, _)) if !user.contains('/') => format!("{scheme}://{user}:***@{after}"),
            _ => format!("{scheme}://***@{after}"),
        };
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let port_like = authority
        .rsplit_once(':')
        .map(|(_, port)| port)
        .filter(|port| !port.ends_with(']'));
    match port_like {
        Some(port) if !port.bytes().all(|b| b.is_ascii_digit()) => format!("{scheme}://…"),
        _ => raw.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_is_never_shown_whatever_breaks_the_parse() {
        for raw in [
            "redis://app:c2VjcmV0/cGFzcw==@host:6379/0",
            "redis://app:hunter2/x@h",
            "rediss://:hunter2",
            "redis://:hunter2@host:notaport",
            "redis://u:p@ss:hunter2@host",
        ] {
            let shown = redact(raw);
            for secret in ["c2VjcmV0", "cGFzcw", "hunter2", "p@ss"] {
                assert!(!shown.contains(secret), "{raw} -> {shown}");
            }
        }
        assert_eq!(redact("redis://:hunter2@h:nope"), "redis://:***@h:nope");
        assert_eq!(redact("redis://app:c2VjcmV0/x@h"), "redis://app:***@h");
        assert_eq!(redact("redis://host:6399?x=1"), "redis://host:6399?x=1");
        assert_eq!(redact("redis://[::1]:6379"), "redis://[::1]:6379");
        assert_eq!(redact("file:relative"), "file:relative");
    }

    #[test]
    fn a_parsed_password_is_masked() {
        let url = Url::parse("redis://app:s3cret@host:6380/2").unwrap();
        assert_eq!(masked(&url), "redis://app:***@host:6380/2");
        let url = Url::parse("redis://host").unwrap();
        assert_eq!(masked(&url), "redis://host");
    }
}
