//! The guard: kills every unit of processes if leaderrun is killed outright
//! (SIGKILL, the OOM killer), when no code of leaderrun's runs any more.
//!
//! `PR_SET_PDEATHSIG` kills only a direct child; what it started would be
//! orphaned. The guard is a tiny process, forked before the runtime starts
//! (while leaderrun has one thread, so it may run ordinary code) and
//! detached from leaderrun (double fork, its own session), that blocks on a
//! pipe whose only writer is leaderrun: the read returns end-of-file the
//! moment the kernel tears leaderrun down. Then it kills every process
//! group it was told about and, with cgroups, every cgroup under
//! leaderrun's directory (which also reaches processes that left their
//! group or session), and removes the cgroups once they are empty.
//! Keepers see the same end-of-file on their own sockets and do the same
//! for their units.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::sys::wait::waitpid;
use nix::unistd::Pid;

use super::cgroup;

pub struct Guard {
    writer: OwnedFd,
}

impl Guard {
    /// Starts the guard; with `cgroups` (a parent directory and a name
    /// prefix), it also kills every cgroup there whose name starts with the
    /// prefix. Must run while the process has a single thread.
    pub fn start(cgroups: Option<(&Path, &str)>) -> io::Result<Guard> {
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let devnull = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        let cgroups = cgroups.map(|(parent, prefix)| (parent.to_path_buf(), prefix.to_owned()));
        // SAFETY: the process is single-threaded here (documented contract),
        // so the forked children may run arbitrary code.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                // SAFETY: as above; the intermediate child only forks and exits.
                match unsafe { libc::fork() } {
                    0 => guard_main(reader.as_raw_fd(), devnull.as_raw_fd(), cgroups),
                    _ => unsafe { libc::_exit(0) },
                }
            }
            intermediate => {
                drop(reader);
                let _ = waitpid(Pid::from_raw(intermediate), None);
                Ok(Guard { writer })
            }
        }
    }

    /// The process group `pgid` runs: kill it if leaderrun dies.
    pub fn watch(&self, pgid: Pid) {
        self.tell(pgid.as_raw());
    }

    /// The group `pgid` is gone: forget it.
    pub fn unwatch(&self, pgid: Pid) {
        self.tell(-pgid.as_raw());
    }

    fn tell(&self, word: i32) {
        // A 4-byte write to a pipe is atomic and the guard drains it at once.
        let _ = nix::unistd::write(&self.writer, &word.to_ne_bytes());
    }
}

fn guard_main(reader: libc::c_int, devnull: libc::c_int, cgroups: Option<(PathBuf, String)>) -> ! {
    // SAFETY: system calls on descriptors this process owns.
    unsafe {
        libc::setsid();
        for fd in 0..3 {
            libc::dup2(devnull, fd);
        }
        // Keep only the pipe's read end (moved to fd 3): a guard holding the
        // write end would never see end-of-file, and one holding a lease file
        // would keep the lease alive.
        libc::dup2(reader, 3);
        if libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32) != 0 {
            for fd in 4..65536 {
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
    let mut buf = [0u8; 4];
    loop {
        // SAFETY: reading into a buffer we own from our own descriptor.
        let n = unsafe { libc::read(3, buf.as_mut_ptr().cast(), 4) };
        if n == 4 {
            let word = i32::from_ne_bytes(buf);
            if word > 0 {
                groups.insert(word);
            } else {
                groups.remove(&-word);
            }
        } else if n == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    for pgid in groups {
        let _ = nix::sys::signal::killpg(Pid::from_raw(pgid), nix::sys::signal::Signal::SIGKILL);
    }
    if let Some((parent, prefix)) = cgroups {
        cgroup::kill_and_remove(&parent, &prefix);
    }
    // SAFETY: ends this process without running the parent's exit handlers.
    unsafe { libc::_exit(0) }
}
