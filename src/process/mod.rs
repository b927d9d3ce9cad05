//! Everything leaderrun does to processes. Each part names the pitfall it
//! guards against; they are the ones that make `flock`, `consul lock` and
//! friends leave processes behind.
//!
//! - `spawn.rs`: the one spawn path (command, hooks, keepers): a group of
//!   its own, a death signal armed from the main thread, signal
//!   dispositions reset, the terminal's foreground;
//! - `host.rs`: the one owner of processes in a leaderrun: it spawns units,
//!   reaps every child and routes each exit to the unit that owns the pid;
//! - `cgroup.rs` and `keeper.rs`: containment per unit, by a cgroup where
//!   one can be made, else by a keeper process that is the subreaper of the
//!   unit's processes; either way a unit's kill reaches everything it
//!   started and nothing of another unit's;
//! - `guard.rs`: kills every unit if leaderrun itself is killed outright;
//! - `terminal.rs`, `tree.rs`: the terminal hand-off, and /proc.

mod cgroup;
mod guard;
mod host;
mod keeper;
mod spawn;
mod terminal;
mod tree;

use std::ffi::{CStr, CString, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use nix::sys::wait::WaitStatus;
use nix::unistd::{AccessFlags, access};

pub use guard::{Aftermath, GUARD_ENV, Guard};
pub use host::{Host, LeaseHost, ProcessUnit, Processes, Scope, Spawn, Unit, UnitEvent};
pub use keeper::{KEEPER_ENV, main as keeper_main};
pub use spawn::note_dispositions;
pub use terminal::reclaim as reclaim_terminal;

use crate::error::{CommandError, ConfigError};

/// Finds the program the way `execvp` would, so that a missing command exits
/// 127 and a non-executable one 126 before any lease is taken.
pub fn resolve(program: &OsString) -> Result<PathBuf, CommandError> {
    let shown = || program.to_string_lossy().into_owned();
    if program.as_bytes().contains(&b'/') {
        let path = PathBuf::from(program);
        return match std::fs::metadata(&path) {
            Err(_) => Err(CommandError::NotFound(shown())),
            Ok(meta) if meta.is_dir() || !executable(&path) => {
                Err(CommandError::NotExecutable(shown()))
            }
            Ok(_) => Ok(path),
        };
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    let mut not_executable = false;
    for dir in std::env::split_paths(&search) {
        let candidate = dir.join(program);
        match std::fs::metadata(&candidate) {
            Ok(meta) if meta.is_file() && executable(&candidate) => return Ok(candidate),
            Ok(meta) if meta.is_file() => not_executable = true,
            _ => {}
        }
    }
    if not_executable {
        Err(CommandError::NotExecutable(shown()))
    } else {
        Err(CommandError::NotFound(shown()))
    }
}

fn executable(path: &Path) -> bool {
    // access(X_OK) is what exec checks for root too, where mode bits alone
    // would say yes to a file with no x bit at all.
    access(path, AccessFlags::X_OK).is_ok()
        && std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o111 != 0)
}

/// Makes leaderrun a child subreaper: a descendant whose parent dies is
/// re-parented to leaderrun instead of init, so it is still reaped here.
pub fn become_subreaper() -> io::Result<()> {
    nix::sys::prctl::set_child_subreaper(true).map_err(io::Error::from)
}

/// Lowers this thread's scheduling priority (leaderrun's main thread: the
/// runtime's) to the least: for the work a replica does on its way out,
/// after its lease is released.
pub fn lower_priority() {
    // SAFETY: setpriority only changes this thread's nice value.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
}

/// Shard mode keeps descriptors per shard (a lease file, a connection):
/// raises the soft limit on open descriptors to the hard one (at most
/// 65536). The commands inherit it. Best effort: on failure the limit stays.
pub fn raise_descriptor_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let wanted = hard.min(65536);
        if soft < wanted {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, wanted, hard);
        }
    }
}

/// The exit status leaderrun passes on: the child's code, or 128+N if it
/// died of signal N.
pub fn exit_code(status: WaitStatus) -> Option<u8> {
    match status {
        WaitStatus::Exited(_, code) => Some(code as u8),
        WaitStatus::Signaled(_, signal, _) => Some(128 + signal as u8),
        _ => None,
    }
}

/// `/bin/sh -c <script>`, the way the fencing hooks run.
pub fn shell(script: &str) -> (PathBuf, Vec<OsString>) {
    (
        "/bin/sh".into(),
        vec!["sh".into(), "-c".into(), script.into()],
    )
}

/// The variables a term's processes get on top of leaderrun's environment.
#[derive(Debug, Clone)]
pub struct ChildEnv {
    pub token_env: String,
    /// None for the fence-floor command, which runs before there is a token.
    pub token: Option<u64>,
    pub key: String,
    pub owner: String,
    /// More variables (a shard's index, for instance).
    pub extra: Vec<(String, String)>,
    /// Variables of leaderrun's environment left out (a backend's secret).
    pub hidden: Vec<String>,
    /// What of leaderrun's environment every child gets, made once (by the
    /// first spawn, or while a follower waits) and shared by the clones of
    /// this value: leaderrun's environment does not change while it runs.
    pub inherited: InheritedEnv,
}

/// The part of a child's environment that is leaderrun's own, as C strings.
#[derive(Debug, Clone, Default)]
pub struct InheritedEnv(Arc<OnceLock<Vec<CString>>>);

/// A child's whole environment: the inherited part and the variables set
/// for it.
pub struct EnvBlock {
    inherited: Arc<OnceLock<Vec<CString>>>,
    set: Vec<CString>,
}

impl EnvBlock {
    /// Every entry, `NAME=value`.
    pub fn entries(&self) -> impl Iterator<Item = &CStr> {
        let inherited = self.inherited.get().map(Vec::as_slice).unwrap_or(&[]);
        inherited.iter().chain(&self.set).map(CString::as_c_str)
    }
}

/// The variable that tells a nested leaderrun which leaderrun runs it.
pub const PARENT_ENV: &str = "LEADERRUN_PID";

/// Variables of leaderrun's own that the child never inherits as they are:
/// the backend URL and the sentinels' password are secrets, and the others
/// are set anew.
const NOT_INHERITED: [&str; 5] = [
    "LEADERRUN_BACKEND",
    "LEADERRUN_SENTINEL_PASSWORD",
    "LEADERRUN_KEY",
    "LEADERRUN_OWNER",
    PARENT_ENV,
];

impl ChildEnv {
    /// leaderrun's environment, plus the token, key, owner and leaderrun's
    /// pid, minus the backend URL and the backend's secrets.
    pub fn block(&self) -> EnvBlock {
        self.prepare();
        let token = self.token.map(|t| t.to_string());
        let pid = std::process::id().to_string();
        let set = [
            (self.token_env.as_str(), token.as_deref()),
            ("LEADERRUN_KEY", Some(self.key.as_str())),
            ("LEADERRUN_OWNER", Some(self.owner.as_str())),
            (PARENT_ENV, Some(pid.as_str())),
        ]
        .into_iter()
        .chain(
            self.extra
                .iter()
                .map(|(n, v)| (n.as_str(), Some(v.as_str()))),
        )
        .filter_map(|(name, value)| env_entry(name.as_bytes(), value?.as_bytes()))
        .collect();
        EnvBlock {
            inherited: self.inherited.0.clone(),
            set,
        }
    }

    /// Makes the inherited part of the environment now, if it is not made
    /// yet: a follower does it while it waits, so a handover does not.
    pub fn prepare(&self) {
        self.inherited.0.get_or_init(|| {
            let ours = |name: &[u8]| {
                name == self.token_env.as_bytes()
                    || NOT_INHERITED.iter().any(|o| name == o.as_bytes())
                    || self.extra.iter().any(|(n, _)| name == n.as_bytes())
                    || self.hidden.iter().any(|n| name == n.as_bytes())
            };
            std::env::vars_os()
                .filter(|(name, _)| !ours(name.as_bytes()))
                .filter_map(|(name, value)| env_entry(name.as_bytes(), value.as_bytes()))
                .collect()
        });
    }
}

/// `NAME=value` as a C string. Names and values from an environment or a
/// checked flag hold no NUL; one that did is left out (None), not cut short.
fn env_entry(name: &[u8], value: &[u8]) -> Option<CString> {
    CString::new([name, b"=", value].concat()).ok()
}

/// How units of processes are contained (README "The child").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ContainmentMode {
    /// A cgroup where a writable cgroup2 exists, else a keeper.
    #[default]
    Auto,
    /// A cgroup per unit; refuse to start without a writable cgroup2.
    Cgroup,
    /// A keeper process per unit, the subreaper of its processes.
    Keeper,
}

/// The containment chosen for this leaderrun.
#[derive(Debug, Clone)]
pub enum Containment {
    Cgroup(cgroup::Cgroups),
    /// `exe` is leaderrun's binary, run again in keeper mode.
    Keeper {
        exe: PathBuf,
    },
}

impl Containment {
    /// Picks the containment `mode` asks for; `exe` runs keepers.
    pub fn choose(mode: ContainmentMode, exe: PathBuf) -> Result<Containment, ConfigError> {
        match mode {
            ContainmentMode::Keeper => Ok(Containment::Keeper { exe }),
            ContainmentMode::Cgroup => cgroup::Cgroups::setup()
                .map(Containment::Cgroup)
                .map_err(ConfigError::Containment),
            ContainmentMode::Auto => Ok(cgroup::Cgroups::setup()
                .map(Containment::Cgroup)
                .unwrap_or(Containment::Keeper { exe })),
        }
    }

    /// Where the guard finds this leaderrun's cgroups, if any: their
    /// parent directory and the prefix of their names.
    pub fn cgroups(&self) -> Option<(&Path, &str)> {
        match self {
            Containment::Cgroup(cgroups) => Some(cgroups.place()),
            Containment::Keeper { .. } => None,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Containment::Cgroup(cgroups) => {
                let (parent, prefix) = cgroups.place();
                format!("cgroup {}/{prefix}*", parent.display())
            }
            Containment::Keeper { .. } => "keeper".into(),
        }
    }

    /// Removes what the containment made (at exit, every unit gone), where
    /// no guard does it.
    pub fn remove(&self) {
        if let Containment::Cgroup(cgroups) = self {
            cgroups.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal;
    use nix::unistd::Pid;

    #[test]
    fn resolves_through_path_and_by_path() {
        assert!(resolve(&"sh".into()).unwrap().is_absolute());
        assert_eq!(
            resolve(&"/bin/sh".into()).unwrap(),
            PathBuf::from("/bin/sh")
        );
    }

    #[test]
    fn missing_and_non_executable_commands_are_told_apart() {
        let missing = resolve(&"leaderrun-no-such-command".into()).unwrap_err();
        assert_eq!(missing.exit_code(), 127);
        let missing_path = resolve(&"/nonexistent/x".into()).unwrap_err();
        assert_eq!(missing_path.exit_code(), 127);
        let dir = resolve(&"/tmp".into()).unwrap_err();
        assert_eq!(dir.exit_code(), 126);
        let plain = std::env::temp_dir().join(format!("leaderrun-plain-{}", std::process::id()));
        std::fs::write(&plain, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        let refused = resolve(&plain.clone().into_os_string()).unwrap_err();
        std::fs::remove_file(&plain).unwrap();
        assert_eq!(refused.exit_code(), 126);
    }

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        let pid = Pid::from_raw(1);
        assert_eq!(exit_code(WaitStatus::Exited(pid, 3)), Some(3));
        assert_eq!(
            exit_code(WaitStatus::Signaled(pid, Signal::SIGTERM, false)),
            Some(143)
        );
        assert_eq!(
            exit_code(WaitStatus::Signaled(pid, Signal::SIGKILL, false)),
            Some(137)
        );
    }
}
