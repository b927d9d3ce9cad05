//! A real `redis-server` for tests, started on a free port in a private
//! directory, with no persistence (so a restart loses every key, as a
//! restart without AOF/RDB does). Tests stop, pause, restart and flush it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
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
    /// A sentinel's configuration file (it runs with `--sentinel`).
    sentinel_conf: Option<PathBuf>,
    /// The CA of a TLS server, for `command`.
    ca: Option<PathBuf>,
}

/// A port nobody listens on right now, nor on the port 10000 above it,
/// where a cluster node listens for its bus (a bus port taken by another
/// process made a node fail to start).
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let bus = port.checked_add(10000);
        if bus.is_some_and(|bus| TcpListener::bind(("127.0.0.1", bus)).is_ok()) {
            return port;
        }
    }
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
        let certificates = Certificates::make_in(dir.path());
        let port = free_port();
        let args = certificates.server_args(port);
        let ca = certificates.ca.clone();
        let mut server = Self::launch_in(dir, args, port, format!("rediss://localhost:{port}"));
        server.ca = Some(ca.clone());
        (server, ca)
    }

    /// A TLS-only server (replication and cluster bus too) with the
    /// certificate of `certificates`, and `extra` arguments.
    pub fn start_tls_with(certificates: &Certificates, extra: &[&str]) -> RedisServer {
        let port = free_port();
        let mut args = certificates.server_args(port);
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut server = Self::launch(args, port, format!("rediss://127.0.0.1:{port}"));
        server.ca = Some(certificates.ca.clone());
        server
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
            sentinel_conf: None,
            ca: None,
        };
        server.run();
        server
    }

    /// A sentinel on a free port, monitoring `service` at `primary_port`
    /// (down after 1 s, failover timeout 5 s).
    pub fn sentinel(service: &str, primary_port: u16, quorum: u32) -> RedisServer {
        Self::sentinel_with(service, primary_port, quorum, None, None)
    }

    /// `sentinel`, asking for `password` (and giving it to the other
    /// sentinels), and with TLS only.
    pub fn sentinel_with(
        service: &str,
        primary_port: u16,
        quorum: u32,
        password: Option<&str>,
        tls: Option<&Certificates>,
    ) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("leaderrun-sentinel-")
            .tempdir()
            .unwrap();
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        let mut more = String::new();
        if let Some(p) = password {
            more.push_str(&format!("requirepass {p}\nsentinel sentinel-pass {p}\n"));
        }
        if let Some(tls) = tls {
            // Later lines win: no plain port, TLS to clients and servers.
            let args = tls.server_args(port);
            for pair in args.chunks(2) {
                more.push_str(&format!(
                    "{} {}\n",
                    pair[0].trim_start_matches("--"),
                    pair[1]
                ));
            }
        }
        std::fs::write(
            &conf,
            format!(
                "port {port}\ndir {}\nsentinel monitor {service} 127.0.0.1 {primary_port} {quorum}\nsentinel down-after-milliseconds {service} 1000\nsentinel failover-timeout {service} 5000\n{more}",
                dir.path().display()
            ),
        )
        .unwrap();
        let mut server = RedisServer {
            child: None,
            dir,
            port,
            args: Vec::new(),
            url: format!(
                "{}://127.0.0.1:{port}",
                if tls.is_some() { "rediss" } else { "redis" }
            ),
            sentinel_conf: Some(conf),
            ca: tls.map(|t| t.ca.clone()),
        };
        server.run();
        server
    }

    fn run(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).unwrap();
        let mut command = Command::new("redis-server");
        match &self.sentinel_conf {
            Some(conf) => command.arg(conf).arg("--sentinel"),
            None => command
                // A replica syncs at once, not after the 5 s the primary
                // waits by default for more replicas to share a transfer.
                .args(["--repl-diskless-sync-delay", "0"])
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(self.dir.path())
                .args(&self.args),
        };
        let child = super::dies_with_the_test(&mut command)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("redis-server (scripts/test installs it)");
        self.child = Some(child);
        let ready = if self.sentinel_conf.is_some() {
            "+monitor master"
        } else {
            "ready to accept connections"
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.log().to_lowercase().contains(ready) {
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
        let client = match &self.ca {
            Some(ca) => redis::Client::build_with_tls(
                url.as_str(),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(ca).unwrap()),
                },
            )?,
            None => redis::Client::open(url.as_str())?,
        };
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

/// A primary, a replica and three sentinels (quorum 2) watching service
/// `svc`, all on loopback.
pub struct SentinelSet {
    pub servers: Vec<RedisServer>,
    pub sentinels: Vec<RedisServer>,
    /// The sentinels' own password, if they have one.
    pub sentinel_password: Option<String>,
    _certificates: Option<Certificates>,
}

pub const SERVICE: &str = "svc";

impl SentinelSet {
    pub fn start() -> SentinelSet {
        Self::start_with(None, false)
    }

    /// A set whose sentinels ask for `sentinel_password` (and give it to
    /// each other); with `tls`, every server and sentinel speaks only TLS.
    pub fn start_with(sentinel_password: Option<&str>, tls: bool) -> SentinelSet {
        let certificates = tls.then(Certificates::make);
        let primary = match &certificates {
            Some(c) => RedisServer::start_tls_with(c, &[]),
            None => RedisServer::start(),
        };
        let replica_of = ["--replicaof", "127.0.0.1", &primary.port.to_string()];
        let replica = match &certificates {
            Some(c) => RedisServer::start_tls_with(c, &replica_of),
            None => RedisServer::start_with(&replica_of),
        };
        wait_replicated(&replica);
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::sentinel_with(
                    SERVICE,
                    primary.port,
                    2,
                    sentinel_password,
                    certificates.as_ref(),
                )
            })
            .collect();
        let set = SentinelSet {
            servers: vec![primary, replica],
            sentinels,
            sentinel_password: sentinel_password.map(str::to_owned),
            _certificates: certificates,
        };
        // Every sentinel knows the others and the replica.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !set.sentinels.iter().all(|s| {
            let known = set.sentinel_command(s, &["SENTINEL", "SENTINELS", SERVICE]);
            let replicas = set.sentinel_command(s, &["SENTINEL", "REPLICAS", SERVICE]);
            matches!((known, replicas), (Ok(redis::Value::Array(k)), Ok(redis::Value::Array(r))) if k.len() == 2 && r.len() == 1)
        }) {
            assert!(Instant::now() < deadline, "the sentinels did not find each other");
            std::thread::sleep(Duration::from_millis(100));
        }
        set.primary().wait_uptime(None, 2);
        set
    }

    /// The CA of a TLS set.
    pub fn ca(&self) -> Option<PathBuf> {
        self._certificates.as_ref().map(|c| c.ca.clone())
    }

    /// A command to one sentinel, with their password if they have one.
    pub fn sentinel_command(
        &self,
        sentinel: &RedisServer,
        args: &[&str],
    ) -> redis::RedisResult<redis::Value> {
        let auth = self.sentinel_password.as_ref().map(|p| format!(":{p}"));
        sentinel.command(auth.as_deref(), args)
    }

    /// `redis+sentinel://` naming all three sentinels.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let scheme = if self._certificates.is_some() {
            "rediss+sentinel"
        } else {
            "redis+sentinel"
        };
        format!("{scheme}://{}/{SERVICE}", hosts.join(","))
    }

    /// The port of the primary, as the first sentinel that answers says.
    pub fn primary_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            if let Ok(redis::Value::Array(address)) =
                self.sentinel_command(sentinel, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE])
                && let Some(redis::Value::BulkString(port)) = address.get(1)
            {
                return String::from_utf8_lossy(port).parse().unwrap();
            }
        }
        panic!("no sentinel answers")
    }

    pub fn primary(&self) -> &RedisServer {
        let port = self.primary_port();
        self.servers.iter().find(|s| s.port == port).unwrap()
    }

    pub fn replica(&self) -> &RedisServer {
        let port = self.primary_port();
        self.servers.iter().find(|s| s.port != port).unwrap()
    }

    /// A failover asked of the sentinels, once the replica has synced (a
    /// replica that has not is no good to them), repeated while they are
    /// still busy with the last one, and asked again if one accepted ends
    /// without a new primary (a sentinel aborts a failover whose replica
    /// does not turn primary within the failover timeout, and does not
    /// retry one that was asked for); returns the new primary's port.
    pub fn failover(&self) -> u16 {
        let old = self.primary_port();
        wait_replicated(self.replica());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.sentinel_command(&self.sentinels[0], &["SENTINEL", "FAILOVER", SERVICE]) {
                Ok(_) => {
                    if let Some(new) = self.new_primary_within(old, Duration::from_secs(15)) {
                        return new;
                    }
                }
                Err(e) => assert!(Instant::now() < deadline, "no failover: {e:?}"),
            }
            assert!(Instant::now() < deadline, "{}", self.no_failover());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Restarts the server on `port` (a primary that failed over), empty,
    /// as the new primary's replica, and waits until it synced. Told so at
    /// its start, as an operator's configuration would: the sentinels would
    /// convert it themselves, but only after seeing it as a primary for
    /// their failover timeout in INFO polled every 10 s, which took longer
    /// than 20 s on a busy CI machine.
    pub fn restart_as_replica(&mut self, port: u16) {
        let primary = self.primary_port().to_string();
        let server = self.servers.iter_mut().find(|s| s.port == port).unwrap();
        if let Some(at) = server.args.iter().position(|a| a == "--replicaof") {
            server.args.drain(at..at + 3);
        }
        server
            .args
            .extend(["--replicaof".to_owned(), "127.0.0.1".to_owned(), primary]);
        server.restart();
        let server = self.servers.iter().find(|s| s.port == port).unwrap();
        wait_replicated(server);
    }

    /// Waits until the sentinels name another primary than `old`, and it
    /// takes writes. A sentinel whose election failed (votes split) tries
    /// again only after twice the failover timeout (10 s here): 60 s.
    pub fn wait_new_primary(&self, old: u16) -> u16 {
        match self.new_primary_within(old, Duration::from_secs(60)) {
            Some(new) => new,
            None => panic!("{}", self.no_failover()),
        }
    }

    /// What a test that waited for a failover in vain says.
    fn no_failover(&self) -> String {
        format!(
            "no failover; the first sentinel's log:\n{}",
            self.sentinels[0].log()
        )
    }

    /// The new primary, once the sentinels name another than `old` and it
    /// takes writes; none if that does not happen `within`.
    fn new_primary_within(&self, old: u16, within: Duration) -> Option<u16> {
        let deadline = Instant::now() + within;
        loop {
            let now = self.primary_port();
            if now != old {
                let role = self
                    .servers
                    .iter()
                    .find(|s| s.port == now)
                    .unwrap()
                    .command(None, &["ROLE"]);
                if let Ok(redis::Value::Array(role)) = role
                    && matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master")
                {
                    return Some(now);
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits until a replica has synced with its primary.
pub fn wait_replicated(replica: &RedisServer) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(redis::Value::BulkString(info)) = replica.command(None, &["INFO", "replication"])
            && String::from_utf8_lossy(&info).contains("master_link_status:up")
        {
            return;
        }
        assert!(Instant::now() < deadline, "the replica did not sync");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Redis Cluster of three primaries with one replica each, on loopback
/// (node timeout 1 s).
pub struct Cluster {
    pub nodes: Vec<RedisServer>,
    certificates: Option<Certificates>,
}

impl Cluster {
    pub fn start() -> Cluster {
        Self::start_with(false)
    }

    /// With `tls`, every node speaks only TLS, the cluster bus too.
    pub fn start_with(tls: bool) -> Cluster {
        let certificates = tls.then(Certificates::make);
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "1000",
            "--cluster-config-file",
            "nodes.conf",
        ];
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| match &certificates {
                Some(c) => RedisServer::start_tls_with(c, &args),
                None => RedisServer::start_with(&args),
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut create = Command::new("redis-cli");
        if let Some(c) = &certificates {
            create.arg("--tls").arg("--cacert").arg(&c.ca);
        }
        let out = create
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli (scripts/test installs redis-tools)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Cluster {
            nodes,
            certificates,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster
            .nodes
            .iter()
            .all(|n| cluster_info(n).contains("cluster_state:ok"))
        {
            assert!(Instant::now() < deadline, "the cluster did not form");
            std::thread::sleep(Duration::from_millis(100));
        }
        // A replica that never synced refuses to take over.
        for node in &cluster.nodes {
            if matches!(node.command(None, &["INFO", "replication"]), Ok(redis::Value::BulkString(info))
                if String::from_utf8_lossy(&info).contains("role:slave"))
            {
                wait_replicated(node);
            }
        }
        for node in &cluster.nodes {
            node.wait_uptime(None, 2);
        }
        cluster
    }

    /// The CA of a TLS cluster.
    pub fn ca(&self) -> Option<PathBuf> {
        self.certificates.as_ref().map(|c| c.ca.clone())
    }

    /// `redis+cluster://` naming the first three nodes as seeds.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self.nodes[..3]
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let scheme = if self.certificates.is_some() {
            "rediss+cluster"
        } else {
            "redis+cluster"
        };
        format!("{scheme}://{}", seeds.join(","))
    }

    /// The node that serves `key`'s slot as primary now.
    pub fn primary_of(&self, key: &str) -> &RedisServer {
        let port = self
            .primary_port_of(key)
            .unwrap_or_else(|| panic!("no primary serves {key}"));
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    /// The port of the node that serves `key`'s slot as primary, as the
    /// first node that answers says; none while the slot is unserved.
    pub fn primary_port_of(&self, key: &str) -> Option<u16> {
        let slot = self
            .nodes
            .iter()
            .find_map(|n| match n.command(None, &["CLUSTER", "KEYSLOT", key]) {
                Ok(redis::Value::Int(slot)) => Some(slot),
                _ => None,
            })
            .expect("a node that answers");
        for node in &self.nodes {
            let Ok(redis::Value::BulkString(nodes)) = node.command(None, &["CLUSTER", "NODES"])
            else {
                continue;
            };
            for line in String::from_utf8_lossy(&nodes).lines() {
                let fields: Vec<&str> = line.split(' ').collect();
                if !fields[2].contains("master") || fields[2].contains("fail") {
                    continue;
                }
                let port: u16 = fields[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
                for range in &fields[8..] {
                    let (low, high) = range.split_once('-').unwrap_or((range, range));
                    if let (Ok(low), Ok(high)) = (low.parse::<i64>(), high.parse::<i64>())
                        && (low..=high).contains(&slot)
                    {
                        return Some(port);
                    }
                }
            }
            break;
        }
        None
    }

    /// Waits until `key`'s slot is served by a primary other than `old`.
    fn wait_slot_moved(&self, key: &str, old: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.primary_port_of(key) {
                Some(port) if port != old => return port,
                _ => assert!(Instant::now() < deadline, "no failover of {key}'s slot"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A failover of `key`'s slot asked of its primary's replica, which
    /// catches up first; returns once the replica serves the slot.
    pub fn failover(&self, key: &str) {
        let primary = self.primary_of(key);
        let replica = self.replica_of(primary);
        wait_replicated(replica);
        replica.command(None, &["CLUSTER", "FAILOVER"]).unwrap();
        self.wait_slot_moved(key, primary.port);
    }

    /// Kills the primary of `key`'s slot (SIGKILL); once its replica serves
    /// the slot, starts it again, empty: it rejoins as that one's replica.
    pub fn kill_primary(&mut self, key: &str) {
        let old = self.stop_primary(key);
        self.wait_slot_moved(key, old);
        self.rejoin(old);
    }

    /// Kills the primary of `key`'s slot (SIGKILL); returns its port.
    pub fn stop_primary(&mut self, key: &str) -> u16 {
        let old = self.primary_of(key).port;
        self.nodes
            .iter_mut()
            .find(|n| n.port == old)
            .unwrap()
            .stop();
        old
    }

    /// Starts the stopped node on `port` again, empty, and waits until it
    /// rejoined as a replica and synced.
    pub fn rejoin(&mut self, port: u16) {
        let node = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        node.run();
        wait_replicated(node);
    }

    /// The replica of the primary `primary`.
    pub fn replica_of(&self, primary: &RedisServer) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| {
                n.port != primary.port
                    && matches!(n.command(None, &["INFO", "replication"]), Ok(redis::Value::BulkString(info))
                        if String::from_utf8_lossy(&info).contains(&format!("master_port:{}", primary.port)))
            })
            .expect("a replica")
    }
}

fn cluster_info(node: &RedisServer) -> String {
    match node.command(None, &["CLUSTER", "INFO"]) {
        Ok(redis::Value::BulkString(info)) => String::from_utf8_lossy(&info).into_owned(),
        Ok(redis::Value::VerbatimString { text, .. }) => text,
        _ => String::new(),
    }
}

/// A CA made for one test, and a certificate it signed for `localhost` and
/// 127.0.0.1.
pub struct Certificates {
    _dir: Option<tempfile::TempDir>,
    pub ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Certificates {
    /// In a directory of their own.
    pub fn make() -> Certificates {
        let dir = tempfile::Builder::new()
            .prefix("leaderrun-certs-")
            .tempdir()
            .unwrap();
        let mut certificates = Self::make_in(dir.path());
        certificates._dir = Some(dir);
        certificates
    }

    /// In `d`, which the caller keeps.
    pub fn make_in(d: &Path) -> Certificates {
        super::make_certificates(d);
        Certificates {
            _dir: None,
            ca: d.join("ca.pem"),
            cert: d.join("server.pem"),
            key: d.join("server.key"),
        }
    }

    /// `redis-server` arguments for TLS only on `port`: to clients (who
    /// need not show a certificate), to replicas and on the cluster bus.
    pub fn server_args(&self, port: u16) -> Vec<String> {
        [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &self.cert.display().to_string(),
            "--tls-key-file",
            &self.key.display().to_string(),
            "--tls-ca-cert-file",
            &self.ca.display().to_string(),
            "--tls-auth-clients",
            "no",
            "--tls-replication",
            "yes",
            "--tls-cluster",
            "yes",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    }
}

impl Cluster {
    /// The node id of the node on `port`.
    fn node_id(&self, port: u16) -> String {
        let node = self.nodes.iter().find(|n| n.port == port).unwrap();
        match node.command(None, &["CLUSTER", "MYID"]) {
            Ok(redis::Value::BulkString(id)) => String::from_utf8(id).unwrap(),
            other => panic!("CLUSTER MYID: {other:?}"),
        }
    }

    /// Moves `key`'s slot to the primary on `to`, as `redis-cli --cluster
    /// reshard` does, one key at a time with `between` after each, so
    /// clients meet ASK and TRYAGAIN redirections meanwhile; then every
    /// node learns the new owner (MOVED for those that ask the old one).
    pub fn migrate_slot(&self, key: &str, to: u16, between: Duration) {
        let from = self.primary_of(key);
        let target = self.nodes.iter().find(|n| n.port == to).unwrap();
        let slot = match from.command(None, &["CLUSTER", "KEYSLOT", key]) {
            Ok(redis::Value::Int(slot)) => slot.to_string(),
            other => panic!("CLUSTER KEYSLOT: {other:?}"),
        };
        let (from_id, to_id) = (self.node_id(from.port), self.node_id(to));
        target
            .command(None, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])
            .unwrap();
        from.command(None, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])
            .unwrap();
        loop {
            let Ok(redis::Value::Array(keys)) =
                from.command(None, &["CLUSTER", "GETKEYSINSLOT", &slot, "1"])
            else {
                panic!("CLUSTER GETKEYSINSLOT")
            };
            let Some(redis::Value::BulkString(name)) = keys.first() else {
                break;
            };
            let name = String::from_utf8_lossy(name).into_owned();
            let port = to.to_string();
            from.command(
                None,
                &["MIGRATE", "127.0.0.1", &port, &name, "0", "5000", "REPLACE"],
            )
            .unwrap();
            std::thread::sleep(between);
        }
        for node in [target, from] {
            node.command(None, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])
                .unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.primary_port_of(key) != Some(to) {
            assert!(Instant::now() < deadline, "the slot did not move");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The primaries, by port.
    pub fn primaries(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| {
                matches!(n.command(None, &["ROLE"]), Ok(redis::Value::Array(role))
                    if matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master"))
            })
            .map(|n| n.port)
            .collect()
    }
}
