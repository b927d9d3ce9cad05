//! A real `redis-server` for tests, started on a free port in a private
//! directory, with no persistence (so a restart loses every key, as a
//! restart without AOF/RDB does). Tests stop, pause, restart and flush it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

pub struct RedisServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    pub port: u16,
    args: Vec<String>,
    /// `redis://…` (or `rediss://`, `redis+unix://`) without credentials.
    url: String,
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl RedisServer {
    /// A plain TCP server on 127.0.0.1.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A TCP server with extra `redis-server` arguments (ACL users, a
    /// password).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let port = free_port();
        let mut args = vec!["--port".to_owned(), port.to_string()];
        args.extend(extra.iter().map(|a| a.to_string()));
        Self::launch(args, port, format!("redis://127.0.0.1:{port}"))
    }

    /// A server on a unix socket only.
    pub fn start_unix() -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("leaderrun-redis-")
            .tempdir()
            .unwrap();
        let socket = dir.path().join("redis.sock");
        let args = vec![
            "--port".into(),
            "0".into(),
            "--unixsocket".into(),
            socket.display().to_string(),
            "--unixsocketperm".into(),
            "700".into(),
        ];
        let url = format!("redis+unix://{}", socket.display());
        Self::launch_in(dir, args, 0, url)
    }

    /// A TLS-only server with a certificate for `localhost` signed by a CA
    /// made for this test; returns the server and the CA's PEM file.
    pub fn start_tls() -> (RedisServer, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("leaderrun-redis-")
            .tempdir()
            .unwrap();
        let d = dir.path();
        let openssl = |args: &[&str]| {
            let ok = Command::new("openssl")
                .args(args)
                .current_dir(d)
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
            d.join("san.ext"),
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
        let port = free_port();
        let args = vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            d.join("server.pem").display().to_string(),
            "--tls-key-file".into(),
            d.join("server.key").display().to_string(),
            "--tls-ca-cert-file".into(),
            d.join("ca.pem").display().to_string(),
            "--tls-auth-clients".into(),
            "no".into(),
        ];
        let ca = d.join("ca.pem");
        let server = Self::launch_in(dir, args, port, format!("rediss://localhost:{port}"));
        (server, ca)
    }

    fn launch(args: Vec<String>, port: u16, url: String) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("leaderrun-redis-")
            .tempdir()
            .unwrap();
        Self::launch_in(dir, args, port, url)
    }

    fn launch_in(dir: tempfile::TempDir, args: Vec<String>, port: u16, url: String) -> RedisServer {
        let mut server = RedisServer {
            child: None,
            dir,
            port,
            args,
            url,
        };
        server.run();
        server
    }

    fn run(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).unwrap();
        let child = super::dies_with_the_test(&mut Command::new("redis-server"))
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("redis-server (scripts/test installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self
            .log()
            .to_lowercase()
            .contains("ready to accept connections")
        {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().unwrap().id() as i32)
    }

    /// SIGSTOP: connections stay open, nothing is answered.
    pub fn pause(&self) {
        kill(self.pid(), Signal::SIGSTOP).unwrap();
    }

    pub fn resume(&self) {
        kill(self.pid(), Signal::SIGCONT).unwrap();
    }

    /// SIGKILL and start again on the same port: every key is gone.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs one command through the sync client (with `auth` if given).
    pub fn command(&self, auth: Option<&str>, args: &[&str]) -> redis::RedisResult<redis::Value> {
        let url = match auth {
            Some(userinfo) => self.url.replacen("://", &format!("://{userinfo}@"), 1),
            None => self.url.clone(),
        };
        let client = redis::Client::open(url.as_str())?;
        let mut connection = client.get_connection_with_timeout(Duration::from_secs(5))?;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut connection)
    }

    /// Waits until the server has been up for `seconds`: before that,
    /// leaderrun holds acquisitions off (a fresh server may have lost a
    /// lease whose holder is still stopping).
    pub fn wait_uptime(&self, auth: Option<&str>, seconds: u64) {
        let deadline = Instant::now() + Duration::from_secs(seconds + 10);
        loop {
            let info = match self.command(auth, &["INFO", "server"]) {
                Ok(redis::Value::BulkString(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
                Ok(redis::Value::VerbatimString { text, .. }) => text,
                other => panic!("INFO failed: {other:?}"),
            };
            let uptime: u64 = info
                .lines()
                .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap();
            if uptime >= seconds {
                return;
            }
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
