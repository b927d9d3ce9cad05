//! The test harness: runs the built `leaderrun` binary as a user would, in a
//! private temporary directory, and looks at what a user would see: exit
//! codes, log lines, the files children wrote, which pids are alive.

#![allow(dead_code)]

pub mod etcd_server;
pub mod postgres_server;
pub mod proxy;
pub mod redis_server;

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

pub const BIN: &str = env!("CARGO_BIN_EXE_leaderrun");

/// Makes a process the harness starts die with the test that started it:
/// when the test's thread ends, also when the whole test run is killed
/// (SIGKILL, a CI timeout), so no supervisor or server outlives it.
pub fn dies_with_the_test(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure only makes async-signal-safe system calls.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The test died before the prctl: too late for the signal.
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            Ok(())
        })
    }
}

/// Timing for tests: a 2 s ttl keeps waits short; the budget for a backend
/// outage is ttl − renew − grace − release − margin = 600 ms.
pub const FAST: [&str; 12] = [
    "--ttl",
    "2s",
    "--renew-every",
    "400ms",
    "--campaign-every",
    "100ms",
    "--margin",
    "200ms",
    "--yield-grace",
    "500ms",
    "--release-timeout",
    "300ms",
];

/// FAST as environment variables (`LEADERRUN_TTL=2s`, …), for scripts that
/// run leaderrun themselves.
pub fn fast_env() -> Vec<(String, String)> {
    FAST.chunks(2)
        .map(|pair| {
            let name = pair[0]
                .trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase();
            (format!("LEADERRUN_{name}"), pair[1].to_owned())
        })
        .collect()
}

/// A private directory for one test, removed when the test ends.
pub struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    pub fn new() -> Sandbox {
        Sandbox {
            dir: tempfile::Builder::new()
                .prefix("leaderrun-test-")
                .tempdir()
                .expect("temp dir"),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn state_dir(&self) -> PathBuf {
        self.path("state")
    }

    /// The file backend URL of this sandbox.
    pub fn backend(&self) -> String {
        format!("file:{}", self.state_dir().display())
    }

    /// `leaderrun --backend <sandbox> --key <key> <FAST timing>`; add the
    /// command with `.sh(..)` or `.command(..)`.
    pub fn leaderrun(&self, key: &str) -> Run {
        self.leaderrun_on(&self.backend(), key)
    }

    /// The same on another backend (a Redis URL).
    pub fn leaderrun_on(&self, backend: &str, key: &str) -> Run {
        let mut run = Run::new(self.dir.path());
        run.args(["--backend", backend, "--key", key]).args(FAST);
        run
    }

    /// A replica that leads `key` on `backend` until the sandbox's `stop`
    /// file appears (then its command writes `a-ended`), once its command
    /// has started.
    pub fn leader_until_stop(&self, backend: &str, key: &str) -> Replica {
        let leader = self
            .leaderrun_on(backend, key)
            .sh("touch a-started; while [ ! -e stop ]; do sleep 0.01; done; date +%s%N > a-ended")
            .spawn();
        assert!(wait_until(Duration::from_secs(20), || self
            .path("a-started")
            .exists()));
        leader
    }

    /// A graceful handover to a follower that polls only every 10 s: how
    /// long after the leader's command ended the follower's started, and
    /// the follower's token.
    pub fn graceful_handover(&self, backend: &str, key: &str) -> (Duration, String) {
        let long = Duration::from_secs(20);
        let mut leader = self.leader_until_stop(backend, key);
        let mut follower = self
            .leaderrun_on(backend, key)
            .args(["--campaign-every", "10s"])
            .sh("date +%s%N > b-started; echo $LEADERRUN_TOKEN > b-token")
            .spawn();
        assert!(follower.wait_log("campaign started", long));
        std::thread::sleep(Duration::from_millis(500)); // the follower is waiting now
        fs::write(self.path("stop"), "").unwrap();
        assert_eq!(leader.wait(long), Some(0));
        assert_eq!(follower.wait(long), Some(0), "{}", follower.stderr());
        let ended: u128 = self.read("a-ended").trim().parse().unwrap();
        let started: u128 = self.read("b-started").trim().parse().unwrap();
        let gap = Duration::from_nanos((started - ended) as u64);
        (gap, self.read("b-token").trim().to_owned())
    }

    /// The whole contents of a file the children wrote, or "" if none yet.
    pub fn read(&self, name: &str) -> String {
        fs::read_to_string(self.path(name)).unwrap_or_default()
    }

    /// The non-empty lines of a file the children wrote.
    pub fn lines(&self, name: &str) -> Vec<String> {
        self.read(name)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Takes the mutex byte of the sandbox's only lease file from a Python
    /// process, as a replica stopped in the middle of a read-modify-write
    /// would: leaderrun cannot ask the file backend until it is killed.
    pub fn hold_the_mutex(&self) -> std::process::Child {
        let file = fs::read_dir(self.state_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "lease"))
            .expect("a lease file");
        let _ = fs::remove_file(self.path("blocked"));
        let script = format!(
            "import fcntl, os, time\nfd = os.open({:?}, os.O_RDWR)\nfcntl.lockf(fd, fcntl.LOCK_EX, 1, 1 << 40)\nopen('blocked', 'w').close()\ntime.sleep(60)\n",
            file.display().to_string()
        );
        let blocker = dies_with_the_test(&mut Command::new("python3"))
            .args(["-c", &script])
            .current_dir(self.path(""))
            .spawn()
            .expect("python3");
        assert!(wait_until(Duration::from_secs(20), || self
            .path("blocked")
            .exists()));
        blocker
    }

    /// Waits until a file holds a number (a pid a child wrote) and returns it.
    pub fn wait_pid(&self, name: &str) -> Pid {
        let path = self.path(name);
        let mut pid = None;
        assert!(
            wait_until(Duration::from_secs(10), || {
                pid = fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| t.trim().parse().ok());
                pid.is_some()
            }),
            "no pid in {}",
            path.display()
        );
        Pid::from_raw(pid.unwrap())
    }
}

/// A leaderrun command line being built.
pub struct Run {
    cmd: Command,
    dir: PathBuf,
    added_command: bool,
}

impl Run {
    pub fn new(dir: &Path) -> Run {
        let mut cmd = Command::new(BIN);
        dies_with_the_test(&mut cmd);
        cmd.current_dir(dir)
            .env_remove("LEADERRUN_BACKEND")
            .env_remove("LEADERRUN_KEY")
            .env_remove("LEADERRUN_LOG")
            .env("SANDBOX", dir)
            .stdin(Stdio::null());
        Run {
            cmd,
            dir: dir.to_owned(),
            added_command: false,
        }
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Run {
        self.cmd.arg(arg);
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, args: I) -> &mut Run {
        self.cmd.args(args);
        self
    }

    pub fn env(&mut self, name: &str, value: impl AsRef<OsStr>) -> &mut Run {
        self.cmd.env(name, value);
        self
    }

    pub fn env_remove(&mut self, name: &str) -> &mut Run {
        self.cmd.env_remove(name);
        self
    }

    /// The command to lead with: `-- sh -c <script>`. The script runs in the
    /// sandbox directory, which is also in `$SANDBOX`.
    pub fn sh(&mut self, script: &str) -> &mut Run {
        self.command(["sh", "-c", script])
    }

    pub fn command<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, command: I) -> &mut Run {
        assert!(!self.added_command, "command given twice");
        self.added_command = true;
        self.cmd.arg("--").args(command);
        self
    }

    pub fn spawn(&mut self) -> Replica {
        let n = NEXT_LOG.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stderr = self.dir.join(format!("leaderrun-{n}.stderr"));
        let stdout = self.dir.join(format!("leaderrun-{n}.stdout"));
        self.cmd
            .stderr(fs::File::create(&stderr).unwrap())
            .stdout(fs::File::create(&stdout).unwrap());
        let child = self.cmd.spawn().expect("spawn leaderrun");
        Replica {
            child,
            stderr,
            stdout,
            status: None,
        }
    }

    /// Runs to completion (at most 30 s) and returns what it printed.
    pub fn run(&mut self) -> Finished {
        let mut replica = self.spawn();
        let code = replica
            .wait(Duration::from_secs(30))
            .expect("leaderrun did not finish in 30 s");
        Finished {
            code,
            stdout: replica.stdout(),
            stderr: replica.stderr(),
        }
    }
}

static NEXT_LOG: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[derive(Debug)]
pub struct Finished {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// A running leaderrun. Killed (SIGKILL) if the test drops it still running.
pub struct Replica {
    child: std::process::Child,
    stderr: PathBuf,
    stdout: PathBuf,
    status: Option<ExitStatus>,
}

impl Replica {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    pub fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).expect("signal leaderrun");
    }

    /// Waits for exit; returns the exit code (128+N for a signal).
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.status.or_else(|| self.child.try_wait().unwrap()) {
                self.status = Some(status);
                use std::os::unix::process::ExitStatusExt;
                return Some(
                    status
                        .code()
                        .unwrap_or_else(|| 128 + status.signal().unwrap()),
                );
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn running(&mut self) -> bool {
        self.wait(Duration::ZERO).is_none()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Waits until the log has a line containing `needle`.
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> bool {
        wait_until(timeout, || self.stderr().contains(needle))
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Polls `condition` every 5 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `pid` is a living process (not gone, not a zombie).
pub fn alive(pid: Pid) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            !matches!(state, Some("Z") | Some("X") | None)
        }
        Err(_) => false,
    }
}

/// Waits until `pid` is dead; returns how long that took, or None.
pub fn wait_dead(pid: Pid, timeout: Duration) -> Option<Duration> {
    let start = Instant::now();
    wait_until(timeout, || !alive(pid)).then(|| start.elapsed())
}

/// GET over plain HTTP/1.1: (status, body).
pub fn get(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split(' ').nth(1).unwrap().parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `kill -9` of a leader (its supervisor only) while a follower waits: the
/// follower's command starts soon after, never while the old command (which
/// holds a lock on `held`) still runs. Returns how long after the kill it
/// started. `args` are the timing both replicas run with.
pub fn takeover_after_the_supervisor_dies(
    sandbox: &Sandbox,
    backend: &str,
    args: &[&str],
) -> Duration {
    let long = Duration::from_secs(30);
    let held = sandbox.path("held");
    let leader = sandbox
        .leaderrun_on(backend, "supervisor-dies")
        .args(args)
        .sh(&format!(
            "exec 9>{}; flock 9; touch leading; exec sleep 300",
            held.display()
        ))
        .spawn();
    assert!(
        wait_until(long, || sandbox.path("leading").exists()),
        "{}",
        leader.stderr()
    );
    let mut follower = sandbox
        .leaderrun_on(backend, "supervisor-dies")
        .args(args)
        .args(["--campaign-every", "10s"])
        .sh(&format!(
            "if flock -n {} true; then echo clean; else echo overlap; fi > b-started",
            held.display()
        ))
        .spawn();
    assert!(follower.wait_log("campaign started", long));
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    leader.signal(Signal::SIGKILL);
    assert!(
        wait_until(long, || sandbox.read("b-started").contains('\n')),
        "{}",
        follower.stderr()
    );
    let took = killed.elapsed();
    assert_eq!(
        sandbox.read("b-started").trim(),
        "clean",
        "the old command still ran"
    );
    assert_eq!(follower.wait(long), Some(0));
    took
}

/// Whether this machine lets a process make cgroups (a writable cgroup2
/// hierarchy: root here), as leaderrun's `--containment cgroup` needs.
pub fn cgroups_writable() -> bool {
    let sandbox = Sandbox::new();
    let out = Command::new(BIN)
        .args(["--containment", "cgroup", "--key", "probe", "--backend"])
        .arg(format!("file://{}", sandbox.state_dir().display()))
        .args(["--", "true"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    out.status.success()
}

/// Kills a pid if it is still alive (cleanup for processes a test expected
/// leaderrun to kill).
pub fn ensure_dead(pid: Pid) {
    if alive(pid) {
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// A CA made for one test (`ca.pem`, `ca.key`) and a certificate it signed
/// for `localhost` and 127.0.0.1 (`server.pem`, `server.key`), in `dir`.
pub fn make_certificates(dir: &Path) {
    let openssl = |args: &[&str]| {
        let ok = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl")
            .success();
        assert!(ok, "openssl {args:?}");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=leaderrun test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ]);
}

/// A command that records its pid and token (in `pids` and `tokens`) and
/// runs until stopped.
pub const RUNS: &str = "echo $$ >> pids; echo $LEADERRUN_TOKEN >> tokens; trap 'exit 0' TERM; while :; do sleep 0.02; done";

/// The tokens `RUNS` recorded, in order.
pub fn tokens(sandbox: &Sandbox) -> Vec<u64> {
    sandbox
        .lines("tokens")
        .iter()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// A leader on `url` running `RUNS` with `options`, once its first term's
/// command started.
pub fn first_term(sandbox: &Sandbox, url: &str, key: &str, options: &[&str]) -> Replica {
    let leader = sandbox
        .leaderrun_on(url, key)
        .args(options)
        .sh(RUNS)
        .spawn();
    assert!(
        wait_until(Duration::from_secs(30), || tokens(sandbox).len() == 1),
        "{}",
        leader.stderr()
    );
    leader
}

/// 100 followers of one key on `backend` wait in `notice` while a leader
/// holds it; once `placed` says every follower has its place, the leader
/// releases: how many followers woke (one, for a line without a herd).
pub fn wakes_of_a_hundred_followers(
    backend: &dyn leaderrun::backend::Backend,
    placed: impl Fn(&[std::sync::Arc<dyn leaderrun::backend::LeaseStore>]) -> bool,
) -> usize {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use leaderrun::backend::{Attempt, Identity, LeaseConfig, LeaseStore};

    let store = |owner: &str| -> Arc<dyn LeaseStore> {
        backend
            .lease(LeaseConfig {
                key: "crowd".into(),
                me: Identity::new(owner),
                ttl: Duration::from_secs(30),
                call_timeout: Duration::from_secs(5),
                hand_over: false,
            })
            .unwrap()
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let leader = store("leader");
            leader.check().await.unwrap();
            let Ok(Attempt::Acquired { token }) = leader.acquire(1).await else {
                panic!("not acquired");
            };
            let wakes = Arc::new(AtomicUsize::new(0));
            let mut followers = Vec::new();
            let mut tasks = Vec::new();
            for i in 0..100 {
                let (follower, wakes) = (store(&format!("f{i}")), wakes.clone());
                followers.push(follower.clone());
                tasks.push(tokio::spawn(async move {
                    loop {
                        follower.notice().await;
                        wakes.fetch_add(1, Ordering::SeqCst);
                    }
                }));
            }
            let since = Instant::now();
            while !placed(&followers) {
                assert!(
                    since.elapsed() < Duration::from_secs(30),
                    "not every follower took a place"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // A new place may wake its follower once: let that pass.
            tokio::time::sleep(Duration::from_millis(500)).await;
            wakes.store(0, Ordering::SeqCst);
            assert!(leader.release(token).await.unwrap());
            tokio::time::sleep(Duration::from_secs(1)).await;
            for task in tasks {
                task.abort();
            }
            wakes.load(Ordering::SeqCst)
        })
}

/// A follower's store waits in line (its notice pending, in a task of its
/// own) until it has its place: a release would wake it now.
pub async fn waiting_in_line(
    store: &std::sync::Arc<dyn leaderrun::backend::LeaseStore>,
) -> tokio::task::JoinHandle<()> {
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.notice().await })
    };
    let placed = Instant::now();
    while !store.wakes_on_release() {
        assert!(
            placed.elapsed() < Duration::from_secs(20),
            "the follower never got its place in line"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    waiting
}
