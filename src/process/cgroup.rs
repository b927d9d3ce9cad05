//! Containment by cgroup v2, where a writable cgroup2 hierarchy exists (root,
//! a systemd unit with `Delegate=yes`, a container with its own cgroup
//! namespace): every unit of processes (a term's command, a hook) gets a
//! cgroup of its own under `<leaderrun's cgroup>/leaderrun-<pid>/`.
//!
//! The child writes itself into its cgroup before it execs, so everything it
//! ever starts is in there too, whatever it does with process groups and
//! sessions. `cgroup.kill` kills the whole cgroup at once, with no race
//! against a fork; `cgroup.events` says when nothing is left. No controller
//! is enabled: the cgroups only count and kill.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use std::os::unix::fs::OpenOptionsExt;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::spawn::CgroupFds;

/// This leaderrun's directory of unit cgroups.
#[derive(Debug, Clone)]
pub struct Cgroups {
    dir: PathBuf,
}

impl Cgroups {
    /// Finds the cgroup2 hierarchy and this process's cgroup in it, and
    /// makes this leaderrun's directory there. Says why not, if it cannot.
    pub fn setup() -> Result<Cgroups, String> {
        let mount = cgroup2_mount().ok_or("no cgroup2 hierarchy is mounted")?;
        let own = fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let path = own
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
            .ok_or("this process is in no cgroup2 cgroup")?;
        let relative = path
            .strip_prefix(&mount.root)
            .unwrap_or(path)
            .trim_start_matches('/');
        let parent = mount.point.join(relative);
        let dir = parent.join(format!("leaderrun-{}", std::process::id()));
        if let Err(e) = fs::create_dir(&dir) {
            // A directory left by an earlier leaderrun of this pid: empty, or
            // it could not be removed either.
            if e.kind() != io::ErrorKind::AlreadyExists || fs::remove_dir(&dir).is_err() {
                return Err(format!(
                    "cannot create a cgroup in {}: {e}",
                    parent.display()
                ));
            }
            fs::create_dir(&dir)
                .map_err(|e| format!("cannot create a cgroup in {}: {e}", parent.display()))?;
        }
        Ok(Cgroups { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new cgroup for unit `id`.
    pub fn unit(&self, id: u64) -> io::Result<UnitCgroup> {
        let path = unit_path(&self.dir, id);
        fs::create_dir(&path)?;
        let opened = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&path)
            .and_then(|dir| {
                let procs = OpenOptions::new()
                    .write(true)
                    .open(path.join("cgroup.procs"))?;
                Ok((dir, procs))
            });
        match opened {
            Ok((dir, procs)) => Ok(UnitCgroup { path, dir, procs }),
            Err(e) => {
                let _ = fs::remove_dir(&path);
                Err(e)
            }
        }
    }

    /// Removes this leaderrun's directory (at exit: every unit is gone).
    pub fn remove(&self) {
        let _ = fs::remove_dir(&self.dir);
    }
}

/// Where the cgroup of unit `id` is; the guard uses it too.
pub fn unit_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("u{id}"))
}

/// The cgroup of one unit of processes.
#[derive(Debug)]
pub struct UnitCgroup {
    path: PathBuf,
    /// The cgroup's directory: the child is born in it (`clone3`).
    dir: File,
    /// Its `cgroup.procs`, for a kernel without `CLONE_INTO_CGROUP`: the
    /// child writes itself into it before exec.
    procs: File,
}

impl UnitCgroup {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fds(&self) -> CgroupFds {
        CgroupFds {
            dir: self.dir.as_raw_fd(),
            procs: self.procs.as_raw_fd(),
        }
    }

    /// Whether any process is in the cgroup (zombies are not).
    pub fn populated(&self) -> bool {
        populated(&self.path)
    }

    /// SIGKILL to every process in the cgroup, at once.
    pub fn kill(&self) {
        kill_cgroup(&self.path);
    }

    /// `signal` to every process in the cgroup.
    pub fn signal(&self, signal: Signal) {
        for pid in members(&self.path) {
            let _ = kill(pid, signal);
        }
    }

    /// Removes the cgroup; it must be empty.
    pub fn remove(self) {
        let _ = fs::remove_dir(&self.path);
    }
}

/// Whether any process is in the cgroup at `path`. A cgroup that cannot be
/// read counts as empty: it is gone.
pub fn populated(path: &Path) -> bool {
    fs::read_to_string(path.join("cgroup.events"))
        .is_ok_and(|events| events.lines().any(|line| line == "populated 1"))
}

/// Kills every process in the cgroup at `path`: through `cgroup.kill`
/// (Linux 5.14), else pid by pid until none is left.
pub fn kill_cgroup(path: &Path) {
    let killed = OpenOptions::new()
        .write(true)
        .open(path.join("cgroup.kill"))
        .and_then(|mut file| file.write_all(b"1"));
    if killed.is_ok() {
        return;
    }
    for _ in 0..100 {
        let pids = members(path);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            let _ = kill(pid, Signal::SIGKILL);
        }
    }
}

fn members(path: &Path) -> Vec<Pid> {
    fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .map(Pid::from_raw)
        .collect()
}

struct Mount {
    point: PathBuf,
    /// The root of the mount within the hierarchy ("/" unless a cgroup
    /// namespace or bind mount says otherwise).
    root: String,
}

/// The cgroup2 mount, from /proc/self/mountinfo.
fn cgroup2_mount() -> Option<Mount> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (mount, filesystem) = line.split_once(" - ")?;
        if filesystem.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let fields: Vec<&str> = mount.split_whitespace().collect();
        Some(Mount {
            root: unescape(fields.get(3)?),
            point: unescape(fields.get(4)?).into(),
        })
    })
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|digits| {
            std::str::from_utf8(digits)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape(r"/sys/fs/cgroup\040x"), "/sys/fs/cgroup x");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
