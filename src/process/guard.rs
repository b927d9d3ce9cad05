//! The guard: if leaderrun is killed outright (SIGKILL, the OOM killer, a
//! panic), when no code of leaderrun's runs any more, it kills every unit of
//! processes and then hands the lease over.
//!
//! `PR_SET_PDEATHSIG` kills only a direct child; what it started would be
//! orphaned. The guard is a small process of leaderrun's binary, started at
//! startup (cloned with `CLONE_VM`, as `posix_spawn` does, and exec'd at
//! once, while leaderrun goes on: no fork copies leaderrun's memory) with
//! leaderrun's own command line and environment and [`GUARD_ENV`] saying
//! what it stands in for. It blocks, in a session of its own, on a pipe whose
//! only writer is leaderrun: the read returns end-of-file the moment the
//! kernel tears leaderrun down. Then ([`Aftermath`]) it
//!
//! 1. kills every process group it was told about and, with cgroups, every
//!    cgroup of leaderrun's (which also reaches processes that left their
//!    group or session); keepers, which see the same end-of-file, do the same
//!    for their units;
//! 2. waits until they are all gone: the cgroups empty, the keepers exited;
//! 3. releases the lease of a term that was running, with the term's token,
//!    through lease stores made from the same command line, as leaderrun's
//!    replica (its identity passed on), so the next replica takes over
//!    within milliseconds instead of waiting out the ttl. The release only
//!    happens if this replica still holds the lease with that token; a host
//!    that dies takes the guard with it, and then the lease lapses at its
//!    expiry.
//!
//! The guard shares nothing with leaderrun after its exec but the pipe and a
//! board of atomic words (a memfd both map), so the OOM killer, which kills
//! every process sharing its victim's memory, spares it. Forking it instead
//! cost every run 0.25 ms: the copy of leaderrun's page tables and the
//! copy-on-write faults after it. A second, smaller process does share
//! leaderrun's memory, and nothing else: the keeper of its memory
//! (`leaderrun-exit`), which holds it until leaderrun is gone and then lets
//! it go, so that leaderrun's exit does not wait for the memory's teardown.
//!
//! On the file backend the guard keeps leaderrun's descriptors of the lease
//! file, through the exec: the holder's lock on its token lives on until the
//! guard releases, so no follower takes over before the old term's processes
//! are dead.

use std::collections::HashSet;
use std::ffi::{CString, OsString};
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::mman::{MapFlags, ProtFlags};
use nix::unistd::Pid;

use super::cgroup;
use super::tree::alive;
use crate::backend::{Identity, LeaseStore};

/// Set in the environment of the guard's exec: what it stands in for.
pub const GUARD_ENV: &str = "LEADERRUN_GUARD";

pub struct Guard {
    /// leaderrun's end of the pipe, never closed: the guard's read returns
    /// end-of-file when the kernel closes it, that is when leaderrun is gone
    /// (and not earlier, on a normal exit: the guard's work would compete
    /// with leaderrun's last steps).
    _writer: RawFd,
    board: Board,
    /// The guard process: leaderrun's child, which exits only after
    /// leaderrun is gone, so its pid names it as long as leaderrun runs.
    pid: libc::pid_t,
}

/// What leaderrun tells the guard, in memory the two share: the running
/// terms' tokens, the process groups and the keepers that run. The guard
/// reads it only once leaderrun is gone, so telling it wakes nothing (words
/// on the pipe woke the guard four times a cycle). Every entry is one atomic
/// word, so the guard reads each whole whenever leaderrun died. The memory is
/// a memfd's, so that the guard's exec maps it again.
struct Board {
    words: Words,
    fd: OwnedFd,
}

/// The board's words, where they are mapped.
#[derive(Clone, Copy)]
struct Words {
    first: NonNull<AtomicU64>,
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
        let fd = nix::sys::memfd::memfd_create(
            c"leaderrun-guard",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )?;
        nix::unistd::ftruncate(&fd, Self::bytes(leases) as libc::off_t)?;
        let board = Self::map(fd, leases)?;
        // The first page (the table lengths, the first terms and slots) is
        // made now: made by a term's first write, it cost a follower's
        // handover a page fault on its way to the spawn.
        board.words.words()[0].store(0, Ordering::SeqCst);
        Ok(board)
    }

    fn size(leases: usize) -> usize {
        2 + leases + 2 * SLOTS
    }

    fn bytes(leases: usize) -> usize {
        Self::size(leases) * std::mem::size_of::<AtomicU64>()
    }

    /// The board of `fd`, as the guard's exec finds it.
    fn map(fd: OwnedFd, leases: usize) -> io::Result<Board> {
        // SAFETY: a shared mapping of a memfd of this size (zero where never
        // written), never unmapped (it lives as long as the process); only
        // atomics are ever read from it or written to it.
        let words = unsafe {
            nix::sys::mman::mmap(
                None,
                NonZeroUsize::new(Self::bytes(leases)).expect("the board is never empty"),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_NORESERVE,
                &fd,
                0,
            )?
        };
        Ok(Board {
            words: Words {
                first: words.cast(),
                leases,
            },
            fd,
        })
    }
}

impl Words {
    fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping holds this many words and is never unmapped.
        unsafe { std::slice::from_raw_parts(self.first.as_ptr(), Board::size(self.leases)) }
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

/// What the guard's exec is told (in [`GUARD_ENV`]): where the board is,
/// whose replica it stands in for, the descriptors each lease store had,
/// and leaderrun's cgroups.
#[derive(Debug, Clone, PartialEq)]
struct Setting {
    /// The pipe's read end: end-of-file when leaderrun is gone.
    reader: RawFd,
    board: RawFd,
    leases: usize,
    pid: u32,
    instance: String,
    since_ms: u64,
    /// By lease number: the descriptors its store keeps (`LeaseStore::keep_fds`).
    fds: Vec<Vec<RawFd>>,
    /// With cgroups: their parent directory and the prefix of their names.
    cgroups: Option<(PathBuf, String)>,
}

/// How many space-separated fields come before a setting's cgroup parent,
/// which is the rest of it, spaces and all.
const FIELDS: usize = 8;

impl Setting {
    /// `READER BOARD LEASES PID INSTANCE SINCE FDS PREFIX PARENT`: FDS is each
    /// store's descriptors, comma-separated, the stores `/`-separated (`-`
    /// for none); PREFIX and PARENT `-` without cgroups.
    fn encode(&self) -> OsString {
        let fds: Vec<String> = self
            .fds
            .iter()
            .map(|fds| match fds.as_slice() {
                [] => "-".to_owned(),
                fds => fds
                    .iter()
                    .map(RawFd::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            })
            .collect();
        let mut setting = OsString::from(format!(
            "{} {} {} {} {} {} {} ",
            self.reader,
            self.board,
            self.leases,
            self.pid,
            self.instance,
            self.since_ms,
            fds.join("/"),
        ));
        match &self.cgroups {
            Some((parent, prefix)) => {
                setting.push(prefix);
                setting.push(" ");
                setting.push(parent);
            }
            None => setting.push("- -"),
        }
        setting
    }

    fn decode(setting: &[u8]) -> Option<Setting> {
        let mut fields = setting.splitn(FIELDS + 1, |b| *b == b' ');
        let mut text = || std::str::from_utf8(fields.next()?).ok();
        let reader = text()?.parse().ok()?;
        let board = text()?.parse().ok()?;
        let leases = text()?.parse().ok()?;
        let pid = text()?.parse().ok()?;
        let instance = text()?.to_owned();
        let since_ms = text()?.parse().ok()?;
        let fds = text()?
            .split('/')
            .map(|fds| match fds {
                "-" => Some(Vec::new()),
                fds => fds.split(',').map(|fd| fd.parse().ok()).collect(),
            })
            .collect::<Option<Vec<_>>>()?;
        let prefix = text()?.to_owned();
        let parent = PathBuf::from(std::ffi::OsStr::from_bytes(fields.next()?));
        let cgroups = (prefix != "-").then_some((parent, prefix));
        (fds.len() == leases).then_some(Setting {
            reader,
            board,
            leases,
            pid,
            instance,
            since_ms,
            fds,
            cgroups,
        })
    }
}

/// Everything the guard reads between the clone and the exec, made before
/// the clone and never freed or written again: until its exec the guard
/// shares leaderrun's memory, and may not allocate.
struct Launch {
    devnull: RawFd,
    /// Sorted: what the exec keeps (the pipe's read end, the board, the
    /// stores' descriptors).
    keep: Vec<RawFd>,
    exe: CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
}

/// The guard's stack: it only makes system calls.
const GUARD_STACK: usize = 64 * 1024;

impl Guard {
    /// Starts the guard. With `cgroups` (a parent directory and a name
    /// prefix), it also kills every cgroup there whose name starts with the
    /// prefix; for each of `stores` (by lease number; in shard mode the
    /// first is the membership record), it releases the lease of a running
    /// term once the term's processes are gone, as replica `me`.
    pub fn start(
        cgroups: Option<(&Path, &str)>,
        stores: &[Arc<dyn LeaseStore>],
        me: &Identity,
    ) -> io::Result<Guard> {
        let board = Board::new(stores.len())?;
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let devnull = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        let fds: Vec<Vec<RawFd>> = stores.iter().map(|store| store.keep_fds()).collect();
        let mut keep: Vec<RawFd> = fds
            .iter()
            .flatten()
            .copied()
            .chain([board.fd.as_raw_fd(), reader.as_raw_fd()])
            .collect();
        keep.sort_unstable();
        keep.dedup();
        let setting = Setting {
            reader: reader.as_raw_fd(),
            board: board.fd.as_raw_fd(),
            leases: stores.len(),
            pid: me.pid,
            instance: me.instance.clone(),
            since_ms: me.since_ms,
            fds,
            cgroups: cgroups.map(|(parent, prefix)| (parent.to_path_buf(), prefix.to_owned())),
        };
        let c = |bytes: &[u8]| CString::new(bytes).map_err(|_| io::ErrorKind::InvalidInput);
        let mut assignment = OsString::from(format!("{GUARD_ENV}="));
        assignment.push(setting.encode());
        let argv = std::env::args_os()
            .map(|arg| c(arg.as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        let envp = std::env::vars_os()
            .filter(|(name, _)| name != GUARD_ENV)
            .map(|(mut pair, value)| {
                pair.push("=");
                pair.push(value);
                c(pair.as_bytes())
            })
            .chain([c(assignment.as_bytes())])
            .collect::<Result<Vec<_>, _>>()?;
        // The strings are leaked with the launch: the guard reads them until
        // its exec, while leaderrun runs on.
        let pointers = |strings: Vec<CString>| -> Vec<*const libc::c_char> {
            strings
                .into_iter()
                .map(|s| s.into_raw().cast_const())
                .chain([std::ptr::null()])
                .collect()
        };
        let launch: &'static Launch = Box::leak(Box::new(Launch {
            devnull: devnull.as_raw_fd(),
            keep,
            exe: c(b"/proc/self/exe")?,
            argv: pointers(argv),
            envp: pointers(envp),
        }));
        // SAFETY: until its exec the guard runs `guard_main` on its own
        // stack, reads only the leaked launch and allocates nothing. The
        // guard stays leaderrun's child, in a session of its own (no
        // terminal signal reaches it); it exits only after leaderrun is
        // gone, so there is never a guard to reap.
        let pid = unsafe { clone_vm(guard_main, (launch as *const Launch).cast()) }?;
        // SAFETY: as for the guard; the keeper of leaderrun's memory reads
        // only the pipe's read end, passed as the argument itself. Without
        // it leaderrun only exits a little slower.
        let reader_fd = reader.as_raw_fd() as usize as *const libc::c_void;
        let _ = unsafe { clone_vm(memory_keeper_main, reader_fd) };
        // The guard has copies of these in a descriptor table of its own.
        drop((reader, devnull));
        Ok(Guard {
            _writer: writer.into_raw_fd(),
            board,
            pid,
        })
    }

    /// Lowers the guard's scheduling priority to the least: leaderrun's run
    /// is over, its lease released, and all the guard will do is exit after
    /// it (which is work, the teardown of a process) while the next
    /// leader's command may be starting on this host.
    pub fn lower_priority(&self) {
        // SAFETY: setpriority only changes the nice value of our child.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, self.pid as libc::id_t, 19) };
    }

    /// The process group `pgid` runs: kill it if leaderrun dies.
    pub fn watch(&self, pgid: Pid) {
        self.board.words.groups().add(pgid.as_raw());
    }

    /// The group `pgid` is gone: forget it.
    pub fn unwatch(&self, pgid: Pid) {
        self.board.words.groups().remove(pgid.as_raw());
    }

    /// A keeper runs (it kills its unit when leaderrun dies; the guard
    /// waits for it before a release), or is gone.
    pub fn keeper(&self, pid: Pid, running: bool) {
        if running {
            self.board.words.keepers().add(pid.as_raw());
        } else {
            self.board.words.keepers().remove(pid.as_raw());
        }
    }

    /// A term of lease `lease` began with `token`, or (None) is over.
    pub fn term(&self, lease: u32, token: Option<u64>) {
        if let Some(term) = self.board.words.terms().get(lease as usize) {
            term.store(token.map_or(0, |token| token + 1), Ordering::SeqCst);
        }
    }
}

/// The guard, from the clone to its exec: it shares leaderrun's memory
/// while leaderrun runs on, so it makes system calls only, allocates
/// nothing, writes nothing but its own stack (and errno, if a call failed).
extern "C" fn guard_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the leaked Launch; every call below is a plain
    // system call on this process's own descriptors.
    unsafe {
        let launch = &*(arg as *const Launch);
        libc::setsid();
        for fd in 0..3 {
            libc::dup2(launch.devnull, fd);
        }
        // Keep nothing else: a guard holding the pipe's write end would
        // never see end-of-file, and one holding an inherited socket would
        // keep it open.
        close_all_but(&launch.keep);
        for &fd in &launch.keep {
            libc::fcntl(fd, libc::F_SETFD, 0);
        }
        // Ignored through the exec.
        for signal in IGNORED {
            libc::signal(signal, libc::SIG_IGN);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(
            launch.exe.as_ptr(),
            launch.argv.as_ptr(),
            launch.envp.as_ptr(),
        );
        libc::_exit(127)
    }
}

/// Starts `main(arg)` in a process that shares this one's memory, on a
/// leaked stack of its own. All signals are blocked across the clone, so
/// that no handler of leaderrun's runs in the new process.
///
/// # Safety
///
/// `main` may only make system calls and read what `arg` points to, which
/// must live as long as the process: it runs beside leaderrun's threads.
unsafe fn clone_vm(
    main: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *const libc::c_void,
) -> io::Result<libc::pid_t> {
    let stack = Vec::<std::mem::MaybeUninit<u128>>::with_capacity(GUARD_STACK / 16)
        .leak()
        .as_mut_ptr();
    // SAFETY: see above; the stack is leaked, so it outlives the process.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        let pid = libc::clone(
            main,
            stack.cast::<u8>().add(GUARD_STACK).cast(),
            libc::CLONE_VM | libc::SIGCHLD,
            arg.cast_mut(),
        );
        let error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut());
        if pid == -1 { Err(error) } else { Ok(pid) }
    }
}

/// The keeper of leaderrun's memory: it shares it, so that leaderrun's exit
/// does not wait for the kernel to tear it down (a tenth of a millisecond
/// and more): this process does it once it sees leaderrun gone. It holds
/// nothing but the pipe's read end. The OOM killer kills it with leaderrun
/// (they share their memory); the guard, which shares none, lives on.
extern "C" fn memory_keeper_main(arg: *mut libc::c_void) -> libc::c_int {
    let reader = arg as usize as RawFd;
    // SAFETY: system calls on this process's own descriptors.
    unsafe {
        libc::setsid();
        close_all_but_from(0, &[reader]);
        for signal in IGNORED {
            libc::signal(signal, libc::SIG_IGN);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::prctl(libc::PR_SET_NAME, c"leaderrun-exit".as_ptr());
        // All it will ever do is exit after leaderrun (the teardown of
        // leaderrun's memory), and that should not compete with the next
        // leader's start on this host.
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
        until_end_of_file(reader);
        libc::_exit(0)
    }
}

/// Returns once `pipe`'s read end sees end-of-file (or fails): nothing is
/// ever written to the pipe, whose only writer is leaderrun. Allocates
/// nothing, so the keeper of leaderrun's memory may call it.
fn until_end_of_file(pipe: RawFd) {
    let mut buf = [0u8; 16];
    loop {
        // SAFETY: reading into a buffer on our stack from our own descriptor.
        let n = unsafe { libc::read(pipe, buf.as_mut_ptr().cast(), buf.len()) };
        if n == 0 || (n < 0 && nix::errno::Errno::last() != nix::errno::Errno::EINTR) {
            return;
        }
    }
}

/// Whether `pipe`'s read end is readable (or failed, or hung up) within
/// `ms` milliseconds.
fn readable_within(pipe: RawFd, ms: u16) -> bool {
    // SAFETY: the guard's own descriptor, open for its whole life.
    let pipe = unsafe { std::os::fd::BorrowedFd::borrow_raw(pipe) };
    let mut fds = [PollFd::new(pipe, PollFlags::POLLIN)];
    !matches!(poll(&mut fds, PollTimeout::from(ms)), Ok(0))
}

/// What the guard and the keeper of leaderrun's memory ignore (the guard
/// through its exec): the terminal's signals, and those an operator sends
/// to leaderrun's process group.
const IGNORED: [libc::c_int; 10] = [
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
];

/// What the guard's exec does once leaderrun is gone: what it was told,
/// and the terms that were running.
pub struct Aftermath {
    setting: Setting,
    running: Vec<(usize, u64)>,
    /// Every unit's processes are gone (else nothing is released).
    cleared: bool,
}

impl Aftermath {
    /// Waits until leaderrun is gone, then kills whatever is left of its
    /// units and waits until they are gone too; None if `setting` is not a
    /// guard's.
    pub fn begin(setting: &std::ffi::OsStr) -> Option<Aftermath> {
        // SAFETY: names this process, which `ps` would call `exe`.
        unsafe { libc::prctl(libc::PR_SET_NAME, c"leaderrun-guard".as_ptr()) };
        let setting = Setting::decode(setting.as_bytes())?;
        // SAFETY: the board's descriptor, inherited through the exec.
        let fd = unsafe { OwnedFd::from_raw_fd(setting.board) };
        let board = Board::map(fd, setting.leases).ok()?;
        let words = board.words;
        if let Some((parent, prefix)) = &setting.cgroups {
            // A second on, with leaderrun still running (a shorter run
            // leaves it to the next), off its way to a first term.
            if !readable_within(setting.reader, 1000) {
                cgroup::remove_stale(parent, prefix);
            }
        }
        until_end_of_file(setting.reader);
        // leaderrun is gone: nothing of its terms may run on.
        for pgid in words.groups().listed() {
            let _ =
                nix::sys::signal::killpg(Pid::from_raw(pgid), nix::sys::signal::Signal::SIGKILL);
        }
        let keepers = words.keepers().listed();
        let give_up = Instant::now() + Duration::from_secs(5);
        let mut cleared = true;
        if let Some((parent, prefix)) = &setting.cgroups {
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
        let running = words
            .terms()
            .iter()
            .map(|term| term.load(Ordering::SeqCst))
            .enumerate()
            .filter(|&(_, term)| term != 0)
            .map(|(lease, term)| (lease, term - 1))
            .collect();
        Some(Aftermath {
            setting,
            running,
            cleared,
        })
    }

    /// Whether there is a lease to release: a term that ran, or in shard
    /// mode the membership record to withdraw.
    pub fn releases(&self) -> bool {
        self.cleared && (!self.running.is_empty() || self.setting.leases > 1)
    }

    /// The replica the guard stands in for, by the name `owner`: the
    /// stores it makes must be that replica's.
    pub fn replica(&self, owner: &str) -> Identity {
        Identity {
            instance: self.setting.instance.clone(),
            pid: self.setting.pid,
            since_ms: self.setting.since_ms,
            ..Identity::new(owner)
        }
    }

    /// Releases the lease of each running term, through `stores` (made from
    /// leaderrun's command line, as its replica), which first take over the
    /// descriptors leaderrun's stores had (the lease file's lock lives on
    /// them); in shard mode, withdraws the membership record (`stores[0]`)
    /// first.
    pub fn release(self, stores: Vec<Arc<dyn LeaseStore>>) {
        if stores.len() != self.setting.leases {
            return;
        }
        let mut old = HashSet::new();
        let mut new = HashSet::new();
        for (store, inherited) in stores.iter().zip(&self.setting.fds) {
            for (fd, &was) in store.keep_fds().into_iter().zip(inherited) {
                // SAFETY: `fd` is the store's own descriptor, now a copy of
                // the one leaderrun's store had; `was` is closed below.
                if unsafe { libc::dup2(was, fd) } < 0 {
                    return;
                }
                old.insert(was);
                new.insert(fd);
            }
        }
        for &fd in old.difference(&new) {
            // SAFETY: an inherited descriptor nothing in this process uses.
            unsafe { libc::close(fd) };
        }
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            if self.setting.leases > 1 {
                let _ = stores[0].withdraw().await;
            }
            // Each store bounds its call; a failure only means the lease
            // lapses at its expiry, as it would have without the guard.
            futures_util::future::join_all(
                self.running
                    .iter()
                    .map(|&(lease, token)| stores[lease].release(token)),
            )
            .await;
        });
        runtime.shutdown_background();
    }
}

/// Closes every descriptor above 2 but those in `kept` (sorted): one
/// `close_range` per gap between them. Allocates nothing.
fn close_all_but(kept: &[RawFd]) {
    close_all_but_from(3, kept);
}

/// Closes every descriptor from `first` on but those in `kept` (sorted).
fn close_all_but_from(mut first: RawFd, kept: &[RawFd]) {
    for &fd in kept {
        if fd > first {
            close_range(first, fd - 1);
        }
        first = first.max(fd + 1);
    }
    close_range(first, RawFd::MAX);
}

/// Closes the descriptors `first..=last`: where the kernel has no
/// `close_range` (before 5.9), one by one up to the descriptor limit.
fn close_range(first: RawFd, last: RawFd) {
    // SAFETY: closes descriptors of this process that nothing in it uses.
    unsafe {
        if libc::close_range(first as libc::c_uint, last as libc::c_uint, 0) == 0 {
            return;
        }
        let mut limit: libc::rlimit = std::mem::zeroed();
        let top = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur.min(1 << 20) as RawFd
        } else {
            1024
        };
        for fd in first..=last.min(top) {
            libc::close(fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_board_lists_what_runs() {
        let board = Board::new(2).unwrap().words;
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

    #[test]
    fn the_setting_reads_back_as_written() {
        let setting = Setting {
            reader: 8,
            board: 9,
            leases: 3,
            pid: 4242,
            instance: "00ff00ff00ff00ff".into(),
            since_ms: 1_700_000_000_000,
            fds: vec![vec![5, 6], vec![], vec![7]],
            cgroups: Some(("/sys/fs/cgroup/a dir/x".into(), "leaderrun-4242-".into())),
        };
        assert_eq!(
            Setting::decode(setting.encode().as_bytes()),
            Some(setting.clone())
        );
        let plain = Setting {
            cgroups: None,
            fds: vec![vec![], vec![], vec![]],
            ..setting
        };
        assert_eq!(Setting::decode(plain.encode().as_bytes()), Some(plain));
        assert_eq!(Setting::decode(b"9 3 x"), None);
    }
}
