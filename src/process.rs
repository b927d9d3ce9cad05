//! Everything leaderrun does to processes: resolving the command, spawning the
//! child in its own group, signalling and killing what a term started,
//! reaping, the terminal hand-off, and the guard that kills the child's group
//! if leaderrun itself is killed outright.
//!
//! Each function names the pitfall it guards against; they are the ones that
//! make `flock`, `consul lock` and friends leave processes behind.

use std::ffi::CString;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{AccessFlags, Pid, access};

use crate::error::CommandError;

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

/// Makes leaderrun a child subreaper: a descendant that double-forks or whose
/// parent dies is re-parented to leaderrun instead of init, so no process
/// started in a term can escape being killed at its end.
pub fn become_subreaper() -> io::Result<()> {
    nix::sys::prctl::set_child_subreaper(true).map_err(io::Error::from)
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

/// The child of one term: its pid and its process group, saved at spawn time
/// so that signals go to the group even after the child itself has exited.
#[derive(Debug, Clone, Copy)]
pub struct Child {
    pub pid: Pid,
    /// The child leads its own group, so this equals `pid`; named separately
    /// because signals go to the group, never to the pid alone.
    pub pgid: Pid,
    /// Whether the child was given the terminal's foreground.
    pub has_terminal: bool,
}

/// The variables a term's child gets on top of leaderrun's environment.
pub struct ChildEnv<'a> {
    pub token_env: &'a str,
    /// None for the fence-floor command, which runs before there is a token.
    pub token: Option<u64>,
    pub key: &'a str,
    pub owner: &'a str,
}

/// What to start: a program (already resolved) and its argv, argv[0] first.
pub struct Program<'a> {
    pub path: &'a Path,
    pub argv: &'a [OsString],
}

/// `/bin/sh -c <script>`, the way the fencing hooks run.
pub fn shell(script: &str) -> (PathBuf, Vec<OsString>) {
    (
        "/bin/sh".into(),
        vec!["sh".into(), "-c".into(), script.into()],
    )
}

/// Spawns the command in a process group of its own.
///
/// Must be called from the thread that lives as long as leaderrun (the main
/// thread: the runtime is current-thread). `PR_SET_PDEATHSIG` fires when the
/// *thread* that forked exits, so a child spawned from a worker or blocking
/// thread would be killed when that thread retires.
///
/// The child is cloned with `CLONE_VM | CLONE_VFORK`, as `posix_spawn` does:
/// it borrows leaderrun's memory until it execs, instead of copying its page
/// tables, which takes a third off the time to a running child (the critical
/// path of a handover). `posix_spawn` itself cannot arm a death signal.
///
/// With `stdout`, the child's standard output goes to that descriptor (the
/// fence-floor command's pipe); otherwise it is inherited, like stdin and
/// stderr.
pub fn spawn(
    program: Program<'_>,
    env: &ChildEnv<'_>,
    stdout: Option<&OwnedFd>,
) -> io::Result<Child> {
    let take_terminal = stdout.is_none() && terminal_is_ours();
    // Everything the child needs is built here: between the clone and the
    // exec it shares our memory and may not allocate.
    let cstring = |bytes: &[u8]| {
        CString::new(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let path = cstring(program.path.as_os_str().as_bytes())?;
    let argv = program
        .argv
        .iter()
        .map(|arg| cstring(arg.as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let envp = child_environment(env)
        .iter()
        .map(|pair| cstring(pair))
        .collect::<io::Result<Vec<_>>>()?;
    let pointers = |strings: &[CString]| -> Vec<*const libc::c_char> {
        strings
            .iter()
            .map(|s| s.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let argv_ptrs = pointers(&argv);
    let envp_ptrs = pointers(&envp);
    let setup = ChildSetup {
        path: path.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: envp_ptrs.as_ptr(),
        parent: nix::unistd::getpid().as_raw(),
        take_terminal,
        stdout: stdout.map_or(-1, |fd| fd.as_raw_fd()),
        errno: AtomicI32::new(0),
    };
    let mut stack = vec![0u8; CHILD_STACK];
    // SAFETY: the stack and `setup` outlive the child's use of them: with
    // CLONE_VFORK this thread is suspended until the child has exec'd or
    // exited. All signals are blocked across the clone so that no handler of
    // leaderrun's runs on the child's borrowed stack before it resets them.
    let pid = unsafe {
        let top = stack.as_mut_ptr().add(CHILD_STACK) as usize & !15;
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        let pid = libc::clone(
            child_main,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &setup as *const ChildSetup as *mut libc::c_void,
        );
        let clone_error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut());
        if pid == -1 {
            return Err(clone_error);
        }
        pid
    };
    let pid = Pid::from_raw(pid);
    let errno = setup.errno.load(Ordering::SeqCst);
    if errno != 0 {
        // The child reported why it could not exec, then exited: reap it here.
        let _ = waitpid(pid, None);
        return Err(io::Error::from_raw_os_error(errno));
    }
    Ok(Child {
        pid,
        pgid: pid,
        has_terminal: take_terminal,
    })
}

/// Stack for the cloned child until it execs; it only makes system calls.
const CHILD_STACK: usize = 64 * 1024;

/// What the cloned child reads (and, on failure, writes) in shared memory.
struct ChildSetup {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    parent: libc::pid_t,
    take_terminal: bool,
    /// A descriptor to make the child's stdout, or -1.
    stdout: libc::c_int,
    /// Set by the child if it cannot exec.
    errno: AtomicI32,
}

/// leaderrun's environment, plus the token, key and owner, minus the backend
/// URL (it may carry a password), as `NAME=value` entries.
fn child_environment(env: &ChildEnv<'_>) -> Vec<Vec<u8>> {
    let ours = [
        env.token_env,
        "LEADERRUN_KEY",
        "LEADERRUN_OWNER",
        "LEADERRUN_BACKEND",
    ];
    let mut entries: Vec<Vec<u8>> = std::env::vars_os()
        .filter(|(name, _)| !ours.iter().any(|o| name.as_bytes() == o.as_bytes()))
        .map(|(name, value)| [name.as_bytes(), b"=", value.as_bytes()].concat())
        .collect();
    let token = env.token.map(|t| t.to_string());
    let ours = [
        (env.token_env, token.as_deref()),
        ("LEADERRUN_KEY", Some(env.key)),
        ("LEADERRUN_OWNER", Some(env.owner)),
    ];
    for (name, value) in ours {
        if let Some(value) = value {
            entries.push([name.as_bytes(), b"=", value.as_bytes()].concat());
        }
    }
    entries
}

/// The cloned child, from clone to exec. It runs on a borrowed stack in
/// leaderrun's memory, so it makes only async-signal-safe system calls and
/// allocates nothing.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the ChildSetup the parent keeps alive until we exec or
    // exit; every call below is a plain system call.
    unsafe {
        let setup = &*(arg as *const ChildSetup);
        let fail = |setup: &ChildSetup| -> ! {
            setup
                .errno
                .store(*libc::__errno_location(), Ordering::SeqCst);
            libc::_exit(127)
        };
        // Handlers of leaderrun's (tokio's signal pipe) must not run here, and
        // dispositions it changed must not reach the command: every caught
        // signal goes back to its default, and so does SIGPIPE, which the Rust
        // runtime ignores. Signals ignored when leaderrun started stay ignored.
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for signal in 1..libc::SIGRTMAX() {
            let mut current: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut current) == 0
                && (current.sa_sigaction != libc::SIG_IGN || signal == libc::SIGPIPE)
                && current.sa_sigaction != libc::SIG_DFL
            {
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        if libc::setpgid(0, 0) != 0 {
            fail(setup);
        }
        if setup.stdout >= 0 && libc::dup2(setup.stdout, libc::STDOUT_FILENO) < 0 {
            fail(setup);
        }
        if setup.take_terminal {
            // A child in a background group that reads the terminal gets
            // SIGTTIN, and the terminal's Ctrl-C would go to leaderrun's group
            // instead of the child's: give the child the foreground, as a
            // shell does for a job. All signals are still blocked, so the
            // SIGTTOU that tcsetpgrp raises in a background group is too.
            libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpid());
        }
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
            fail(setup);
        }
        // If leaderrun died before the prctl above, the death signal was
        // never armed: the child has been re-parented already.
        if libc::getppid() != setup.parent {
            libc::_exit(128 + libc::SIGKILL);
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execve(setup.path, setup.argv, setup.envp);
        fail(setup)
    }
}

/// True when stdin is a terminal whose foreground group is leaderrun's own:
/// only then may the child be given the terminal. Taking it while running in
/// the background would steal it from the shell.
fn terminal_is_ours() -> bool {
    let stdin = std::io::stdin();
    nix::unistd::isatty(&stdin).unwrap_or(false)
        && nix::unistd::tcgetpgrp(&stdin).is_ok_and(|fg| fg == nix::unistd::getpgrp())
}

/// Takes the terminal's foreground back after a child that had it is gone.
pub fn reclaim_terminal() {
    let stdin = std::io::stdin();
    let mut ttou = nix::sys::signal::SigSet::empty();
    ttou.add(Signal::SIGTTOU);
    // leaderrun is in a background group now: without blocking SIGTTOU the
    // call would stop it.
    let _ = ttou.thread_block();
    let _ = nix::unistd::tcsetpgrp(&stdin, nix::unistd::getpgrp());
    let _ = ttou.thread_unblock();
}

impl Child {
    /// Sends `signal` to the child's process group.
    pub fn signal_group(&self, signal: Signal) {
        let _ = killpg(self.pgid, signal);
    }

    /// Sends `signal` to the child's group and to every other descendant of
    /// leaderrun: a child that called `setsid`, or a grandchild that
    /// double-forked, has left the group but is still a descendant, because
    /// leaderrun is a subreaper.
    pub fn signal_everything(&self, signal: Signal) {
        self.signal_group(signal);
        signal_descendants(signal);
    }
}

/// Sends `signal` to every living descendant of leaderrun.
pub fn signal_descendants(signal: Signal) {
    for pid in descendants() {
        let _ = kill(pid, signal);
    }
}

/// Every descendant of this process, from a scan of /proc (the per-task
/// `children` files are not compiled into every kernel).
pub fn descendants() -> Vec<Pid> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(i32, i32)> = entries
        .filter_map(|entry| {
            let pid: i32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            let after_comm = &stat[stat.rfind(')')? + 1..];
            let ppid = after_comm.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![me];
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in &parents {
            if ppid == parent && !found.contains(&Pid::from_raw(pid)) {
                found.push(Pid::from_raw(pid));
                frontier.push(pid);
            }
        }
    }
    found
}

/// What one pass of the reaper found.
#[derive(Debug, Default)]
pub struct Reaped {
    /// Exit statuses of the children that ended, by pid.
    pub exited: Vec<(Pid, WaitStatus)>,
    /// Whether leaderrun still has children (after this pass).
    pub children_left: bool,
}

/// Reaps every child that has ended.
///
/// leaderrun does all of its own reaping (it never uses tokio's process
/// support), so a blanket `waitpid(-1)` steals nobody's status: the caller
/// matches the pids it cares about, and the rest are orphans re-parented to
/// leaderrun as subreaper or PID 1, reaped so they do not linger as zombies.
pub fn reap() -> Reaped {
    let mut reaped = Reaped::default();
    loop {
        match waitpid(
            Pid::from_raw(-1),
            Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL),
        ) {
            Ok(WaitStatus::StillAlive) => {
                reaped.children_left = true;
                return reaped;
            }
            Ok(status) => {
                if let Some(pid) = status.pid() {
                    reaped.exited.push((pid, status));
                }
            }
            Err(Errno::EINTR) => {}
            Err(_) => return reaped,
        }
    }
}

/// Kills the child's process group if leaderrun is killed outright
/// (SIGKILL, the OOM killer), when no code of leaderrun's runs any more.
///
/// `PR_SET_PDEATHSIG` kills only the direct child; its own children would be
/// orphaned. The guard is a tiny process, forked before the runtime starts
/// and detached from leaderrun (double fork, its own session), that blocks on
/// a pipe whose only writer is leaderrun: the read returns end-of-file the
/// moment the kernel tears leaderrun down, and the guard kills the last
/// process group it was told about.
pub struct Guard {
    writer: OwnedFd,
}

impl Guard {
    /// Starts the guard. Must run while the process has a single thread.
    pub fn start() -> io::Result<Guard> {
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let devnull = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        // SAFETY: the process is single-threaded here (documented contract),
        // so the forked children may run arbitrary code.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                // SAFETY: as above; the intermediate child only forks and exits.
                match unsafe { libc::fork() } {
                    0 => guard_main(reader.as_raw_fd(), devnull.as_raw_fd()),
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

    /// Tells the guard which process group to kill if leaderrun dies (or
    /// none, once a term's processes are gone).
    pub fn watch(&self, pgid: Option<Pid>) {
        let raw = pgid.map_or(0, Pid::as_raw).to_ne_bytes();
        // A 4-byte write to a pipe is atomic and the guard drains it at once.
        let _ = nix::unistd::write(&self.writer, &raw);
    }
}

fn guard_main(reader: libc::c_int, devnull: libc::c_int) -> ! {
    // SAFETY: system calls on descriptors this process owns; it never
    // returns into Rust code that assumes the parent's state.
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
        let reader = 3;
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
        let mut watched: libc::pid_t = 0;
        let mut buf = [0u8; 4];
        loop {
            let n = libc::read(reader, buf.as_mut_ptr().cast(), 4);
            if n == 4 {
                watched = libc::pid_t::from_ne_bytes(buf);
            } else if n == 0 || *libc::__errno_location() != libc::EINTR {
                break;
            }
        }
        if watched > 0 {
            libc::killpg(watched, libc::SIGKILL);
        }
        libc::_exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
