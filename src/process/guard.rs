//! The guard: if leaderrun is killed outright (SIGKILL, the OOM killer, a
//! panic), when no code of leaderrun's runs any more, it kills every unit of
//! processes and then hands the lease over.
//!
//! `PR_SET_PDEATHSIG` kills only a direct child; what it started would be
//! orphaned. The guard is a tiny process, forked before the runtime starts
//! (while leaderrun has one thread, so it may run ordinary code) and
//! detached from leaderrun (its own session), that blocks on a
//! pipe whose only writer is leaderrun: the read returns end-of-file the
//! moment the kernel tears leaderrun down. Then it
//!
//! 1. kills every process group it was told about and, with cgroups, every
//!    cgroup of leaderrun's (which also reaches processes that left their
//!    group or session); keepers, which see the same end-of-file, do the same
//!    for their units;
//! 2. waits until they are all gone: the cgroups empty, the keepers exited;
//! 3. releases the lease of a term that was running, with the term's token
//!    and leaderrun's own lease store (its copy of it, made at the fork), so
//!    the next replica takes over within milliseconds instead of waiting out
//!    the ttl. The release only happens if this replica still holds the
//!    lease with that token; a host that dies takes the guard with it, and
//!    then the lease lapses at its expiry.
//!
//! On the file backend the guard keeps leaderrun's descriptor of the lease
//! file: the holder's lock on its token lives on until the guard releases,
//! so no follower takes over before the old term's processes are dead.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use super::cgroup;
use crate::backend::LeaseStore;

pub struct Guard {
    writer: OwnedFd,
}

/// What leaderrun tells the guard: 12-byte frames, a tag and two words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Word {
    /// A process group runs (a unit's program): kill it if leaderrun dies.
    Watch(i32),
    Unwatch(i32),
    /// A keeper runs: wait for it to exit (it kills its unit) before the
    /// release.
    Keeper(i32),
    KeeperGone(i32),
    /// A term of lease `lease` began with this token.
    Term {
        lease: u32,
        token: u64,
    },
    /// The term of lease `lease` is over (released, or lost).
    TermOver(u32),
}

const FRAME: usize = 16;

impl Word {
    fn encode(self) -> [u8; FRAME] {
        let (tag, a, b): (u32, u32, u64) = match self {
            Word::Watch(pgid) => (1, pgid as u32, 0),
            Word::Unwatch(pgid) => (2, pgid as u32, 0),
            Word::Keeper(pid) => (3, pid as u32, 0),
            Word::KeeperGone(pid) => (4, pid as u32, 0),
            Word::Term { lease, token } => (5, lease, token),
            Word::TermOver(lease) => (6, lease, 0),
        };
        let mut bytes = [0u8; FRAME];
        bytes[0..4].copy_from_slice(&tag.to_ne_bytes());
        bytes[4..8].copy_from_slice(&a.to_ne_bytes());
        bytes[8..16].copy_from_slice(&b.to_ne_bytes());
        bytes
    }

    fn decode(bytes: &[u8; FRAME]) -> Option<Word> {
        let tag = u32::from_ne_bytes(bytes[0..4].try_into().unwrap());
        let a = u32::from_ne_bytes(bytes[4..8].try_into().unwrap());
        let b = u64::from_ne_bytes(bytes[8..16].try_into().unwrap());
        Some(match tag {
            1 => Word::Watch(a as i32),
            2 => Word::Unwatch(a as i32),
            3 => Word::Keeper(a as i32),
            4 => Word::KeeperGone(a as i32),
            5 => Word::Term { lease: a, token: b },
            6 => Word::TermOver(a),
            _ => return None,
        })
    }
}

/// What the guard acts on when leaderrun dies.
struct Charge {
    /// With cgroups: their parent directory and the prefix of their names.
    cgroups: Option<(PathBuf, String)>,
    /// The lease stores, by lease number, as they were at the fork.
    stores: Vec<Arc<dyn LeaseStore>>,
    /// Shard mode: the replica's membership record, withdrawn before the
    /// shards are released, so the replica a release wakes sees it gone.
    membership: Option<Arc<dyn LeaseStore>>,
}

impl Guard {
    /// Starts the guard. With `cgroups` (a parent directory and a name
    /// prefix), it also kills every cgroup there whose name starts with the
    /// prefix; with `stores`, it releases the lease of a running term after
    /// the term's processes are gone. Must run while the process has a
    /// single thread.
    pub fn start(
        cgroups: Option<(&Path, &str)>,
        stores: Vec<Arc<dyn LeaseStore>>,
        membership: Option<Arc<dyn LeaseStore>>,
    ) -> io::Result<Guard> {
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let devnull = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        let charge = Charge {
            cgroups: cgroups.map(|(parent, prefix)| (parent.to_path_buf(), prefix.to_owned())),
            stores,
            membership,
        };
        // SAFETY: the process is single-threaded here (documented contract),
        // so the forked child may run arbitrary code. One fork, not the
        // daemon's two: waiting for an intermediate process to fork and exit
        // cost every start 0.15 ms. The guard stays leaderrun's child, in a
        // session of its own (no terminal signal reaches it); it exits only
        // after leaderrun is gone, so there is never a guard to reap.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => guard_main(reader.as_raw_fd(), devnull.as_raw_fd(), charge),
            _ => {
                drop(reader);
                drop(charge);
                Ok(Guard { writer })
            }
        }
    }

    /// The process group `pgid` runs: kill it if leaderrun dies.
    pub fn watch(&self, pgid: Pid) {
        self.tell(Word::Watch(pgid.as_raw()));
    }

    /// The group `pgid` is gone: forget it.
    pub fn unwatch(&self, pgid: Pid) {
        self.tell(Word::Unwatch(pgid.as_raw()));
    }

    /// A keeper runs, or is gone.
    pub fn keeper(&self, pid: Pid, running: bool) {
        self.tell(if running {
            Word::Keeper(pid.as_raw())
        } else {
            Word::KeeperGone(pid.as_raw())
        });
    }

    /// A term of lease `lease` began with `token`, or (None) is over.
    pub fn term(&self, lease: u32, token: Option<u64>) {
        self.tell(match token {
            Some(token) => Word::Term { lease, token },
            None => Word::TermOver(lease),
        });
    }

    fn tell(&self, word: Word) {
        // A 16-byte write to a pipe is atomic and the guard drains it at once.
        let _ = nix::unistd::write(&self.writer, &word.encode());
    }
}

fn guard_main(reader: RawFd, devnull: RawFd, charge: Charge) -> ! {
    let keep: Vec<RawFd> = charge
        .stores
        .iter()
        .chain(&charge.membership)
        .flat_map(|store| store.keep_fds())
        .collect();
    // SAFETY: system calls on descriptors this process owns.
    unsafe {
        libc::setsid();
        for fd in 0..3 {
            libc::dup2(devnull, fd);
        }
        // Keep the pipe's read end and the lease stores' descriptors, and
        // nothing else: a guard holding the write end would never see
        // end-of-file, and one holding an inherited socket would keep it
        // open. The stores' descriptors keep their numbers (the stores refer
        // to them by number).
        for fd in open_descriptors() {
            if fd > 2 && fd != reader && !keep.contains(&fd) {
                libc::close(fd);
            }
        }
        for signal in [
            libc::SIGHUP,
            libc::SIGINT,
            libc::SIGQUIT,
            libc::SIGTERM,
            libc::SIGUSR1,
            libc::SIGUSR2,
            libc::SIGPIPE,
            libc::SIGTSTP,
            libc::SIGTTIN,
            libc::SIGTTOU,
        ] {
            libc::signal(signal, libc::SIG_IGN);
        }
        libc::prctl(libc::PR_SET_NAME, c"leaderrun-guard".as_ptr());
    }
    let mut groups: HashSet<i32> = HashSet::new();
    let mut keepers: HashSet<i32> = HashSet::new();
    let mut terms: Vec<Option<u64>> = vec![None; charge.stores.len()];
    let mut buf = [0u8; FRAME];
    loop {
        // SAFETY: reading into a buffer we own from our own descriptor.
        let n = unsafe { libc::read(reader, buf.as_mut_ptr().cast(), FRAME) };
        if n == FRAME as isize {
            match Word::decode(&buf) {
                Some(Word::Watch(pgid)) => {
                    groups.insert(pgid);
                }
                Some(Word::Unwatch(pgid)) => {
                    groups.remove(&pgid);
                }
                Some(Word::Keeper(pid)) => {
                    keepers.insert(pid);
                }
                Some(Word::KeeperGone(pid)) => {
                    keepers.remove(&pid);
                }
                Some(Word::Term { lease, token }) => {
                    if let Some(term) = terms.get_mut(lease as usize) {
                        *term = Some(token);
                    }
                }
                Some(Word::TermOver(lease)) => {
                    if let Some(term) = terms.get_mut(lease as usize) {
                        *term = None;
                    }
                }
                None => {}
            }
        } else if n == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    // leaderrun is gone: nothing of its terms may run on.
    for &pgid in &groups {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
    let give_up = Instant::now() + Duration::from_secs(5);
    let mut cleared = true;
    if let Some((parent, prefix)) = &charge.cgroups {
        cleared &= cgroup::kill_and_remove(parent, prefix, give_up);
    }
    // Keepers kill their units and exit once nothing is left.
    while keepers.iter().any(|&pid| alive(pid)) {
        if Instant::now() >= give_up {
            cleared = false;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let running: Vec<(usize, u64)> = terms
        .iter()
        .enumerate()
        .filter_map(|(lease, token)| token.map(|t| (lease, t)))
        .collect();
    if cleared && (!running.is_empty() || charge.membership.is_some()) {
        release(&charge, &running);
    }
    // SAFETY: ends this process without running the parent's exit handlers.
    unsafe { libc::_exit(0) }
}

/// Releases the lease of each running term, on a runtime of the guard's own;
/// in shard mode, withdraws the replica's membership record first.
fn release(charge: &Charge, running: &[(usize, u64)]) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    runtime.block_on(async {
        if let Some(membership) = &charge.membership {
            let _ = membership.withdraw().await;
        }
        // Each store bounds its call; a failure only means the lease lapses
        // at its expiry, as it would have without the guard.
        futures_util::future::join_all(
            running
                .iter()
                .map(|&(lease, token)| charge.stores[lease].release(token)),
        )
        .await;
    });
    runtime.shutdown_background();
}

/// Whether `pid` is a live process (not gone, not a zombie).
fn alive(pid: i32) -> bool {
    if kill(Pid::from_raw(pid), None).is_err() {
        return false;
    }
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, Some("Z") | Some("X") | None)
    })
}

/// This process's open descriptors.
fn open_descriptors() -> Vec<RawFd> {
    std::fs::read_dir("/proc/self/fd")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for word in [
            Word::Watch(42),
            Word::Unwatch(42),
            Word::Keeper(7),
            Word::KeeperGone(7),
            Word::Term {
                lease: 3,
                token: (1 << 53) - 1,
            },
            Word::TermOver(3),
        ] {
            assert_eq!(Word::decode(&word.encode()), Some(word));
        }
    }
}
