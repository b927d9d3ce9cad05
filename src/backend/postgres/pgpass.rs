//! Passwords the way libpq finds them when the URL has none: `PGPASSWORD`,
//! then the password file (`$PGPASSFILE`, else `~/.pgpass`), which libpq,
//! and so leaderrun, ignores unless only its owner can read it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tokio_postgres::Config;
use tokio_postgres::config::Host;

/// What the environment and the password file give a connection whose URL
/// has no password.
#[derive(Debug, Default)]
pub struct Found {
    pub password: Option<String>,
    /// It came from `PGPASSWORD`, which the command must then not inherit.
    pub from_env: bool,
    /// A password file ignored because others may read it: for the message
    /// when the server asks for a password.
    pub ignored: Option<PathBuf>,
}

/// The password for a connection whose URL has none. `passfile`: the URL's
/// `passfile` parameter.
pub fn find(config: &Config, passfile: Option<&Path>) -> Found {
    if let Some(password) = std::env::var_os("PGPASSWORD") {
        return Found {
            password: Some(password.to_string_lossy().into_owned()),
            from_env: true,
            ignored: None,
        };
    }
    let path = match (passfile, std::env::var_os("PGPASSFILE")) {
        (Some(path), _) => path.to_path_buf(),
        (None, Some(path)) => PathBuf::from(path),
        (None, None) => match std::env::var_os("HOME") {
            Some(home) => Path::new(&home).join(".pgpass"),
            None => return Found::default(),
        },
    };
    let Ok(meta) = std::fs::metadata(&path) else {
        return Found::default();
    };
    if meta.mode() & 0o077 != 0 {
        return Found {
            ignored: Some(path),
            ..Found::default()
        };
    }
    let password = meta
        .is_file()
        .then(|| std::fs::read_to_string(&path).ok())
        .flatten()
        .and_then(|text| {
            let user = config.get_user().map(str::to_owned).or_else(os_user)?;
            let db = config.get_dbname().unwrap_or(&user).to_owned();
            let port = config.get_ports().first().copied().unwrap_or(5432);
            // libpq's host field: the name, or for a socket its directory
            // (and "localhost", which also names the default socket).
            let hosts: Vec<String> = match config.get_hosts().first()? {
                Host::Tcp(name) => vec![name.clone()],
                Host::Unix(dir) => vec![dir.display().to_string(), "localhost".into()],
            };
            hosts
                .iter()
                .find_map(|host| lookup(&text, host, port, &db, &user))
        });
    Found {
        password,
        ..Found::default()
    }
}

/// The name of the user running leaderrun: the user PostgreSQL is told
/// when the URL names none.
fn os_user() -> Option<String> {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|user| user.name)
}

/// libpq's rules: lines of `host:port:database:user:password`, `*` matches
/// anything, `\:` and `\\` escape, `#` starts a comment, the first match
/// wins.
pub fn lookup(text: &str, host: &str, port: u16, db: &str, user: &str) -> Option<String> {
    let port = port.to_string();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let mut fields = vec![String::new()];
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => fields.last_mut()?.push(chars.next().unwrap_or('\\')),
                ':' if fields.len() < 5 => fields.push(String::new()),
                c => fields.last_mut()?.push(c),
            }
        }
        if fields.len() != 5 {
            continue;
        }
        let wanted = [host, port.as_str(), db, user];
        if fields[..4]
            .iter()
            .zip(wanted)
            .all(|(field, want)| field == "*" || field == want)
        {
            return fields.pop();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_match_as_libpq_matches_them() {
        let file = "# comment\nlocalhost:5432:app:app:s3cret\n*:*:*:ops:p\\:w\\\\d\ndb.example:*:*:*:x:y\n";
        assert_eq!(
            lookup(file, "localhost", 5432, "app", "app").as_deref(),
            Some("s3cret")
        );
        assert_eq!(lookup(file, "h", 1, "d", "ops").as_deref(), Some("p:w\\d"));
        assert_eq!(
            lookup(file, "db.example", 1, "d", "u").as_deref(),
            Some("x:y")
        );
        assert_eq!(lookup(file, "localhost", 5433, "app", "app"), None);
    }
}
