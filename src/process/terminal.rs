//! The terminal hand-off: on a terminal, the child's group gets the
//! foreground, as a shell gives it to a job, and leaderrun takes it back
//! after.

use nix::sys::signal::{SigSet, Signal};

/// True when stdin is a terminal whose foreground group is this process's
/// own: only then may a child be given the terminal. Taking it while running
/// in the background would steal it from the shell.
pub fn is_ours() -> bool {
    let stdin = std::io::stdin();
    nix::unistd::isatty(&stdin).unwrap_or(false)
        && nix::unistd::tcgetpgrp(&stdin).is_ok_and(|fg| fg == nix::unistd::getpgrp())
}

/// Takes the terminal's foreground back after a child that had it is gone.
pub fn reclaim() {
    let stdin = std::io::stdin();
    let mut ttou = SigSet::empty();
    ttou.add(Signal::SIGTTOU);
    // leaderrun is in a background group now: without blocking SIGTTOU the
    // call would stop it.
    let _ = ttou.thread_block();
    let _ = nix::unistd::tcsetpgrp(&stdin, nix::unistd::getpgrp());
    let _ = ttou.thread_unblock();
}
