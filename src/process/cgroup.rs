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

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::os::unix::fs::{FileExt as _, OpenOptionsExt};

use nix::sys::signal::{Signal, kill};
use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, statfs};
use nix::unistd::Pid;

use super::spawn::CgroupFds;
use super::tree::alive;

/// How every unit cgroup's name starts: `leaderrun-<pid>-u<n>`.
const UNIT_NAME: &str = "leaderrun-";

/// This leaderrun's directory of unit cgroups.
#[derive(Debug, Clone)]
pub struct Cgroups {
    /// leaderrun's own cgroup, where the units' cgroups are made.
    parent: PathBuf,
    /// `leaderrun-<pid>-`: the name of every unit cgroup of this leaderrun
    /// starts with it (the guard removes them all by it).
    prefix: String,
    next_id: Arc<AtomicU64>,
    /// A unit cgroup made ahead of need (at setup, and while following), so
    /// that making one is not on the critical path of a handover.
    prepared: Arc<Mutex<Option<UnitCgroup>>>,
}

impl Cgroups {
    /// Finds the cgroup2 hierarchy and this process's cgroup in it, and
    /// makes the first unit's cgroup there (which proves it can). Says why
    /// not, if it cannot.
    pub fn setup() -> Result<Cgroups, String> {
        // One read: a growing buffer would read the file in seven (the
        // kernel makes it anew for each).
        let mut own = String::with_capacity(4096);
        File::open("/proc/self/cgroup")
            .and_then(|mut file| file.read_to_string(&mut own))
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let path = own
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
            .ok_or("this process is in no cgroup2 cgroup")?;
        let parent = usual_place(path)
            .or_else(|| {
                let mount = cgroup2_mount()?;
                let relative = path.strip_prefix(&mount.root).unwrap_or(path);
                Some(mount.point.join(relative.trim_start_matches('/')))
            })
            .ok_or("no cgroup2 hierarchy is mounted")?;
        let cgroups = Cgroups {
            parent,
            prefix: format!("{UNIT_NAME}{}-", std::process::id()),
            next_id: Arc::new(AtomicU64::new(1)),
            prepared: Arc::default(),
        };
        let first = cgroups.make().map_err(|e| {
            format!(
                "cannot create a cgroup in {}: {e}",
                cgroups.parent.display()
            )
        })?;
        *cgroups.prepared.lock().unwrap() = Some(first);
        Ok(cgroups)
    }

    /// Where the units' cgroups are, and how their names start.
    pub fn place(&self) -> (&Path, &str) {
        (&self.parent, &self.prefix)
    }

    /// The cgroup for a new unit: the prepared one, or a new one.
    pub fn unit(&self) -> io::Result<UnitCgroup> {
        let prepared = self.prepared.lock().unwrap().take();
        match prepared {
            Some(unit) => Ok(unit),
            None => self.make(),
        }
    }

    /// Makes the next unit's cgroup now, while nothing waits for it.
    pub fn prepare(&self) {
        let mut prepared = self.prepared.lock().unwrap();
        if prepared.is_none() {
            *prepared = self.make().ok();
        }
    }

    fn make(&self) -> io::Result<UnitCgroup> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let path = self.parent.join(format!("{}u{id}", self.prefix));
        fs::create_dir(&path)?;
        let opened = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&path)
            .and_then(|dir| {
                let procs = OpenOptions::new()
                    .write(true)
                    .open(path.join("cgroup.procs"))?;
                let events = File::open(path.join("cgroup.events"))?;
                Ok((dir, procs, events))
            });
        match opened {
            Ok((dir, procs, events)) => Ok(UnitCgroup {
                path,
                dir,
                procs,
                events,
            }),
            Err(e) => {
                let _ = fs::remove_dir(&path);
                Err(e)
            }
        }
    }

    /// Removes every unit cgroup of this leaderrun's that is left (at exit,
    /// when no guard does it).
    pub fn remove(&self) {
        if let Some(unit) = self.prepared.lock().unwrap().take() {
            unit.remove();
        }
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(5);
        kill_and_remove(&self.parent, &self.prefix, give_up);
    }
}

/// Kills every cgroup under `parent` whose name starts with `prefix`, and
/// removes them once they are empty, waiting until `give_up` at most.
/// Returns whether they all emptied.
pub fn kill_and_remove(parent: &Path, prefix: &str, give_up: std::time::Instant) -> bool {
    let units: Vec<PathBuf> = fs::read_dir(parent)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    for unit in &units {
        kill_cgroup(unit);
    }
    let mut emptied = true;
    for unit in &units {
        while populated(unit) {
            if std::time::Instant::now() >= give_up {
                emptied = false;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _ = fs::remove_dir(unit);
    }
    emptied
}

/// Removes the empty unit cgroups under `parent` that leaderruns gone
/// together with their guards left behind (a `kill -9` of both, the OOM
/// killer taking a whole group): those named `leaderrun-<pid>-u<n>`, other
/// than `own_prefix`'s, whose pid is no live process (a zombie is none)
/// and none of this cgroup's.
/// One with processes in it stays as it is (`rmdir` refuses it, and
/// nothing is killed), and nothing is removed while this cgroup holds a
/// process of another pid namespace, whose pids mean nothing here.
pub fn remove_stale(parent: &Path, own_prefix: &str) {
    let members = || -> Option<HashSet<i32>> {
        let text = fs::read_to_string(parent.join("cgroup.procs")).ok()?;
        let pids: HashSet<i32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        // Another namespace's processes are listed as pid 0.
        (!pids.contains(&0)).then_some(pids)
    };
    let Some(members_before) = members() else {
        return;
    };
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    let stale: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            !name.starts_with(own_prefix)
                && unit_owner(&name)
                    .is_some_and(|pid| !members_before.contains(&pid) && !alive(pid))
        })
        .map(|entry| entry.path())
        .collect();
    // A leaderrun of another pid namespace may have started meanwhile.
    if stale.is_empty() || members().is_none() {
        return;
    }
    for unit in stale {
        let _ = fs::remove_dir(unit);
    }
}

/// The pid in a unit cgroup's name, `leaderrun-<pid>-u<n>`.
fn unit_owner(name: &str) -> Option<i32> {
    let (pid, unit) = name.strip_prefix(UNIT_NAME)?.split_once('-')?;
    unit.strip_prefix('u')?.parse::<u64>().ok()?;
    pid.parse().ok().filter(|&pid| pid > 0)
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
    /// Its `cgroup.events`, opened with the cgroup (while nothing waits for
    /// it): the check that a term's processes are all gone, on the way to
    /// a release, is then one read instead of a path's walk, an open and a
    /// close.
    events: File,
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
        // A read at offset 0 makes the file's text anew.
        let mut text = [0u8; 256];
        self.events
            .read_at(&mut text, 0)
            .is_ok_and(|n| says_populated(&text[..n]))
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
    fs::read(path.join("cgroup.events")).is_ok_and(|events| says_populated(&events))
}

/// Whether the text of a `cgroup.events` says a process is in the cgroup.
fn says_populated(events: &[u8]) -> bool {
    events
        .split(|&b| b == b'\n')
        .any(|line| line == b"populated 1")
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

/// Where systemd and container runtimes mount cgroup2 (hybrid hosts under
/// `unified/`), with the hierarchy's root at the mount: this process's
/// cgroup there, if one of them is a cgroup2 mount and holds the cgroup. Two
/// `statfs` calls instead of reading the whole mount table on every start.
/// (Where a mount's root is not the hierarchy's, the path is not there and
/// the mount table says where it is; and were it there by chance, it would
/// still be inside what this process can see of the hierarchy.)
fn usual_place(own: &str) -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .find(|point| statfs(*point).is_ok_and(|fs| fs.filesystem_type() == CGROUP2_SUPER_MAGIC))
        .map(|point| Path::new(point).join(own.trim_start_matches('/')))
        .filter(|parent| parent.is_dir())
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
