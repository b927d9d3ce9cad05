//! Open-file-description (OFD) locks on single bytes of the lease file,
//! through nix's `fcntl`.
//!
//! OFD locks belong to an open file description, not to a process: they are
//! not dropped when another descriptor of the same file is closed (as POSIX
//! record locks are), and they do not conflict within one description,
//! which `Shared`'s mutex covers. They live as long as any descriptor of
//! the description, so every descriptor here is close-on-exec: a child that
//! inherited one would keep the lease alive after leaderrun died.

use std::fs::File;
use std::io;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, fcntl};

/// The byte held for the microseconds of a read-modify-write.
pub const MUTEX_AT: i64 = 1 << 40;
/// The followers' line: held by the head, queued for by the others.
pub const LINE_AT: i64 = MUTEX_AT + 1;
/// The liveness byte of token `t` is at `LIVENESS_BASE + t`.
const LIVENESS_BASE: i64 = 1 << 41;
/// Tokens stay below this so every liveness offset fits in an `off_t`.
pub const MAX_TOKEN: u64 = 1 << 60;

/// The byte whose lock says that the holder of `token` is alive.
pub fn liveness_at(token: u64) -> i64 {
    LIVENESS_BASE + token as i64
}

fn flock(kind: libc::c_int, start: i64) -> libc::flock {
    // SAFETY: flock is plain old data; zero is a valid value for every field.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = start;
    lock.l_len = 1;
    lock
}

/// Takes the write lock on byte `at`, or fails at once (EAGAIN) if another
/// description holds it.
pub fn try_lock(file: &File, at: i64) -> io::Result<()> {
    retry_eintr(|| fcntl(file, FcntlArg::F_OFD_SETLK(&flock(libc::F_WRLCK, at))))
}

/// Takes the write lock on byte `at`, waiting in the kernel for as long as
/// it takes.
pub fn lock_waiting(file: &File, at: i64) -> io::Result<()> {
    retry_eintr(|| fcntl(file, FcntlArg::F_OFD_SETLKW(&flock(libc::F_WRLCK, at))))
}

pub fn unlock(file: &File, at: i64) {
    let _ = fcntl(file, FcntlArg::F_OFD_SETLK(&flock(libc::F_UNLCK, at)));
}

/// Whether another description holds a lock on byte `at`.
pub fn held_elsewhere(file: &File, at: i64) -> io::Result<bool> {
    let mut probe = flock(libc::F_WRLCK, at);
    fcntl(file, FcntlArg::F_OFD_GETLK(&mut probe))?;
    Ok(probe.l_type != libc::F_UNLCK as libc::c_short)
}

/// Takes the mutex byte, retrying until `patience` runs out. Not a blocking
/// lock: a process stopped while holding it must not hang this one beyond
/// the call's bound.
pub fn lock_mutex(file: &File, patience: Instant) -> io::Result<()> {
    let mut pause = Duration::from_micros(20);
    loop {
        match try_lock(file, MUTEX_AT) {
            Ok(()) => return Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                if Instant::now() >= patience {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "lease file mutex held by another process",
                    ));
                }
                std::thread::sleep(pause);
                // Held for microseconds: never sleep long past its release.
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(e) => return Err(e),
        }
    }
}

fn retry_eintr(mut op: impl FnMut() -> nix::Result<libc::c_int>) -> io::Result<()> {
    loop {
        match op() {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_conflicts_across_descriptions_only() {
        let path = std::env::temp_dir().join(format!("leaderrun-lock-{}", std::process::id()));
        let a = File::create(&path).unwrap();
        let b = File::options().read(true).write(true).open(&path).unwrap();
        try_lock(&a, liveness_at(7)).unwrap();
        assert!(held_elsewhere(&b, liveness_at(7)).unwrap());
        assert!(!held_elsewhere(&a, liveness_at(7)).unwrap(), "own lock");
        assert!(try_lock(&b, liveness_at(7)).is_err());
        assert!(!held_elsewhere(&b, liveness_at(8)).unwrap());
        unlock(&a, liveness_at(7));
        assert!(!held_elsewhere(&b, liveness_at(7)).unwrap());
        std::fs::remove_file(&path).unwrap();
    }
}
