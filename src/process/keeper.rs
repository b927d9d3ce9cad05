//! Containment without cgroups: a keeper per unit of processes.
//!
//! The keeper is leaderrun's own binary, run again in keeper mode. It is a
//! child subreaper that starts the unit's one program, so every process the
//! program ever starts, whatever it does with process groups and sessions
//! (`setsid`, a double fork), stays its descendant. It reports the program's
//! exit and, later, that nothing is left; it signals or kills everything on
//! leaderrun's word; and if leaderrun dies (its socket reads end-of-file),
//! it kills everything and exits. It runs in leaderrun's process group, so
//! it sees the terminal as leaderrun does, and blocks every signal a
//! terminal or a group kill could send it.
//!
//! The two sides speak in fixed 12-byte frames over a socket pair.

use std::ffi::OsString;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream as StdStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal, kill, killpg};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt as _;
use tokio::net::UnixStream;

use super::spawn::{self, Command, Options};
use super::{env_entry, exit_code, terminal, tree};

/// The variable that puts leaderrun's binary in keeper mode:
/// `<socket fd>:<take the terminal 0|1>`.
pub const KEEPER_ENV: &str = "LEADERRUN_KEEPER";

/// A frame: what one side tells the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// To the keeper: send `signal` to the program's group, or to all.
    Signal { all: bool, signal: i32 },
    /// To the keeper: SIGKILL to everything, until nothing is left.
    Kill,
    /// From the keeper: the program runs, with this pid.
    Started(i32),
    /// From the keeper: the program could not be started (errno).
    SpawnFailed(i32),
    /// From the keeper: the program exited with this status.
    Exited(u8),
    /// From the keeper: nothing of the unit is left; the keeper exits.
    Empty,
}

const FRAME: usize = 12;

impl Frame {
    fn encode(self) -> [u8; FRAME] {
        let (tag, a, b): (i32, i32, i32) = match self {
            Frame::Signal { all, signal } => (1, i32::from(all), signal),
            Frame::Kill => (2, 0, 0),
            Frame::Started(pid) => (3, pid, 0),
            Frame::SpawnFailed(errno) => (4, errno, 0),
            Frame::Exited(code) => (5, i32::from(code), 0),
            Frame::Empty => (6, 0, 0),
        };
        let mut bytes = [0u8; FRAME];
        bytes[0..4].copy_from_slice(&tag.to_ne_bytes());
        bytes[4..8].copy_from_slice(&a.to_ne_bytes());
        bytes[8..12].copy_from_slice(&b.to_ne_bytes());
        bytes
    }

    fn decode(bytes: &[u8; FRAME]) -> Option<Frame> {
        let word = |i: usize| i32::from_ne_bytes(bytes[i..i + 4].try_into().unwrap());
        Some(match word(0) {
            1 => Frame::Signal {
                all: word(4) != 0,
                signal: word(8),
            },
            2 => Frame::Kill,
            3 => Frame::Started(word(4)),
            4 => Frame::SpawnFailed(word(4)),
            5 => Frame::Exited(u8::try_from(word(4)).ok()?),
            6 => Frame::Empty,
            _ => return None,
        })
    }
}

/// leaderrun's end of one keeper.
pub struct Link {
    stream: UnixStream,
    /// A frame read in part (reads are cancel-safe: nothing is lost when a
    /// wait is dropped half-way).
    partial: [u8; FRAME],
    filled: usize,
    /// The keeper process.
    pub keeper: Pid,
    /// The program the keeper started.
    pub program: Pid,
}

impl Link {
    /// Starts a keeper (the binary `exe`) for `command`, and waits for it to
    /// say that the program runs.
    pub async fn start(
        exe: &Path,
        command: &Command<'_>,
        take_terminal: bool,
        stdout: Option<RawFd>,
    ) -> io::Result<Link> {
        let (ours, theirs) = StdStream::pair()?;
        let mut argv: Vec<OsString> = vec!["leaderrun-keeper".into(), command.path.into()];
        argv.extend(command.argv.iter().cloned());
        let setting = std::ffi::CString::new(format!(
            "{KEEPER_ENV}={}:{}",
            theirs.as_raw_fd(),
            u8::from(take_terminal)
        ))
        .map_err(io::Error::other)?;
        let mut env: Vec<&std::ffi::CStr> = command.env.to_vec();
        env.push(&setting);
        let keeper = spawn::spawn(
            &Command {
                path: exe,
                argv: &argv,
                env: &env,
            },
            Options {
                stdout,
                keep_fd: Some(theirs.as_raw_fd()),
                // In leaderrun's group: it sees the terminal as leaderrun does.
                own_group: false,
                // It must outlive leaderrun, to kill what is left.
                death_signal: false,
                ..Options::default()
            },
        )?;
        drop(theirs);
        ours.set_nonblocking(true)?;
        let mut link = Link {
            stream: UnixStream::from_std(ours)?,
            partial: [0; FRAME],
            filled: 0,
            keeper,
            program: keeper,
        };
        match link.next().await {
            Some(Frame::Started(pid)) => {
                link.program = Pid::from_raw(pid);
                Ok(link)
            }
            Some(Frame::SpawnFailed(errno)) => Err(io::Error::from_raw_os_error(errno)),
            _ => Err(io::Error::other("the keeper process did not start")),
        }
    }

    /// The next frame from the keeper; None once it is gone. Cancel-safe.
    pub async fn next(&mut self) -> Option<Frame> {
        while self.filled < FRAME {
            match self.stream.read(&mut self.partial[self.filled..]).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.filled += n,
            }
        }
        self.filled = 0;
        Frame::decode(&self.partial)
    }

    pub fn send(&mut self, frame: Frame) {
        // 12 bytes on a local socket whose buffer the keeper drains: never
        // blocks in practice; if the keeper is gone there is nothing to tell.
        let bytes = frame.encode();
        let _ = self.stream.try_write(&bytes);
    }
}

/// The keeper's side: runs in the process leaderrun started in keeper mode,
/// and never returns.
pub fn main(setting: &str) -> ! {
    let code = match run(setting) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("leaderrun-keeper: {e}");
            70
        }
    };
    std::process::exit(code)
}

fn run(setting: &str) -> io::Result<()> {
    let (fd, take_terminal) = setting
        .split_once(':')
        .and_then(|(fd, terminal)| Some((fd.parse::<RawFd>().ok()?, terminal == "1")))
        .ok_or_else(|| io::Error::other(format!("bad {KEEPER_ENV} {setting:?}")))?;
    // SAFETY: leaderrun passed this descriptor, open, for the keeper alone.
    let mut socket = StdStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
    nix::fcntl::fcntl(
        &socket,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )?;
    // Terminal signals and group kills are for the program, not for the
    // keeper; blocked (not ignored), so the program's dispositions are clean.
    let mut blocked = SigSet::empty();
    for signal in [
        Signal::SIGCHLD,
        Signal::SIGHUP,
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGTERM,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGPIPE,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
        Signal::SIGWINCH,
    ] {
        blocked.add(signal);
    }
    blocked.thread_block()?;
    let children = SignalFd::with_flags(
        &{
            let mut only = SigSet::empty();
            only.add(Signal::SIGCHLD);
            only
        },
        SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK,
    )?;
    nix::sys::prctl::set_child_subreaper(true)?;

    let mut args = std::env::args_os().skip(1);
    let path = PathBuf::from(args.next().ok_or_else(|| io::Error::other("no program"))?);
    let argv: Vec<OsString> = args.collect();
    let owned: Vec<std::ffi::CString> = std::env::vars_os()
        .filter(|(name, _)| name != KEEPER_ENV)
        .filter_map(|(name, value)| env_entry(name.as_bytes(), value.as_bytes()))
        .collect();
    let env: Vec<&std::ffi::CStr> = owned.iter().map(|s| s.as_c_str()).collect();
    let started = spawn::spawn(
        &Command {
            path: &path,
            argv: &argv,
            env: &env,
        },
        Options {
            own_group: true,
            death_signal: true,
            take_terminal: take_terminal && terminal::is_ours(),
            ..Options::default()
        },
    );
    let program = match started {
        Ok(pid) => pid,
        Err(e) => {
            let errno = e.raw_os_error().unwrap_or(libc::ENOEXEC);
            socket.write_all(&Frame::SpawnFailed(errno).encode())?;
            return Ok(());
        }
    };
    socket.write_all(&Frame::Started(program.as_raw()).encode())?;
    // The program has the keeper's stdout (a hook's pipe); the keeper must
    // not hold it open, or the reader never sees its end.
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2_stdout(&null);
    }

    let mut program_running = true;
    loop {
        // Reap what ended; the program's status goes to leaderrun.
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(status) => {
                    if program_running && status.pid() == Some(program) {
                        if let Some(code) = exit_code(status) {
                            program_running = false;
                            socket.write_all(&Frame::Exited(code).encode())?;
                        }
                    }
                }
                Err(Errno::EINTR) => {}
                Err(Errno::ECHILD) => {
                    // No child is left, so no descendant is: as a subreaper
                    // the keeper inherits every orphan of the unit.
                    let _ = socket.write_all(&Frame::Empty.encode());
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut fds = [
            PollFd::new(socket.as_fd_borrowed(), PollFlags::POLLIN),
            PollFd::new(children.as_fd_borrowed(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::from(1000u16)) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
        let from_leaderrun = fds[0].revents().unwrap_or(PollFlags::empty());
        while children.read_signal().ok().flatten().is_some() {}
        if from_leaderrun.is_empty() {
            continue;
        }
        let mut bytes = [0u8; FRAME];
        match socket.read_exact(&mut bytes) {
            Ok(()) => match Frame::decode(&bytes) {
                Some(Frame::Signal { all, signal }) => {
                    let Ok(signal) = Signal::try_from(signal) else {
                        continue;
                    };
                    let _ = killpg(program, signal);
                    if all {
                        for pid in tree::descendants(nix::unistd::getpid()) {
                            let _ = kill(pid, signal);
                        }
                    }
                }
                Some(Frame::Kill) => kill_everything(),
                _ => {}
            },
            // leaderrun is gone (or let go): nothing of the unit may outlive it.
            Err(_) => {
                kill_everything();
                reap_everything();
                return Ok(());
            }
        }
    }
}

/// SIGKILL to every descendant, until a scan finds none (a fork between a
/// scan and its kills is caught by the next scan).
fn kill_everything() {
    let me = nix::unistd::getpid();
    for _ in 0..1000 {
        let left = tree::descendants(me);
        if left.is_empty() {
            return;
        }
        for pid in left {
            let _ = kill(pid, Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn reap_everything() {
    while !matches!(waitpid(None, Some(WaitPidFlag::__WALL)), Err(Errno::ECHILD)) {}
}

/// `as_fd` under a name that does not clash with tokio's traits.
trait BorrowFd {
    fn as_fd_borrowed(&self) -> std::os::fd::BorrowedFd<'_>;
}

impl<T: std::os::fd::AsFd> BorrowFd for T {
    fn as_fd_borrowed(&self) -> std::os::fd::BorrowedFd<'_> {
        self.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        for frame in [
            Frame::Signal {
                all: true,
                signal: 15,
            },
            Frame::Kill,
            Frame::Started(4242),
            Frame::SpawnFailed(2),
            Frame::Exited(143),
            Frame::Empty,
        ] {
            assert_eq!(Frame::decode(&frame.encode()), Some(frame));
        }
    }
}
