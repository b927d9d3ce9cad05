//! Starting a process: the one spawn path for the command, the hooks and
//! the keepers.
//!
//! The child is cloned with `CLONE_VM | CLONE_VFORK`, as `posix_spawn` does:
//! it borrows leaderrun's memory until it execs, instead of copying its page
//! tables, which takes a third off the time to a running child (the critical
//! path of a handover). `posix_spawn` itself cannot arm a death signal or
//! join a cgroup.
//!
//! Must be called from the thread that lives as long as leaderrun (the main
//! thread: the runtime is current-thread). `PR_SET_PDEATHSIG` fires when the
//! *thread* that forked exits, so a child spawned from a worker or blocking
//! thread would be killed when that thread retires.

use std::cell::Cell;
use std::ffi::{CStr, CString, OsString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::sys::wait::waitpid;
use nix::unistd::Pid;

/// What to start: a program (already resolved), its argv (argv[0] first)
/// and its whole environment as `NAME=value` entries.
pub struct Command<'a> {
    pub path: &'a Path,
    pub argv: &'a [OsString],
    pub env: &'a [&'a CStr],
}

/// How to start it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// A descriptor to make the child's stdout (a hook's pipe).
    pub stdout: Option<RawFd>,
    /// A descriptor the child keeps across exec (a keeper's socket); every
    /// other descriptor of leaderrun's is close-on-exec.
    pub keep_fd: Option<RawFd>,
    /// The unit's cgroup: the child is born in it (or, on a kernel or an
    /// architecture without `clone3`, writes itself into it before exec), so
    /// that everything it ever starts is in its cgroup from the first fork.
    pub cgroup: Option<CgroupFds>,
    /// The child leads a process group of its own.
    pub own_group: bool,
    /// The child gets SIGKILL when the spawning thread dies.
    pub death_signal: bool,
    /// The child's group takes the terminal's foreground.
    pub take_terminal: bool,
}

/// A cgroup's directory and its open `cgroup.procs`.
#[derive(Debug, Clone, Copy)]
pub struct CgroupFds {
    pub dir: RawFd,
    pub procs: RawFd,
}

/// Starts `command`; returns its pid once it has exec'd. An exec that fails
/// is an error here (the child is reaped), never a child that exits 127.
pub fn spawn(command: &Command<'_>, options: Options) -> io::Result<Pid> {
    // Everything the child needs is built here: between the clone and the
    // exec it shares our memory and may not allocate.
    let cstring = |bytes: &[u8]| {
        CString::new(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let path = cstring(command.path.as_os_str().as_bytes())?;
    let argv = command
        .argv
        .iter()
        .map(|arg| cstring(arg.as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let pointers = |strings: &mut dyn Iterator<Item = &CStr>| -> Vec<*const libc::c_char> {
        strings
            .map(|s| s.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let argv_ptrs = pointers(&mut argv.iter().map(CString::as_c_str));
    let envp_ptrs = pointers(&mut command.env.iter().copied());
    let mut setup = ChildSetup {
        path: path.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: envp_ptrs.as_ptr(),
        parent: nix::unistd::getpid().as_raw(),
        options,
        join_cgroup: None,
        affinity: None,
        reset: RESET.get().copied(),
        errno: AtomicI32::new(0),
    };
    // The child starts on this CPU, which this thread leaves idle while it
    // waits for the exec: placed on another, idle one (where the kernel puts
    // a new process), it would wait for that CPU to wake up, which on a
    // virtual machine took longer than the exec. It gets back this thread's
    // CPUs before it execs.
    let pinned = PinnedToThisCpu::new();
    setup.affinity = pinned.as_ref().map(|pinned| pinned.saved);
    // 16-byte aligned, as both ABIs want the stack at a call. Not zeroed:
    // the child writes what it reads, and zeroing 64 kB cost every spawn 16
    // page faults for the few hundred bytes the child uses. Kept from one
    // spawn to the next: a new one cost a handover a grown heap (a brk) and
    // two page faults on the way to the clone.
    let mut stack = Stack::take();
    // SAFETY: the stack and `setup` outlive the child's use of them: with
    // CLONE_VFORK this thread is suspended until the child has exec'd or
    // exited. All signals are blocked across the clone so that no handler of
    // leaderrun's runs on the child's borrowed stack before it resets them.
    let pid = unsafe {
        let base = stack.0.as_mut_ptr().cast::<u8>();
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        let mut pid: libc::c_long = -1;
        let mut clone_error = io::Error::from_raw_os_error(libc::ENOSYS);
        if let Some(cgroup) = options.cgroup {
            // Born in the cgroup: moving a process into one afterwards waits
            // for an RCU grace period in the kernel, milliseconds on the
            // critical path of a handover.
            pid = clone3::into_cgroup(cgroup.dir, base, CHILD_STACK, &setup);
            clone_error = io::Error::last_os_error();
            if pid == -1 && clone3::unsupported(&clone_error) {
                setup.join_cgroup = Some(cgroup.procs);
            }
        }
        if pid == -1 && (options.cgroup.is_none() || setup.join_cgroup.is_some()) {
            pid = libc::c_long::from(libc::clone(
                child_main,
                base.add(CHILD_STACK).cast(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                &setup as *const ChildSetup as *mut libc::c_void,
            ));
            clone_error = io::Error::last_os_error();
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut());
        if pid == -1 {
            return Err(clone_error);
        }
        pid
    };
    let pid = Pid::from_raw(pid as libc::pid_t);
    let errno = setup.errno.load(Ordering::SeqCst);
    if errno != 0 {
        // The child reported why it could not exec, then exited: reap it here,
        // before the reaper (on this same thread) can see it.
        let _ = waitpid(pid, None);
        return Err(io::Error::from_raw_os_error(errno));
    }
    drop(pinned);
    // The child has memory of its own now, but its exec is still under way
    // on this CPU, and this thread's wake (the end of the vfork) has just
    // taken the CPU from it: give it back, so that the command starts before
    // this process goes on with what follows a spawn.
    // SAFETY: sched_yield has no arguments and cannot fail.
    unsafe { libc::sched_yield() };
    Ok(pid)
}

/// This thread pinned to the CPU it runs on, until dropped (then it gets
/// its CPUs back).
struct PinnedToThisCpu {
    saved: libc::cpu_set_t,
}

impl PinnedToThisCpu {
    /// None if this thread may run on one CPU only already, or if the
    /// kernel says no.
    fn new() -> Option<PinnedToThisCpu> {
        // SAFETY: plain system calls on this thread's own affinity, with
        // sets we own.
        unsafe {
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let mut saved: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size, &mut saved) != 0 || libc::CPU_COUNT(&saved) < 2 {
                return None;
            }
            let cpu = libc::sched_getcpu();
            if cpu < 0 || !libc::CPU_ISSET(cpu as usize, &saved) {
                return None;
            }
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu as usize, &mut one);
            (libc::sched_setaffinity(0, size, &one) == 0).then_some(PinnedToThisCpu { saved })
        }
    }
}

impl Drop for PinnedToThisCpu {
    fn drop(&mut self) {
        // SAFETY: as in `new`.
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.saved);
        }
    }
}

/// The signals a child sets back to their default before it execs, found
/// once leaderrun's handlers are in place: each spawn's child then changes
/// only those, instead of asking for every signal's disposition.
static RESET: OnceLock<u128> = OnceLock::new();

/// Notes leaderrun's signal dispositions for every later spawn. Called once
/// its handlers are all registered (`Signals::register`); a disposition
/// changed after it would not be set back in the children.
pub fn note_dispositions() {
    let _ = RESET.set(to_reset());
}

/// The signals whose disposition a child must set back to the default
/// (bit N: signal N): every caught signal (a handler of leaderrun's must not
/// run in the child before its exec), and SIGPIPE, which leaderrun ignores
/// (as std's start-up does; main.rs). Signals ignored when leaderrun started
/// stay ignored. Only system calls: the child may call it.
fn to_reset() -> u128 {
    let mut reset = 0u128;
    for signal in 1..libc::SIGRTMAX() {
        // SAFETY: reads the disposition into a value of our own.
        let current = unsafe {
            let mut current: libc::sigaction = std::mem::zeroed();
            (libc::sigaction(signal, std::ptr::null(), &mut current) == 0).then_some(current)
        };
        if let Some(current) = current {
            if (current.sa_sigaction != libc::SIG_IGN || signal == libc::SIGPIPE)
                && current.sa_sigaction != libc::SIG_DFL
            {
                reset |= 1 << signal;
            }
        }
    }
    reset
}

/// Stack for the cloned child until it execs; it only makes system calls.
const CHILD_STACK: usize = 64 * 1024;

thread_local! {
    /// The children's stack, kept for the next spawn on this thread.
    static STACK: Cell<Vec<MaybeUninit<u128>>> = const { Cell::new(Vec::new()) };
}

/// A child's stack (`CHILD_STACK` bytes), given back for the next spawn
/// however this one ends.
struct Stack(Vec<MaybeUninit<u128>>);

impl Stack {
    fn take() -> Stack {
        let mut words = STACK.take();
        words.reserve_exact(CHILD_STACK / 16);
        Stack(words)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        STACK.set(std::mem::take(&mut self.0));
    }
}

/// Makes this thread's next child stack now, its top pages (where the
/// child's frames go) included: a follower does it while it waits, as made
/// on the way to a handover's exec it cost a grown heap and page faults.
pub fn prepare() {
    let mut stack = Stack::take();
    let base = stack.0.as_mut_ptr().cast::<u8>();
    for page in 1..=2 {
        // SAFETY: within the stack's CHILD_STACK bytes; a byte of memory
        // that holds no value yet, written so that its page is made.
        unsafe { std::ptr::write_volatile(base.add(CHILD_STACK - page * 4096), 0) };
    }
}

/// What the cloned child reads (and, on failure, writes) in shared memory.
struct ChildSetup {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    parent: libc::pid_t,
    options: Options,
    /// A `cgroup.procs` to write the child into (when it could not be born
    /// in its cgroup).
    join_cgroup: Option<RawFd>,
    /// The CPUs to give the child back (it was started pinned to one).
    affinity: Option<libc::cpu_set_t>,
    /// The signals to set back to their default (bit N: signal N), if
    /// known (`note_dispositions`); else the child looks at every one.
    reset: Option<u128>,
    /// Set by the child if it cannot exec.
    errno: AtomicI32,
}

/// The cloned child, from clone to exec. It runs on a borrowed stack in
/// leaderrun's memory, so it makes only async-signal-safe system calls and
/// allocates nothing.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the ChildSetup the parent keeps alive until we exec or
    // exit; every call below is a plain system call.
    unsafe {
        let setup = &*(arg as *const ChildSetup);
        let options = &setup.options;
        let fail = |setup: &ChildSetup| -> ! {
            setup
                .errno
                .store(*libc::__errno_location(), Ordering::SeqCst);
            libc::_exit(127)
        };
        // Handlers of leaderrun's (tokio's signal pipe) must not run here, and
        // dispositions it changed must not reach the command: every caught
        // signal goes back to its default, and so does SIGPIPE, which
        // leaderrun ignores. Signals ignored when leaderrun started stay
        // ignored (`to_reset`).
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        let reset = setup.reset.unwrap_or_else(to_reset);
        for signal in 1..libc::SIGRTMAX() {
            if reset & (1 << signal) != 0 {
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        if let Some(cpus) = &setup.affinity {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), cpus) != 0 {
                fail(setup);
            }
        }
        // First of all, so nothing the child ever starts is outside it.
        if let Some(procs) = setup.join_cgroup {
            if libc::write(procs, c"0".as_ptr().cast(), 1) != 1 {
                fail(setup);
            }
        }
        if options.own_group && libc::setpgid(0, 0) != 0 {
            fail(setup);
        }
        if let Some(stdout) = options.stdout {
            if libc::dup2(stdout, libc::STDOUT_FILENO) < 0 {
                fail(setup);
            }
        }
        if let Some(fd) = options.keep_fd {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                fail(setup);
            }
        }
        if options.take_terminal {
            // A child in a background group that reads the terminal gets
            // SIGTTIN, and the terminal's Ctrl-C would go to leaderrun's group
            // instead of the child's: give the child the foreground, as a
            // shell does for a job. All signals are still blocked, so the
            // SIGTTOU that tcsetpgrp raises in a background group is too.
            libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpid());
        }
        if options.death_signal {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                fail(setup);
            }
            // If leaderrun died before the prctl above, the death signal was
            // never armed: the child has been re-parented already.
            if libc::getppid() != setup.parent {
                libc::_exit(128 + libc::SIGKILL);
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execve(setup.path, setup.argv, setup.envp);
        fail(setup)
    }
}

/// `clone3` with `CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP`: the child
/// runs `child_main` on its own stack in leaderrun's memory, like `clone`,
/// and is born in the cgroup. libc has no wrapper that runs a function on
/// the new stack, so the child's first instructions are written here.
mod clone3 {
    use std::io;
    use std::os::fd::RawFd;

    use super::{ChildSetup, child_main};

    /// `struct clone_args` of the kernel (linux/sched.h).
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
        set_tid: u64,
        set_tid_size: u64,
        cgroup: u64,
    }

    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

    /// Whether the kernel lacks `clone3` or `CLONE_INTO_CGROUP` (Linux
    /// before 5.7): fall back to `clone` and joining the cgroup.
    pub fn unsupported(error: &io::Error) -> bool {
        matches!(
            error.raw_os_error(),
            Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::E2BIG)
        )
    }

    /// Returns the child's pid, or -1 with errno set.
    ///
    /// # Safety
    ///
    /// As for `clone` with `CLONE_VM | CLONE_VFORK`: `stack` (16-byte
    /// aligned, `size` bytes) and `setup` live until the child has exec'd or
    /// exited, which this call waits for.
    pub unsafe fn into_cgroup(
        cgroup: RawFd,
        stack: *mut u8,
        size: usize,
        setup: &ChildSetup,
    ) -> libc::c_long {
        let args = CloneArgs {
            flags: (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_INTO_CGROUP,
            exit_signal: libc::SIGCHLD as u64,
            stack: stack as u64,
            stack_size: size as u64,
            cgroup: cgroup as u64,
            ..CloneArgs::default()
        };
        let arg = setup as *const ChildSetup as *mut libc::c_void;
        // SAFETY: upheld by the caller; the child never returns from `call`.
        unsafe { raw(&args, arg) }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn raw(args: &CloneArgs, arg: *mut libc::c_void) -> libc::c_long {
        let ret: libc::c_long;
        // SAFETY: the child starts at the instruction after `syscall` on
        // the new stack, with the other registers as they were: it calls
        // child_main(arg), which execs or exits, and exits if it returns.
        unsafe {
            std::arch::asm!(
                "syscall",
                "test rax, rax",
                "jnz 2f",
                "mov rdi, {arg}",
                "call {main}",
                "mov edi, eax",
                "mov eax, 60",
                "syscall",
                "ud2",
                "2:",
                main = in(reg) child_main as extern "C" fn(*mut libc::c_void) -> libc::c_int,
                arg = in(reg) arg,
                inlateout("rax") libc::SYS_clone3 => ret,
                in("rdi") args as *const CloneArgs,
                in("rsi") std::mem::size_of::<CloneArgs>(),
                out("rcx") _,
                out("r11") _,
            );
        }
        if ret < 0 {
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = -ret as libc::c_int };
            return -1;
        }
        ret
    }

    #[cfg(target_arch = "aarch64")]
    unsafe fn raw(args: &CloneArgs, arg: *mut libc::c_void) -> libc::c_long {
        let ret: libc::c_long;
        // SAFETY: as on x86_64: the child calls child_main(arg) on its stack.
        unsafe {
            std::arch::asm!(
                "svc #0",
                "cbnz x0, 2f",
                "mov x0, {arg}",
                "blr {main}",
                "mov x8, #93",
                "svc #0",
                "udf #0",
                "2:",
                main = in(reg) child_main as extern "C" fn(*mut libc::c_void) -> libc::c_int,
                arg = in(reg) arg,
                in("x8") libc::SYS_clone3,
                inlateout("x0") args as *const CloneArgs => ret,
                in("x1") std::mem::size_of::<CloneArgs>(),
            );
        }
        if ret < 0 {
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = -ret as libc::c_int };
            return -1;
        }
        ret
    }

    /// Elsewhere: as if the kernel had no `clone3`.
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    unsafe fn raw(_: &CloneArgs, _: *mut libc::c_void) -> libc::c_long {
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        -1
    }
}
