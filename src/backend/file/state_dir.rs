//! The state directory: where it is by default, how a key becomes a file
//! name, and the safety checks that keep other users out of it.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::error::ConfigError;

/// `$XDG_STATE_HOME/leaderrun`, else `/var/lib/leaderrun` for root, else
/// `~/.local/state/leaderrun`.
pub fn default_dir() -> Result<PathBuf, ConfigError> {
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

/// Opens (and with `create`, makes) the state directory, refusing one that
/// another user owns or that group or others may write: anyone who can
/// write there can take or forge a lease.
/// Without `create`, a directory that does not exist is `None`.
pub fn open(dir: &Path, create: bool) -> Result<Option<OwnedFd>, ConfigError> {
    let shown = || dir.display().to_string();
    let io_error = |source| ConfigError::StateDir {
        path: shown(),
        source,
    };
    if create {
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error(e)),
        }
    }
    let fd = match nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) if !create => return Ok(None),
        Err(e) => return Err(io_error(e.into())),
    };
    let stat = nix::sys::stat::fstat(&fd).map_err(|e| io_error(e.into()))?;
    let me = nix::unistd::geteuid().as_raw();
    if stat.st_uid != me {
        return Err(ConfigError::UnsafeStateDir {
            path: shown(),
            why: format!(
                "owned by uid {}, not by this user (uid {me}); chown it, or point --backend at a directory of your own",
                stat.st_uid
            ),
        });
    }
    if stat.st_mode & 0o022 != 0 {
        return Err(ConfigError::UnsafeStateDir {
            path: shown(),
            why: format!(
                "mode {:04o} lets group or others write; run chmod 700 {}",
                stat.st_mode & 0o7777,
                shown()
            ),
        });
    }
    Ok(Some(fd))
}

/// A safe file name for any key: a hash for uniqueness, and a readable
/// (sanitized, truncated) copy of the key for operators. `/`, `..` and
/// unicode cannot escape the directory or make hidden files.
pub fn file_name(key: &str) -> String {
    let readable: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    format!("{:016x}-{readable}.lease", fnv1a(key.as_bytes()))
}

/// FNV-1a: a stable hash for file names and record checksums (not for
/// security: the directory is private).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_safe_and_distinct() {
        for key in [
            "..",
            "a/b",
            "../../etc/passwd",
            ".hidden",
            "ключ",
            &"x".repeat(200),
        ] {
            let name = file_name(key);
            assert!(!name.contains('/') && !name.starts_with('.'), "{name}");
            assert!(name.len() < 100, "{name}");
            assert!(name.is_ascii(), "{name}");
        }
        assert_ne!(file_name("a/b"), file_name("a_b"));
    }

    #[test]
    fn unsafe_directories_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempdir("mode");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = open(&dir, true).unwrap_err().to_string();
        assert!(error.contains("chmod 700"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempdir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("leaderrun-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }
}
