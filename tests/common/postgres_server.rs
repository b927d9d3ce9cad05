//! A real PostgreSQL for tests: `initdb` into a private directory (once per
//! test binary, then copied), the server started on a free port and a
//! socket in that directory, as the `postgres` user when the tests run as
//! root (PostgreSQL refuses root). Tests pause, stop and restart it, kill
//! sessions, and make roles.
//!
//! Authentication: the superuser `postgres` is trusted (socket and
//! loopback); every other role needs its password (SCRAM).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User};

use super::redis_server::free_port;

pub struct PostgresServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    pub port: u16,
    tls: bool,
}

/// The directory of PostgreSQL's programs: Debian keeps them out of PATH.
fn bin_dir() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let version = entry.file_name().to_str()?.parse().ok()?;
                let bin = entry.path().join("bin");
                bin.join("initdb").exists().then_some((version, bin))
            })
            .collect();
        versions.sort();
        if let Some((_, bin)) = versions.pop() {
            return bin;
        }
        let found = std::env::var_os("PATH")
            .and_then(|path| std::env::split_paths(&path).find(|dir| dir.join("initdb").exists()));
        found.expect("PostgreSQL's initdb (scripts/test installs the postgresql package)")
    })
}

/// The account the server runs as when the tests run as root.
fn server_user() -> Option<&'static User> {
    static USER: OnceLock<Option<User>> = OnceLock::new();
    USER.get_or_init(|| {
        if !nix::unistd::geteuid().is_root() {
            return None;
        }
        let user = User::from_name("postgres")
            .ok()
            .flatten()
            .or_else(|| User::from_name("nobody").ok().flatten());
        Some(user.expect("a postgres or nobody account to run the server as"))
    })
    .as_ref()
}

/// A command of PostgreSQL's, run as the server's account.
fn as_server(program: &str) -> Command {
    let mut command = Command::new(bin_dir().join(program));
    if let Some(user) = server_user() {
        command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    }
    command
        .env_remove("PGDATA")
        .env("LC_ALL", "C")
        .env("LANG", "C");
    command
}

/// A directory the server's account owns, private to it.
fn private_dir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    if let Some(user) = server_user() {
        nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid)).unwrap();
    }
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

static TEMPLATE: OnceLock<tempfile::TempDir> = OnceLock::new();

extern "C" fn remove_template() {
    if let Some(dir) = TEMPLATE.get() {
        let _ = std::fs::remove_dir_all(dir.path());
    }
}

/// A data directory made once per test binary, copied for each server.
fn template() -> &'static Path {
    TEMPLATE
        .get_or_init(|| {
            let dir = private_dir("leaderrun-pg-template-");
            let out = as_server("initdb")
                .arg("-D")
                .arg(dir.path().join("data"))
                .args(["-U", "postgres", "-A", "trust", "--no-sync"])
                .args(["-E", "UTF8", "--locale=C"])
                .output()
                .expect("initdb");
            assert!(
                out.status.success(),
                "initdb: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            // SAFETY: registers a plain function; it runs at the test
            // binary's exit and only removes the template's directory.
            unsafe { libc::atexit(remove_template) };
            std::fs::write(
                dir.path().join("data/pg_hba.conf"),
                "local all postgres trust\n\
                 local all all scram-sha-256\n\
                 host all postgres 127.0.0.1/32 trust\n\
                 host all all 127.0.0.1/32 scram-sha-256\n",
            )
            .unwrap();
            dir
        })
        .path()
}

impl PostgresServer {
    /// Whether PostgreSQL's programs are installed (the benchmark runs
    /// without them; the tests need them).
    pub fn installed() -> bool {
        std::fs::read_dir("/usr/lib/postgresql").is_ok_and(|mut d| d.next().is_some())
            || std::env::var_os("PATH").is_some_and(|path| {
                std::env::split_paths(&path).any(|dir| dir.join("initdb").exists())
            })
    }

    /// A server on 127.0.0.1 and a socket, without TLS.
    pub fn start() -> PostgresServer {
        Self::launch(false)
    }

    /// A server that also takes TLS, with a certificate for `localhost` and
    /// 127.0.0.1 signed by a CA made for the test: `ca_file()`.
    pub fn start_tls() -> PostgresServer {
        Self::launch(true)
    }

    fn launch(tls: bool) -> PostgresServer {
        let dir = private_dir("leaderrun-pg-");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(template().join("data"))
            .arg(dir.path().join("data"))
            .status()
            .unwrap();
        assert!(copied.success(), "cp -a the template");
        if tls {
            make_certificates(dir.path());
        }
        let mut server = PostgresServer {
            child: None,
            dir,
            port: free_port(),
            tls,
        };
        server.run();
        server
    }

    /// Starts the server (again, after a stop) on the same port and data.
    pub fn run(&mut self) {
        let d = self.dir.path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("server.log"))
            .unwrap();
        let mut command = as_server("postgres");
        command
            .arg("-D")
            .arg(d.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(d)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "max_connections=300"]);
        if self.tls {
            command
                .args(["-c", "ssl=on"])
                .arg("-c")
                .arg(format!("ssl_cert_file={}", d.join("server.pem").display()))
                .arg("-c")
                .arg(format!("ssl_key_file={}", d.join("server.key").display()));
        }
        super::dies_with_the_test(&mut command);
        let child = command
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(bin_dir().join("pg_isready"))
                .arg("-q")
                .arg("-h")
                .arg(d)
                .args(["-p", &self.port.to_string()])
                .status()
                .unwrap()
                .success();
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not start:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA that signed a TLS server's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`, plain TCP.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
            self.port
        )
    }

    /// A URL for `user` (password given separately) on database `db`.
    pub fn url_for(&self, user: &str, password: Option<&str>, db: &str) -> String {
        let auth = match password {
            Some(password) => format!("{user}:{password}"),
            None => user.to_owned(),
        };
        format!("postgres://{auth}@127.0.0.1:{}/{db}", self.port)
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().unwrap().id() as i32)
    }

    /// SIGSTOP every process of the server: connections stay open, nothing
    /// is answered. (Each backend is a session of its own: PostgreSQL calls
    /// setsid in every child, so a signal to the postmaster's group misses
    /// them.)
    pub fn pause(&self) {
        for pid in self.processes() {
            let _ = kill(pid, Signal::SIGSTOP);
        }
    }

    pub fn resume(&self) {
        for pid in self.processes() {
            let _ = kill(pid, Signal::SIGCONT);
        }
    }

    /// The postmaster and its children.
    fn processes(&self) -> Vec<Pid> {
        let Some(child) = &self.child else {
            return Vec::new();
        };
        let postmaster = child.id() as i32;
        let mut pids = vec![Pid::from_raw(postmaster)];
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            // /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces.
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok());
            if ppid == Some(postmaster) {
                pids.push(Pid::from_raw(pid));
            }
        }
        pids
    }

    /// Stops the server: `Signal::SIGINT` is a fast shutdown, `SIGQUIT` an
    /// immediate one (a crash: recovery on the next start).
    pub fn stop_with(&mut self, signal: Signal) {
        let children = self.processes();
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), signal);
            let _ = child.wait();
            // A killed postmaster's backends notice only at their next
            // wait: kill them too.
            if signal == Signal::SIGKILL {
                for pid in children {
                    let _ = kill(pid, Signal::SIGKILL);
                }
            }
        }
    }

    /// Runs SQL as the superuser over the socket (`psql -v` variables from
    /// `vars`); panics on an error.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = self.psql_as("postgres", db, &["-c", sql]);
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// psql with `args`, as `user`, over the socket.
    pub fn psql_as(&self, user: &str, db: &str, args: &[&str]) -> Output {
        self.psql_command(user, db)
            .args(args)
            .output()
            .expect("psql")
    }

    /// psql as `user` on `db` over the socket, stopping at the first error;
    /// add its arguments.
    pub fn psql_command(&self, user: &str, db: &str) -> Command {
        let mut command = Command::new(bin_dir().join("psql"));
        command
            .arg("-h")
            .arg(self.dir.path())
            .args(["-p", &self.port.to_string(), "-U", user, "-d", db])
            .args(["-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"])
            .env_remove("PGPASSWORD")
            .env_remove("PGPASSFILE");
        command
    }

    /// A role that logs in with `password`, and a database it owns.
    pub fn create_user(&self, user: &str, password: &str, owns_db: Option<&str>) {
        self.psql(
            "postgres",
            &format!("CREATE ROLE {user} LOGIN PASSWORD '{password}'"),
        );
        if let Some(db) = owns_db {
            self.psql("postgres", &format!("CREATE DATABASE {db} OWNER {user}"));
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.resume();
        self.stop_with(Signal::SIGKILL);
    }
}

/// A CA and a certificate for `localhost` and 127.0.0.1, in `dir`, the key
/// readable by the server's account only.
fn make_certificates(dir: &Path) {
    super::make_certificates(dir);
    std::fs::set_permissions(
        dir.join("server.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::fs::set_permissions(dir.join("ca.pem"), std::fs::Permissions::from_mode(0o644)).unwrap();
    if let Some(user) = server_user() {
        for file in ["server.key", "server.pem"] {
            nix::unistd::chown(&dir.join(file), Some(user.uid), Some(user.gid)).unwrap();
        }
    }
}
