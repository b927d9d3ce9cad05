//! What every backend's URL grammar shares: the `url` crate does the
//! parsing and percent-decoding; this module only makes sure no password
//! reaches a message, also from a URL that did not parse.

use url::Url;

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
