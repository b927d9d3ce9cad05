//! The child (SPEC §4): what it inherits, its terminal, and leaderrun as
//! PID 1.

mod common;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{BIN, FAST, Replica, Sandbox, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(15);

#[test]
fn leaderrun_adds_no_descriptor_to_what_the_child_inherits() {
    let sandbox = Sandbox::new();
    // `ls` lists the descriptors of the shell; any lease file, lock, pipe or
    // inotify descriptor of leaderrun's leaking into it would show. The
    // baseline is the same shell started directly: descriptors the test
    // process itself passes on are leaderrun's to pass on too.
    let list = "exec ls /proc/self/fd";
    let numbers = |text: &str| {
        let mut fds: Vec<u32> = text
            .split_whitespace()
            .map(|f| f.parse().unwrap())
            .collect();
        fds.sort();
        fds
    };
    let direct = Command::new("sh")
        .args(["-c", list])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let direct = numbers(&String::from_utf8_lossy(&direct.stdout));
    assert_eq!(direct[..3], [0, 1, 2]);
    let out = sandbox.leaderrun("fds").sh(list).run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(numbers(&out.stdout), direct);
}

#[test]
fn an_operator_deleting_the_lease_makes_the_leader_yield_and_campaign_again() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("deleted")
        .sh("trap 'echo yielded >> events; exit 0' TERM; echo $LEADERRUN_TOKEN >> tokens; while :; do sleep 0.02; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 1));
    for entry in std::fs::read_dir(sandbox.state_dir()).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    // The next renewal (every 400 ms) finds no lease: the term is lost, the
    // child is told at once, and leaderrun leads again on a new file.
    assert!(wait_until(LONG, || sandbox
        .read("events")
        .contains("yielded")));
    assert!(leader.wait_log("lease lost", LONG), "{}", leader.stderr());
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "{}",
        leader.stderr()
    );
    assert!(leader.stderr().contains("reason=lost"));
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn a_program_that_exited_is_reaped_once_its_term_is_over() {
    // Its status is taken at once, but the reaping waits for the end of the
    // term (after the release): the zombie must not outlive the term.
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("reaped")
        .sh("echo $$ >> pids; trap 'exit 0' TERM; while :; do sleep 0.02; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("pids").len() == 1));
    let first = sandbox.lines("pids")[0].clone();
    for entry in std::fs::read_dir(sandbox.state_dir()).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    // The term is lost, its program exits, and the next term's runs on:
    // no other child of leaderrun's ends, so nothing but the end of the
    // first term reaps the first program.
    assert!(
        wait_until(LONG, || sandbox.lines("pids").len() == 2),
        "{}",
        leader.stderr()
    );
    assert!(
        wait_until(LONG, || !std::path::Path::new(&format!("/proc/{first}"))
            .exists()),
        "the first program is left: {}",
        std::fs::read_to_string(format!("/proc/{first}/stat")).unwrap_or_default()
    );
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

/// A pseudo-terminal whose slave side is leaderrun's controlling terminal,
/// with everything written to it collected in the background.
struct Terminal {
    master: OwnedFd,
    output: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Terminal {
    fn spawn(mut command: Command) -> (Terminal, std::process::Child) {
        let pty = nix::pty::openpty(None, None).expect("openpty");
        let slave = pty.slave;
        command
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid and ioctl are async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                nix::unistd::setsid()?;
                if libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("spawn leaderrun on a terminal");
        let output = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut reader = std::fs::File::from(pty.master.try_clone().unwrap());
        let sink = output.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        (
            Terminal {
                master: pty.master,
                output,
            },
            child,
        )
    }

    fn type_in(&self, bytes: &[u8]) {
        let mut master = std::fs::File::from(self.master.try_clone().unwrap());
        master.write_all(bytes).unwrap();
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }
}

#[test]
fn on_a_terminal_the_child_reads_input_and_ctrl_c_reaches_it() {
    let sandbox = Sandbox::new();
    let mut command = Command::new(BIN);
    command
        .current_dir(sandbox.path(""))
        .args(["--backend", &sandbox.backend(), "--key", "tty"])
        .args(FAST)
        .args([
            "--",
            "sh",
            "-c",
            "echo ready > ready; read line; echo \"read:$line\" > got; exec sleep 300",
        ]);
    let (terminal, mut leaderrun) = Terminal::spawn(command);
    assert!(
        wait_until(LONG, || sandbox.path("ready").exists()),
        "{}",
        terminal.text()
    );
    // A child in a background group would be stopped by SIGTTIN here.
    terminal.type_in(b"hello\n");
    assert!(
        wait_until(LONG, || sandbox.read("got").contains("read:hello")),
        "{}",
        terminal.text()
    );
    // Ctrl-C goes to the terminal's foreground group, which is the child's.
    terminal.type_in(&[0x03]);
    let mut code = None;
    assert!(wait_until(LONG, || {
        code = leaderrun.try_wait().unwrap();
        code.is_some()
    }));
    let status = code.unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}: {}", terminal.text());
    assert!(
        terminal.text().contains("lease released"),
        "{}",
        terminal.text()
    );
}

#[test]
fn as_pid_1_it_reaps_orphans_without_losing_the_childs_status() {
    let sandbox = Sandbox::new();
    // In a new PID namespace leaderrun is PID 1, so the orphan re-parents
    // to it; a zombie left behind would show as state Z in /proc.
    let script = "sh -c 'sleep 0.1 & echo $! > orphan.pid'; sleep 0.6; \
                  if grep -q ') Z' /proc/$(cat orphan.pid)/stat 2>/dev/null; then echo zombie; else echo reaped; fi > orphan-state; \
                  echo $PPID > parent.pid; exit 7";
    let out = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount-proc",
            BIN,
            "--backend",
            &sandbox.backend(),
            "--key",
            "pid1",
        ])
        .args(FAST)
        .args(["--", "sh", "-c", script])
        .current_dir(sandbox.path(""))
        .output()
        .expect("unshare");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert_eq!(sandbox.read("orphan-state").trim(), "reaped", "{stderr}");
    assert_eq!(
        sandbox.read("parent.pid").trim(),
        "1",
        "leaderrun ran as PID 1"
    );
}

/// The pid of leaderrun's child named `name` (its guard, the keeper of its
/// memory), waited for: each names itself once it runs (the guard once it
/// has exec'd), which may come after the command has started, since the
/// command does not wait for them.
fn child_named(leader: &Replica, name: &str) -> i32 {
    let leader = leader.pid();
    let find = || {
        let children =
            std::fs::read_to_string(format!("/proc/{leader}/task/{leader}/children")).ok()?;
        children
            .split_whitespace()
            .find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|comm| comm.trim() == name)
            })?
            .parse()
            .ok()
    };
    assert!(wait_until(LONG, || find().is_some()), "no {name} runs");
    find().unwrap()
}

#[test]
fn the_guard_keeps_none_of_the_callers_descriptors() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let sandbox = Sandbox::new();
    // A pipe end without close-on-exec, as a CI runner passes one on:
    // leaderrun inherits it, and a guard that kept it would hold the pipe
    // open after leaderrun is gone.
    let (read_end, write_end) = nix::unistd::pipe().unwrap();
    let pipe = std::fs::metadata(format!("/proc/self/fd/{}", write_end.as_raw_fd()))
        .unwrap()
        .ino();
    let mut leader = sandbox
        .leaderrun("guard-fds")
        .sh("echo started > started; exec sleep 30")
        .spawn();
    drop(write_end);
    assert!(wait_until(LONG, || sandbox
        .read("started")
        .contains("started")));
    let guard = child_named(&leader, "leaderrun-guard");
    let fds: Vec<_> = std::fs::read_dir(format!("/proc/{guard}/fd"))
        .unwrap()
        .map(|entry| entry.unwrap())
        .collect();
    assert!(fds.len() >= 4, "the guard's descriptors: {fds:?}");
    for entry in &fds {
        let target = std::fs::read_link(entry.path()).unwrap_or_default();
        let fd: u32 = entry.file_name().to_string_lossy().parse().unwrap();
        if fd <= 2 {
            assert_eq!(target, std::path::Path::new("/dev/null"));
        }
        let inode = std::fs::metadata(entry.path()).map(|m| m.ino()).ok();
        assert_ne!(
            inode,
            Some(pipe),
            "the guard holds the caller's pipe as {fd}"
        );
    }
    leader.signal(Signal::SIGTERM);
    assert!(leader.wait(LONG).is_some());
    drop(read_end);
}

#[test]
fn the_guard_shares_no_memory_with_leaderrun() {
    // The OOM killer kills every process that shares its victim's memory:
    // a guard that shared leaderrun's would die with it, and leave the
    // term's processes running. The keeper of leaderrun's memory shares it
    // (so leaderrun's exit need not tear it down) and holds nothing else.
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("guard-memory")
        .sh("echo started > started; exec sleep 30")
        .spawn();
    assert!(wait_until(LONG, || sandbox
        .read("started")
        .contains("started")));
    let (guard, keeper) = (
        child_named(&leader, "leaderrun-guard"),
        child_named(&leader, "leaderrun-exit"),
    );
    // kcmp(2) with KCMP_VM: 0 when two processes share their memory.
    const KCMP_VM: libc::c_int = 1;
    let shares = |pid: i32| {
        // SAFETY: a query about two processes of this user.
        let same =
            unsafe { libc::syscall(libc::SYS_kcmp, leader.pid().as_raw(), pid, KCMP_VM, 0, 0) };
        assert!(same >= 0, "kcmp: {}", std::io::Error::last_os_error());
        same == 0
    };
    assert!(!shares(guard), "the guard shares leaderrun's memory");
    assert!(
        shares(keeper),
        "the keeper of leaderrun's memory does not share it"
    );
    let fds = std::fs::read_dir(format!("/proc/{keeper}/fd"))
        .unwrap()
        .count();
    assert_eq!(
        fds, 1,
        "the keeper of leaderrun's memory holds only its pipe"
    );
    leader.signal(Signal::SIGKILL);
    assert!(leader.wait(LONG).is_some());
    // Both go once leaderrun is gone.
    let gone = |pid: i32| {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|stat| stat.contains(") Z"))
    };
    assert!(wait_until(LONG, || gone(guard) && gone(keeper)));
}

#[test]
fn the_command_may_run_on_every_cpu_leaderrun_may() {
    // The child starts pinned to the spawning thread's CPU (so it need not
    // wait for an idle one to wake) and gets the CPUs back before it execs.
    let allowed = |status: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
            .map(|cpus| cpus.trim().to_owned())
            .expect("Cpus_allowed_list")
    };
    let ours = allowed(&std::fs::read_to_string("/proc/self/status").unwrap());
    let sandbox = Sandbox::new();
    for run in 0..3 {
        let out = sandbox
            .leaderrun("cpus")
            .command(["cat", "/proc/self/status"])
            .run();
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(allowed(&out.stdout), ours, "run {run}");
    }
}

/// What leaderrun changed of its signals does not reach the command: no
/// signal is blocked (leaderrun blocks SIGCHLD, read from a signalfd), none
/// of its handlers is left (they go with the exec, and none may run in the
/// child before it), and SIGPIPE, which the Rust runtime ignores, is back
/// to its default. A signal ignored when leaderrun started stays ignored
/// (here SIGALRM, as `nohup` does SIGHUP): that is the caller's to pass on.
/// The baseline is the same command started without leaderrun (signals 1
/// to 31: glibc keeps 32 and 33 for itself).
#[test]
fn the_command_gets_leaderruns_signals_as_leaderrun_got_them() {
    let sandbox = Sandbox::new();
    let status = "exec cat /proc/self/status";
    let signals = |through_leaderrun: bool| {
        let mut command = Command::new("sh");
        command.arg("-c").arg("trap '' ALRM; exec \"$@\"").arg("sh");
        if through_leaderrun {
            command.arg(BIN).args([
                "--backend",
                &sandbox.backend(),
                "--key",
                "signals",
                "-q",
                "--",
            ]);
        }
        let out = command
            .args(["sh", "-c", status])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mask = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
                .unwrap_or_else(|| panic!("no {name} in {text}"))
        };
        let standard = |m: u64| m & 0x7fff_ffff;
        (
            standard(mask("SigBlk:")),
            standard(mask("SigIgn:")),
            standard(mask("SigCgt:")),
        )
    };
    let direct = signals(false);
    let bit = |signal: Signal| 1u64 << (signal as i32 - 1);
    assert_eq!(
        direct.0 & bit(Signal::SIGCHLD),
        0,
        "the baseline blocks SIGCHLD"
    );
    assert_ne!(
        direct.1 & bit(Signal::SIGALRM),
        0,
        "the baseline ignores SIGALRM"
    );
    assert_eq!(
        direct.1 & bit(Signal::SIGPIPE),
        0,
        "the baseline ignores SIGPIPE"
    );
    assert_eq!(
        signals(true),
        direct,
        "(blocked, ignored, caught) as without leaderrun"
    );
}
