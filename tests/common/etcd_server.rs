//! Real etcd members on loopback (Debian's `etcd-server`; `scripts/test`
//! installs it), with data directories the harness removes: one member for
//! most tests, three for failures. Heartbeat 50 ms and election timeout
//! 250 ms, so a 1 s lease stays 1 s (etcd's smallest is 1.5 election
//! timeouts) and an election takes well under a second.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::redis_server::free_port;

pub struct Member {
    child: Option<Child>,
    pub name: String,
    pub client_port: u16,
    peer_port: u16,
    data: PathBuf,
    cluster: String,
    log: PathBuf,
    /// TLS to clients, with the certificates in this directory, and
    /// whether a client must show one.
    tls: Option<(PathBuf, bool)>,
}

impl Member {
    fn run(&mut self) {
        let log = std::fs::File::create(&self.log).unwrap();
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        command
            .args(["--name", &self.name, "--data-dir"])
            .arg(&self.data)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &self.cluster])
            .args([
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "leaderrun-test",
            ])
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
            .args(["--logger=zap", "--log-level=warn"]);
        if let Some((dir, client_auth)) = &self.tls {
            command
                .arg("--cert-file")
                .arg(dir.join("server.pem"))
                .arg("--key-file")
                .arg(dir.join("server.key"))
                .arg("--trusted-ca-file")
                .arg(dir.join("ca.pem"));
            if *client_auth {
                command.arg("--client-cert-auth");
            }
        }
        command.stdout(Stdio::null()).stderr(log);
        let child = super::dies_with_the_test(&mut command)
            .spawn()
            .expect("etcd (scripts/test installs etcd-server)");
        self.child = Some(child);
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32)
    }

    pub fn pause(&self) {
        kill(self.pid(), Signal::SIGSTOP).unwrap();
    }

    pub fn resume(&self) {
        kill(self.pid(), Signal::SIGCONT).unwrap();
    }

    /// SIGKILL, as a crash.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the member again on its data.
    pub fn start(&mut self) {
        self.stop();
        self.run();
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// `GET /health` says so (`etcdctl endpoint health` over TLS).
    fn healthy(&self) -> bool {
        if let Some((dir, _)) = &self.tls {
            return Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .arg(format!("--endpoints=https://{}", self.endpoint()))
                .arg(format!("--cacert={}", dir.join("ca.pem").display()))
                .arg(format!("--cert={}", dir.join("server.pem").display()))
                .arg(format!("--key={}", dir.join("server.key").display()))
                .args(["endpoint", "health", "--command-timeout=500ms"])
                .output()
                .is_ok_and(|out| out.status.success());
        }
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let request = format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.client_port
        );
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut reply = String::new();
        let _ = stream.read_to_string(&mut reply);
        reply.contains("\"health\":\"true\"")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A cluster of one or three members.
pub struct EtcdCluster {
    pub members: Vec<Member>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    pub fn start(size: usize) -> EtcdCluster {
        Self::start_with(size, None)
    }

    /// One member speaking only TLS to clients, with a certificate signed
    /// by a CA made for the test (`ca.pem`, also good for a client
    /// certificate: `server.pem`, `server.key`), which it asks clients for
    /// if `client_auth`. Returns the directory of the certificates too.
    pub fn start_tls(client_auth: bool) -> (EtcdCluster, PathBuf) {
        let certs = tempfile::Builder::new()
            .prefix("leaderrun-etcd-certs-")
            .tempdir()
            .unwrap()
            .keep();
        super::make_certificates(&certs);
        (
            Self::start_with(1, Some((certs.clone(), client_auth))),
            certs,
        )
    }

    fn start_with(size: usize, tls: Option<(PathBuf, bool)>) -> EtcdCluster {
        // A port found free may be taken by another test before etcd binds
        // it: then start again on others.
        for _ in 0..3 {
            if let Some(cluster) = Self::try_start(size, tls.clone()) {
                return cluster;
            }
        }
        Self::try_start(size, tls).expect("etcd could not bind its ports")
    }

    fn try_start(size: usize, tls: Option<(PathBuf, bool)>) -> Option<EtcdCluster> {
        let dir = tempfile::Builder::new()
            .prefix("leaderrun-etcd-")
            .tempdir()
            .unwrap();
        let ports: Vec<(u16, u16)> = (0..size).map(|_| (free_port(), free_port())).collect();
        let cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<Member> = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| Member {
                child: None,
                name: format!("m{i}"),
                client_port: *client,
                peer_port: *peer,
                data: dir.path().join(format!("m{i}.data")),
                cluster: cluster.clone(),
                log: dir.path().join(format!("m{i}.log")),
                tls: tls.clone(),
            })
            .collect();
        for member in &mut members {
            member.run();
        }
        let mut cluster = EtcdCluster { members, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster.members.iter().all(Member::healthy) && Instant::now() < deadline {
            if cluster
                .members
                .iter()
                .any(|m| m.log().contains("address already in use"))
            {
                for member in &mut cluster.members {
                    member.stop();
                }
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster.wait_healthy();
        Some(cluster)
    }

    /// Waits until every running member is healthy (has a leader).
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self
            .members
            .iter()
            .filter(|m| m.child.is_some())
            .all(Member::healthy)
        {
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy:\n{}",
                self.members.iter().map(Member::log).collect::<String>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `etcd://` (`etcds://` with TLS) naming every member.
    pub fn url(&self) -> String {
        let endpoints: Vec<String> = self.members.iter().map(Member::endpoint).collect();
        let scheme = if self.members[0].tls.is_some() {
            "etcds"
        } else {
            "etcd"
        };
        format!("{scheme}://{}", endpoints.join(","))
    }

    /// Runs `etcdctl` against every member.
    pub fn etcdctl(&self, args: &[&str]) -> std::process::Output {
        let endpoints: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("http://{}", m.endpoint()))
            .collect();
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", endpoints.join(",")))
            .args(args)
            .output()
            .expect("etcdctl (scripts/test installs etcd-client)")
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            member.stop();
        }
    }
}

impl EtcdCluster {
    /// The index of the member that leads the cluster now.
    pub fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let running: Vec<String> = self
                .members
                .iter()
                .filter(|m| m.child.is_some())
                .map(|m| format!("http://{}", m.endpoint()))
                .collect();
            let out = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .arg(format!("--endpoints={}", running.join(",")))
                .args(["endpoint", "status", "-w", "json", "--command-timeout=1s"])
                .output()
                .unwrap();
            if let Ok(serde_json::Value::Array(all)) = serde_json::from_slice(&out.stdout) {
                for status in &all {
                    let me = &status["Status"]["header"]["member_id"];
                    if !me.is_null() && *me == status["Status"]["leader"] {
                        let endpoint = status["Endpoint"].as_str().unwrap_or_default();
                        if let Some(i) = self
                            .members
                            .iter()
                            .position(|m| endpoint.ends_with(&m.endpoint()))
                        {
                            return i;
                        }
                    }
                }
            }
            assert!(Instant::now() < deadline, "no etcd leader");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
