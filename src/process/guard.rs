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
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::mman::{MapFlags, ProtFlags};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use super::cgroup;
use crate::backend::LeaseStore;

pub struct Guard {
    /// leaderrun's end of the pipe: the guard's read returns end-of-file
    /// when the kernel closes it, that is when leaderrun is gone.
    _writer: OwnedFd,
    board: Board,
}

/// What leaderrun tells the guard, in memory the two share: the running
/// terms' tokens, the process groups and the keepers that run. The guard
/// reads it only once leaderrun is gone, so telling it wakes nothing (words
/// on the pipe woke the guard four times a cycle). Every entry is one atomic
/// word, so the guard reads each whole whenever leaderrun died.
struct Board {
    words: NonNull<AtomicU64>,
    /// How many leases: their terms' tokens plus one (0: no term) follow
    /// the two tables' lengths.
    leases: usize,
}

/// Slots for process groups, and as many for keepers: more units than run at
/// once in any replica. Only the slots up to a table's length are ever
/// touched (pages of the map are made as they are first written).
const SLOTS: usize = 1 << 16;

/// A table of pids on the board: its length (how many slots were ever
/// used) and its slots (0: free).
struct Table<'a> {
    len: &'a AtomicU64,
    slots: &'a [AtomicU64],
}

impl Board {
    fn new(leases: usize) -> io::Result<Board> {
        let bytes = Self::size(leases) * std::mem::size_of::<AtomicU64>();
        // SAFETY: a new anonymous mapping, zeroed by the kernel, shared with
        // the guard across the fork and never unmapped (it lives as long as
        // the process); only atomics are ever read from it or written to it.
        let words = unsafe {
            nix::sys::mman::mmap_anonymous(
                None,
                NonZeroUsize::new(bytes).expect("the board is never empty"),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_NORESERVE,
            )?
        };
        Ok(Board {
            words: words.cast(),
            leases,
        })
    }

    fn size(leases: usize) -> usize {
        2 + leases + 2 * SLOTS
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping holds this many words and is never unmapped.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), Self::size(self.leases)) }
    }

    fn terms(&self) -> &[AtomicU64] {
        &self.words()[2..2 + self.leases]
    }

    fn groups(&self) -> Table<'_> {
        self.table(0)
    }

    fn keepers(&self) -> Table<'_> {
        self.table(1)
    }

    /// Table `n`: its length is word `n`, its slots follow the terms.
    fn table(&self, n: usize) -> Table<'_> {
        let words = self.words();
        let first = 2 + self.leases + n * SLOTS;
        Table {
            len: &words[n],
            slots: &words[first..first + SLOTS],
        }
    }
}

impl Table<'_> {
    fn used(&self) -> &[AtomicU64] {
        let len = (self.len.load(Ordering::SeqCst) as usize).min(self.slots.len());
        &self.slots[..len]
    }

    /// Puts `pid` in a free slot, or in a new one (a full table is warned
    /// of: the pid goes unwatched, as with no guard).
    fn add(&self, pid: i32) {
        let reused = self.used().iter().any(|slot| {
            slot.compare_exchange(0, pid as u64, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        if reused {
            return;
        }
        // The slot is written before the length takes it in.
        let next = self.len.load(Ordering::SeqCst) as usize;
        match self.slots.get(next) {
            Some(slot) => {
                slot.store(pid as u64, Ordering::SeqCst);
                self.len.store(next as u64 + 1, Ordering::SeqCst);
            }
            None => tracing::warn!(
                pid,
                "the guard's table is full; this process is not guarded"
            ),
        }
    }

    fn remove(&self, pid: i32) {
        if let Some(slot) = self
            .used()
            .iter()
            .find(|slot| slot.load(Ordering::SeqCst) == pid as u64)
        {
            slot.store(0, Ordering::SeqCst);
        }
    }

    fn listed(&self) -> HashSet<i32> {
        self.used()
            .iter()
            .map(|slot| slot.load(Ordering::SeqCst))
            .filter(|&pid| pid != 0)
            .map(|pid| pid as i32)
            .collect()
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
        let board = Board::new(stores.len())?;
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let devnull = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        // What the guard keeps open (the pipe's read end, the lease stores'
        // descriptors, by their numbers: the stores refer to them so),
        // found here: the guard itself should write no memory before
        // leaderrun is gone (see guard_main).
        let mut keep: Vec<RawFd> = stores
            .iter()
            .chain(&membership)
            .flat_map(|store| store.keep_fds())
            .chain([reader.as_raw_fd()])
            .collect();
        keep.sort_unstable();
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
            0 => guard_main(
                reader.as_raw_fd(),
                devnull.as_raw_fd(),
                &keep,
                charge,
                &board,
            ),
            _ => {
                drop(reader);
                drop(charge);
                Ok(Guard {
                    _writer: writer,
                    board,
                })
            }
        }
    }

    /// The process group `pgid` runs: kill it if leaderrun dies.
    pub fn watch(&self, pgid: Pid) {
        self.board.groups().add(pgid.as_raw());
    }

    /// The group `pgid` is gone: forget it.
    pub fn unwatch(&self, pgid: Pid) {
        self.board.groups().remove(pgid.as_raw());
    }

    /// A keeper runs (it kills its unit when leaderrun dies; the guard
    /// waits for it before a release), or is gone.
    pub fn keeper(&self, pid: Pid, running: bool) {
        if running {
            self.board.keepers().add(pid.as_raw());
        } else {
            self.board.keepers().remove(pid.as_raw());
        }
    }

    /// A term of lease `lease` began with `token`, or (None) is over.
    pub fn term(&self, lease: u32, token: Option<u64>) {
        if let Some(term) = self.board.terms().get(lease as usize) {
            term.store(token.map_or(0, |token| token + 1), Ordering::SeqCst);
        }
    }
}

/// The guard, from the fork on. Until leaderrun is gone it writes as little
/// memory as it can: every page it writes is a copy-on-write fault, on the
/// core that leaderrun's command is starting on.
fn guard_main(reader: RawFd, devnull: RawFd, keep: &[RawFd], charge: Charge, board: &Board) -> ! {
    // SAFETY: system calls on descriptors this process owns.
    unsafe {
        libc::setsid();
        for fd in 0..3 {
            libc::dup2(devnull, fd);
        }
        // Keep nothing else: a guard holding the pipe's write end would
        // never see end-of-file, and one holding an inherited socket would
        // keep it open.
        close_all_but(keep);
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
    // Nothing is ever written to the pipe: the read returns at its end.
    let mut buf = [0u8; 16];
    loop {
        // SAFETY: reading into a buffer we own from our own descriptor.
        let n = unsafe { libc::read(reader, buf.as_mut_ptr().cast(), buf.len()) };
        if n == 0 || (n < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)) {
            break;
        }
    }
    let groups = board.groups().listed();
    let keepers = board.keepers().listed();
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
    let running: Vec<(usize, u64)> = board
        .terms()
        .iter()
        .map(|term| term.load(Ordering::SeqCst))
        .enumerate()
        .filter(|&(_, term)| term != 0)
        .map(|(lease, term)| (lease, term - 1))
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

/// Closes every descriptor above 2 but those in `kept` (sorted): one
/// `close_range` per gap between them, no listing of /proc/self/fd (which
/// allocates) but where the kernel has no `close_range` (before 5.9).
fn close_all_but(kept: &[RawFd]) {
    let mut first: RawFd = 3;
    for &fd in kept {
        if fd > first {
            close_range(first, fd - 1);
        }
        first = first.max(fd + 1);
    }
    close_range(first, RawFd::MAX);
}

/// Closes the descriptors `first..=last`.
fn close_range(first: RawFd, last: RawFd) {
    // SAFETY: closes descriptors of this process that nothing in it uses.
    if unsafe { libc::close_range(first as libc::c_uint, last as libc::c_uint, 0) } == 0 {
        return;
    }
    for fd in open_descriptors() {
        if (first..=last).contains(&fd) {
            // SAFETY: as above.
            unsafe { libc::close(fd) };
        }
    }
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
    fn the_board_lists_what_runs() {
        let board = Board::new(2).unwrap();
        board.groups().add(42);
        board.groups().add(43);
        board.keepers().add(7);
        board.groups().remove(42);
        assert_eq!(board.groups().listed(), [43].into());
        // A freed slot is used again before the table grows.
        board.groups().add(44);
        assert_eq!(board.groups().used().len(), 2);
        assert_eq!(board.groups().listed(), [43, 44].into());
        assert_eq!(board.keepers().listed(), [7].into());
        board.terms()[1].store((1 << 53) + 1, Ordering::SeqCst);
        assert_eq!(board.terms()[0].load(Ordering::SeqCst), 0);
        assert_eq!(board.terms()[1].load(Ordering::SeqCst) - 1, 1 << 53);
    }
}
