//! The chaos suite: three replicas of the seed's publisher write into a
//! fenced SQLite store while a seeded schedule of faults hits the leader, the
//! backend and the network. Afterwards it prints and asserts:
//!
//! - zero stale writes: the store never accepted a token lower than one it
//!   had already accepted;
//! - children of different replicas ran at the same time only while a
//!   supervisor was paused or partitioned, and then the store refused the old
//!   child's writes (the total overlap and its causes are printed);
//! - no process started by any term is alive at the end;
//! - availability: the share of time the publisher was served (> 70%; 50%
//!   behind Sentinel and in a Cluster, where a killed primary costs a
//!   failover and one ttl of hold-off; 60% on etcd, whose faults include a
//!   whole-cluster restart).
//!
//! `CHAOS_SECONDS` (default 40: a round of every fault on Redis and on
//! PostgreSQL, and more on the file backend) sets how long faults are injected and
//! `CHAOS_SEED` the schedule; a failing run prints its seed. Replicas that
//! exit are restarted like containers.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd_server::EtcdCluster;
use common::postgres_server::PostgresServer;
use common::proxy::Proxy;
use common::redis_server::{Cluster, RedisServer, SentinelSet};
use common::{BIN, FAST, wait_until};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The test timing: ttl 2 s, so a supervisor paused for 3 s loses its lease.
const TTL: Duration = Duration::from_secs(2);
const REPLICAS: usize = 3;

/// xorshift64*: a tiny seeded generator, so a schedule can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

/// Wall-clock nanoseconds, the clock the publisher's `date +%s%N` uses.
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Three replicas, each restarted like a container when it exits.
struct Fleet {
    slots: Arc<Mutex<Vec<Option<Child>>>>,
    stopping: Arc<AtomicBool>,
    restarts: Arc<Mutex<u32>>,
}

impl Fleet {
    fn start(spawn: Arc<dyn Fn(usize) -> Child + Send + Sync>) -> Fleet {
        let slots: Arc<Mutex<Vec<Option<Child>>>> =
            Arc::new(Mutex::new((0..REPLICAS).map(|i| Some(spawn(i))).collect()));
        let stopping = Arc::new(AtomicBool::new(false));
        let restarts = Arc::new(Mutex::new(0));
        let (s, stop, count) = (slots.clone(), stopping.clone(), restarts.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(300));
                let mut slots = s.lock().unwrap();
                for (i, slot) in slots.iter_mut().enumerate() {
                    let exited = slot
                        .as_mut()
                        .is_none_or(|c| c.try_wait().unwrap().is_some());
                    if exited && !stop.load(Ordering::SeqCst) {
                        *slot = Some(spawn(i));
                        *count.lock().unwrap() += 1;
                    }
                }
            }
        });
        Fleet {
            slots,
            stopping,
            restarts,
        }
    }

    fn pid(&self, replica: usize) -> Option<Pid> {
        self.slots.lock().unwrap()[replica]
            .as_ref()
            .map(|c| Pid::from_raw(c.id() as i32))
    }

    /// Stops every replica gracefully and waits for it.
    fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let mut slots = self.slots.lock().unwrap();
        for child in slots.iter_mut().flatten() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGCONT);
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        }
        for child in slots.iter_mut().flatten() {
            let deadline = Instant::now() + Duration::from_secs(15);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A test that fails before `stop` removes its directory: the restarting
/// thread must not start replicas into it (it panicked, in another test's
/// output).
impl Drop for Fleet {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillLeader,
    StopLeader,
    PauseLeader,
    PauseBackendShort,
    PauseBackendLong,
    RestartBackend,
    DropConnections,
    PartitionLeader,
    /// A failover the sentinels are asked for.
    Failover,
    /// The primary killed: the sentinels fail over, and it comes back as
    /// a replica.
    KillPrimary,
}

impl Fault {
    /// Whether children of two replicas may overlap during this fault: the
    /// old leader cannot stop its child while it is paused or cut off.
    fn excuses_overlap(self) -> bool {
        matches!(self, Fault::PauseLeader | Fault::PartitionLeader)
    }
}

/// A fault as it happened: when, and which replica it hit (if one).
struct Window {
    fault: Fault,
    start: u128,
    end: u128,
}

/// What the backend under test offers the suite.
enum Backend {
    Redis {
        server: RedisServer,
        proxies: Vec<Proxy>,
    },
    File {
        dir: PathBuf,
    },
    Postgres {
        server: PostgresServer,
        proxies: Vec<Proxy>,
        /// Restarts alternate between a fast and an immediate shutdown.
        restarts: u32,
    },
    Sentinel {
        set: SentinelSet,
    },
    Cluster {
        cluster: Cluster,
    },
    /// Three members; each replica reaches each member through a proxy of
    /// its own.
    Etcd {
        cluster: EtcdCluster,
        proxies: Vec<Vec<Proxy>>,
    },
}

struct Run {
    dir: tempfile::TempDir,
    marker: String,
    backend: Backend,
    /// Shard mode: every replica runs `--shards N`; each shard publishes to
    /// a store of its own.
    shards: Option<u32>,
}

impl Run {
    /// The shards' names in the attempts log (`-` for one lease).
    fn shard_names(&self) -> Vec<String> {
        match self.shards {
            Some(n) => (0..n).map(|i| i.to_string()).collect(),
            None => vec!["-".into()],
        }
    }

    /// The store of a shard (`-`: the one lease's).
    fn db(&self, shard: &str) -> PathBuf {
        match shard {
            "-" => self.dir.path().join("digests.db"),
            shard => self.dir.path().join(format!("digests.{shard}.db")),
        }
    }

    fn url(&self, replica: Option<usize>) -> String {
        match &self.backend {
            Backend::Redis { server, proxies } => match replica {
                Some(i) => format!("redis://127.0.0.1:{}", proxies[i].port),
                None => server.url().to_owned(),
            },
            Backend::File { dir } => format!("file:{}", dir.display()),
            Backend::Postgres {
                server, proxies, ..
            } => match replica {
                Some(i) => format!(
                    "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
                    proxies[i].port
                ),
                None => server.url(),
            },
            Backend::Sentinel { set } => set.url(),
            Backend::Cluster { cluster } => cluster.url(),
            Backend::Etcd { cluster, proxies } => match replica {
                Some(i) => {
                    let members: Vec<String> = proxies[i]
                        .iter()
                        .map(|p| format!("127.0.0.1:{}", p.port))
                        .collect();
                    format!("etcd://{}", members.join(","))
                }
                None => cluster.url(),
            },
        }
    }

    /// The share of time the publisher must be served: 70%; behind
    /// Sentinel and in a Cluster 50%, where a killed primary costs a
    /// failover and, by design, one ttl of hold-off after it; on etcd 60%,
    /// whose faults include restarting the whole cluster (seconds with no
    /// etcd at all), and whose every new leader extends every lease by its
    /// ttl.
    fn availability_floor(&self) -> f64 {
        match self.backend {
            Backend::Sentinel { .. } | Backend::Cluster { .. } => 0.50,
            Backend::Etcd { .. } => 0.60,
            _ => 0.70,
        }
    }

    fn faults(&self) -> Vec<Fault> {
        // On the replicas, on every backend; on one server (or its members).
        let replicas = [Fault::KillLeader, Fault::StopLeader, Fault::PauseLeader];
        let server = [
            Fault::PauseBackendShort,
            Fault::PauseBackendLong,
            Fault::RestartBackend,
            Fault::DropConnections,
            Fault::PartitionLeader,
        ];
        let more: &[Fault] = match self.backend {
            Backend::Redis { .. } | Backend::Postgres { .. } => &server,
            Backend::Etcd { .. } => &[&server[..], &[Fault::KillPrimary]].concat(),
            Backend::Sentinel { .. } | Backend::Cluster { .. } => {
                &[Fault::Failover, Fault::KillPrimary]
            }
            Backend::File { .. } => &server[..2],
        };
        [&replicas[..], more].concat()
    }

    fn leader(&self) -> Option<usize> {
        let out = Command::new(BIN)
            .args([
                "status",
                "--backend",
                &self.url(None),
                "--key",
                "chaos",
                "--json",
            ])
            .output()
            .ok()?;
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        // In shard mode, the replica that runs shard 0.
        let holder = match self.shards {
            Some(_) => &status["by_shard"][0]["holder"],
            None => &status["holder"],
        };
        holder.as_str()?.strip_prefix('r')?.parse().ok()
    }

    /// Holds the file backend's mutex byte from another process for `d`.
    fn block_file_backend(&self, d: Duration) {
        let Backend::File { dir } = &self.backend else {
            return;
        };
        let Some(lease) = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "lease"))
        else {
            return;
        };
        let script = format!(
            "import fcntl, os, time\nfd = os.open({:?}, os.O_RDWR)\nfcntl.lockf(fd, fcntl.LOCK_EX, 1, 1 << 40)\ntime.sleep({})\n",
            lease.display().to_string(),
            d.as_secs_f64()
        );
        let _ = Command::new("python3").args(["-c", &script]).status();
    }
}

fn suite(mut run: Run) {
    let seconds: u64 = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_129);
    let name = match run.backend {
        Backend::Redis { .. } => "redis",
        Backend::File { .. } => "file",
        Backend::Postgres { .. } => "postgres",
        Backend::Sentinel { .. } => "redis sentinel",
        Backend::Cluster { .. } => "redis cluster",
        Backend::Etcd { .. } => "etcd",
    };
    let mode = run
        .shards
        .map_or(String::new(), |n| format!(" in shard mode ({n} shards)"));
    println!(
        "chaos on the {name} backend{mode}: {seconds} s of faults, seed {seed} (CHAOS_SEED to replay)"
    );
    let db = run.db("-");
    let store = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/publisher/store.sh");
    for shard in run.shard_names() {
        assert!(
            Command::new(&store)
                .arg("init")
                .env("DIGESTS_DB", run.db(&shard))
                .status()
                .unwrap()
                .success()
        );
    }

    let spawn: Arc<dyn Fn(usize) -> Child + Send + Sync> = {
        let urls: Vec<String> = (0..REPLICAS).map(|i| run.url(Some(i))).collect();
        let (dir, marker, store, db, shards) = (
            run.dir.path().to_owned(),
            run.marker.clone(),
            store.clone(),
            db.clone(),
            run.shards,
        );
        // Each shard's claim goes to its shard's store.
        let claim = match shards {
            Some(_) => format!(
                "DIGESTS_DB=\"$CHAOS_DIR/digests.$LEADERRUN_SHARD.db\" {} claim",
                store.display()
            ),
            None => format!("{} claim", store.display()),
        };
        let publisher = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chaos/publish.sh");
        Arc::new(move |i: usize| {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join(format!("r{i}.log")))
                .unwrap();
            common::dies_with_the_test(&mut Command::new(BIN))
                .args([
                    "--backend",
                    &urls[i],
                    "--key",
                    "chaos",
                    "--owner",
                    &format!("r{i}"),
                ])
                .args(FAST)
                .args(shards.map(|n| format!("--shards={n}")))
                .arg("--claim-cmd")
                .arg(&claim)
                .arg("--")
                .arg(&publisher)
                .env("DIGESTS_DB", &db)
                .env("STORE", &store)
                .env("CHAOS_DIR", &dir)
                .env("CHAOS_RUN", &marker)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        })
    };
    let fleet = Fleet::start(spawn);
    let attempts = run.dir.path().join("attempts");
    assert!(
        wait_until(Duration::from_secs(30), || std::fs::read_to_string(
            &attempts
        )
        .is_ok_and(|a| !a.is_empty())),
        "nobody published"
    );

    let mut rng = Rng(seed | 1);
    let mut windows = Vec::new();
    let started = now_ns();
    let finish = Instant::now() + Duration::from_secs(seconds);
    // Rounds of every fault the backend has, each round in a seeded order.
    let mut round: Vec<Fault> = Vec::new();
    while Instant::now() < finish {
        if round.is_empty() {
            round = run.faults();
            for i in (1..round.len()).rev() {
                round.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        std::thread::sleep(rng.millis(1500, 3000));
        let Some(leader) = run.leader() else { continue };
        let fault = round.pop().unwrap();
        let start = now_ns();
        inject(&mut run, &fleet, fault, leader, &mut rng);
        windows.push(Window {
            fault,
            start,
            end: now_ns(),
        });
    }
    let faults_over = now_ns();
    // Let the last fault play out before stopping everything.
    std::thread::sleep(Duration::from_secs(3));
    fleet.stop();

    let report = analyse(&run, &attempts, &windows, started, faults_over);
    let restarts = *fleet.restarts.lock().unwrap();
    let mut counts: BTreeMap<Fault, usize> = BTreeMap::new();
    for w in &windows {
        *counts.entry(w.fault).or_default() += 1;
    }
    println!("faults: {counts:?}; replicas restarted {restarts} times");
    println!("{report}");
    assert!(
        report.violations.is_empty(),
        "seed {seed}: {:?}",
        report.violations
    );
    let floor = run.availability_floor();
    assert!(
        report.availability > floor,
        "seed {seed}: availability {:.1}%, below {:.0}%",
        report.availability * 100.0,
        floor * 100.0
    );
}

fn inject(run: &mut Run, fleet: &Fleet, fault: Fault, leader: usize, rng: &mut Rng) {
    let signal_leader = |signal: Signal| {
        if let Some(pid) = fleet.pid(leader) {
            let _ = kill(pid, signal);
        }
    };
    match fault {
        Fault::KillLeader => signal_leader(Signal::SIGKILL),
        Fault::StopLeader => signal_leader(Signal::SIGTERM),
        Fault::PauseLeader => {
            signal_leader(Signal::SIGSTOP);
            std::thread::sleep(TTL + rng.millis(500, 1500));
            signal_leader(Signal::SIGCONT);
        }
        Fault::PauseBackendShort | Fault::PauseBackendLong => {
            // The renewal budget is 600 ms with the test timing.
            let pause = if fault == Fault::PauseBackendShort {
                rng.millis(100, 400)
            } else {
                rng.millis(900, 2000)
            };
            match &run.backend {
                Backend::Redis { server, .. } => {
                    server.pause();
                    std::thread::sleep(pause);
                    server.resume();
                }
                Backend::Postgres { server, .. } => {
                    server.pause();
                    std::thread::sleep(pause);
                    server.resume();
                }
                Backend::File { .. } => run.block_file_backend(pause),
                Backend::Etcd { cluster, .. } => {
                    for member in &cluster.members {
                        member.pause();
                    }
                    std::thread::sleep(pause);
                    for member in &cluster.members {
                        member.resume();
                    }
                }
                Backend::Sentinel { .. } | Backend::Cluster { .. } => {}
            }
        }
        Fault::RestartBackend => match &mut run.backend {
            Backend::Redis { server, .. } => server.restart(),
            Backend::Postgres {
                server, restarts, ..
            } => {
                *restarts += 1;
                let shutdown = if *restarts % 2 == 1 {
                    Signal::SIGINT
                } else {
                    Signal::SIGQUIT
                };
                server.stop_with(shutdown);
                server.run();
            }
            Backend::Etcd { cluster, .. } => {
                // The whole cluster, on its data: tokens must not go back.
                for member in &mut cluster.members {
                    member.stop();
                }
                for member in &mut cluster.members {
                    member.start();
                }
                cluster.wait_healthy();
            }
            Backend::File { .. } | Backend::Sentinel { .. } | Backend::Cluster { .. } => {}
        },
        Fault::DropConnections => match &run.backend {
            Backend::Redis { proxies, .. } | Backend::Postgres { proxies, .. } => {
                proxies[leader].drop_connections();
            }
            Backend::Etcd { proxies, .. } => {
                for proxy in &proxies[leader] {
                    proxy.drop_connections();
                }
            }
            Backend::File { .. } | Backend::Sentinel { .. } | Backend::Cluster { .. } => {}
        },
        Fault::PartitionLeader => match &run.backend {
            Backend::Redis { proxies, .. } | Backend::Postgres { proxies, .. } => {
                proxies[leader].black_hole(true);
                std::thread::sleep(TTL + rng.millis(500, 1500));
                proxies[leader].black_hole(false);
            }
            Backend::Etcd { proxies, .. } => {
                for proxy in &proxies[leader] {
                    proxy.black_hole(true);
                }
                std::thread::sleep(TTL + rng.millis(500, 1500));
                for proxy in &proxies[leader] {
                    proxy.black_hole(false);
                }
            }
            Backend::File { .. } | Backend::Sentinel { .. } | Backend::Cluster { .. } => {}
        },
        Fault::Failover => match &run.backend {
            Backend::Sentinel { set } => {
                set.failover();
            }
            Backend::Cluster { cluster } => cluster.failover(LEASE),
            _ => {}
        },
        Fault::KillPrimary => match &mut run.backend {
            Backend::Sentinel { set } => {
                let old = set.primary_port();
                let primary = set.servers.iter_mut().find(|s| s.port == old).unwrap();
                primary.stop();
                set.wait_new_primary(old);
                // Back, empty, as the sentinels' replica of the new primary.
                set.restart_as_replica(old);
            }
            Backend::Cluster { cluster } => cluster.kill_primary(LEASE),
            Backend::Etcd { cluster, .. } => {
                // The etcd leader member, killed and started again.
                let leader = cluster.leader();
                cluster.members[leader].stop();
                std::thread::sleep(rng.millis(500, 1500));
                cluster.members[leader].start();
                cluster.wait_healthy();
            }
            _ => {}
        },
    }
}

/// One child's run, from its write attempts.
#[derive(Debug)]
struct Term {
    owner: String,
    token: u64,
    first: u128,
    last: u128,
}

struct Report {
    accepted: usize,
    stale: usize,
    overlap_ms: BTreeMap<String, f64>,
    violations: Vec<String>,
    /// The least share of time any shard (or the one lease) was served.
    availability: f64,
    per_shard: Vec<(String, f64)>,
    orphans: usize,
    torn: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "accepted writes: {}; stale writes accepted: {}",
            self.accepted, self.stale
        )?;
        let total: f64 = self.overlap_ms.values().fold(0.0, |sum, ms| sum + ms);
        let causes: Vec<String> = self
            .overlap_ms
            .iter()
            .map(|(cause, ms)| format!("{ms:.0} ms during {cause}"))
            .collect();
        let causes = if causes.is_empty() {
            "none".to_owned()
        } else {
            causes.join(", ")
        };
        writeln!(
            f,
            "children of two replicas overlapping: {total:.0} ms in all ({causes})"
        )?;
        writeln!(f, "processes left alive: {}", self.orphans)?;
        if self.torn > 0 {
            writeln!(f, "attempt lines cut short by a kill: {}", self.torn)?;
        }
        if self.per_shard.len() > 1 {
            let each: Vec<String> = self
                .per_shard
                .iter()
                .map(|(shard, a)| format!("shard {shard} {:.1}%", a * 100.0))
                .collect();
            writeln!(f, "served per shard: {}", each.join(", "))?;
        }
        write!(
            f,
            "availability: {:.1}% of the time served",
            self.availability * 100.0
        )
    }
}

fn analyse(
    run: &Run,
    attempts: &Path,
    windows: &[Window],
    started: u128,
    faults_over: u128,
) -> Report {
    let text = std::fs::read_to_string(attempts).unwrap();
    let mut report = Report {
        accepted: 0,
        stale: 0,
        overlap_ms: BTreeMap::new(),
        violations: Vec::new(),
        availability: 1.0,
        per_shard: Vec::new(),
        orphans: 0,
        torn: 0,
    };
    for shard in run.shard_names() {
        let lines = text
            .lines()
            .filter(|line| line.rsplit(' ').next() == Some(shard.as_str()));
        let (accepted, stale, availability) = analyse_shard(
            &run.db(&shard),
            lines,
            windows,
            started,
            faults_over,
            &mut report,
        );
        report.accepted += accepted;
        report.stale += stale;
        report.availability = report.availability.min(availability);
        report.per_shard.push((shard, availability));
    }

    // No process of any term left behind.
    std::thread::sleep(Duration::from_millis(500));
    let needle = format!("CHAOS_RUN={}", run.marker);
    let orphans = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .count();
    if orphans > 0 {
        report
            .violations
            .push(format!("{orphans} processes of the run are still alive"));
    }
    report.orphans = orphans;
    report
}

/// One lease's (one shard's) writes: the accepted and stale writes in its
/// store, its overlaps (into `report`), and the share of time it was served.
fn analyse_shard<'a>(
    db: &Path,
    lines: impl Iterator<Item = &'a str>,
    windows: &[Window],
    started: u128,
    faults_over: u128,
    report: &mut Report,
) -> (usize, usize, f64) {
    let violations = &mut report.violations;

    // 1. Zero stale writes: accepted tokens never go down.
    let out = Command::new("sqlite3")
        .args(["-batch", "-cmd", ".timeout 10000"])
        .arg(db)
        .arg("SELECT token FROM published ORDER BY seq")
        .output()
        .unwrap();
    let tokens: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    let stale = tokens.windows(2).filter(|w| w[1] < w[0]).count();
    if stale > 0 {
        violations.push(format!("{}: {stale} stale writes accepted", db.display()));
    }

    // 2. Overlap of children of different replicas, attributed to faults.
    let mut terms: BTreeMap<u32, Term> = BTreeMap::new();
    let mut served = Vec::new();
    for line in lines {
        let f: Vec<&str> = line.split(' ').collect();
        let [t, token, accepted, pid, owner, _shard] = f[..] else {
            continue;
        };
        // A publisher killed at its term's end can leave a line without its
        // time (the `date` it was running died first): count, don't parse.
        let (Ok(t), Ok(token), Ok(pid)) =
            (t.parse::<u128>(), token.parse::<u64>(), pid.parse::<u32>())
        else {
            report.torn += 1;
            continue;
        };
        let term = terms.entry(pid).or_insert(Term {
            owner: owner.to_owned(),
            token,
            first: t,
            last: t,
        });
        term.last = t;
        if accepted == "1" {
            served.push(t);
        }
    }
    let terms: Vec<Term> = terms.into_values().collect();
    let ttl = TTL.as_nanos();
    for (i, a) in terms.iter().enumerate() {
        for b in &terms[i + 1..] {
            if a.owner == b.owner {
                continue;
            }
            let (from, to) = (a.first.max(b.first), a.last.min(b.last));
            if from >= to {
                continue;
            }
            let ms = (to - from) as f64 / 1e6;
            // The store must have refused the older term's writes from the
            // newer term's first accepted write on, in the store's own order
            // (the log's timestamps are taken after each write returns).
            let (old, new) = if a.token < b.token { (a, b) } else { (b, a) };
            if let Some(first_new) = tokens.iter().position(|t| *t == new.token) {
                if tokens[first_new..].contains(&old.token) {
                    violations.push(format!(
                        "token {} wrote after token {} had written",
                        old.token, new.token
                    ));
                }
            }
            let cause = windows
                .iter()
                .find(|w| w.fault.excuses_overlap() && w.start <= to && from <= w.end + ttl)
                .map(|w| format!("{:?}", w.fault));
            match cause {
                Some(cause) => *report.overlap_ms.entry(cause).or_default() += ms,
                None => {
                    *report.overlap_ms.entry("unexplained".into()).or_default() += ms;
                    violations.push(format!(
                        "{a:?} and {b:?} overlapped {ms:.1} ms with no paused or partitioned leader"
                    ));
                }
            }
        }
    }

    // 3. Availability: time within 250 ms after an accepted write.
    served.sort();
    let window = 250_000_000u128;
    let mut covered = 0u128;
    let mut until = started;
    for t in served
        .into_iter()
        .filter(|t| *t >= started && *t <= faults_over)
    {
        let end = (t + window).min(faults_over);
        if end > until {
            covered += end - t.max(until);
            until = end;
        }
    }
    let availability = covered as f64 / (faults_over - started) as f64;
    (tokens.len(), stale, availability)
}

fn marker() -> String {
    format!("{}-{}", std::process::id(), now_ns())
}

#[test]
fn chaos_on_redis() {
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    let proxies = (0..REPLICAS).map(|_| Proxy::start(server.port)).collect();
    suite(Run {
        dir: tempfile::Builder::new()
            .prefix("leaderrun-chaos-")
            .tempdir()
            .unwrap(),
        marker: marker(),
        shards: None,
        backend: Backend::Redis { server, proxies },
    });
}

#[test]
fn chaos_on_postgres() {
    let server = PostgresServer::start();
    let proxies = (0..REPLICAS).map(|_| Proxy::start(server.port)).collect();
    suite(Run {
        dir: tempfile::Builder::new()
            .prefix("leaderrun-chaos-")
            .tempdir()
            .unwrap(),
        marker: marker(),
        shards: None,
        backend: Backend::Postgres {
            server,
            proxies,
            restarts: 0,
        },
    });
}

#[test]
fn chaos_on_etcd() {
    suite(Run {
        dir: tempfile::Builder::new()
            .prefix("leaderrun-chaos-")
            .tempdir()
            .unwrap(),
        marker: marker(),
        shards: None,
        backend: etcd_behind_proxies(),
    });
}

#[test]
fn chaos_on_redis_sentinel() {
    suite(Run {
        dir: tempfile::Builder::new()
            .prefix("leaderrun-chaos-")
            .tempdir()
            .unwrap(),
        marker: marker(),
        shards: None,
        backend: Backend::Sentinel {
            set: SentinelSet::start(),
        },
    });
}

/// The key of the chaos suite's lease, as Redis names it.
const LEASE: &str = "leaderrun:{chaos}:lease";

#[test]
fn chaos_on_redis_cluster() {
    suite(Run {
        dir: tempfile::Builder::new()
            .prefix("leaderrun-chaos-")
            .tempdir()
            .unwrap(),
        marker: marker(),
        shards: None,
        backend: Backend::Cluster {
            cluster: Cluster::start(),
        },
    });
}

#[test]
fn chaos_on_the_file_backend() {
    let dir = tempfile::Builder::new()
        .prefix("leaderrun-chaos-")
        .tempdir()
        .unwrap();
    let state = dir.path().join("state");
    suite(Run {
        dir,
        marker: marker(),
        shards: None,
        backend: Backend::File { dir: state },
    });
}

/// Shard mode: three replicas split four shards, each publishing to a store
/// of its own, under the same faults (the "leader" is the replica that runs
/// shard 0); every shard is checked as a lease of its own.
fn shard_chaos(backend: Backend, dir: tempfile::TempDir) {
    suite(Run {
        dir,
        marker: marker(),
        shards: Some(4),
        backend,
    });
}

fn chaos_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("leaderrun-chaos-")
        .tempdir()
        .unwrap()
}

#[test]
fn chaos_in_shard_mode_on_the_file_backend() {
    let dir = chaos_dir();
    let state = dir.path().join("state");
    shard_chaos(Backend::File { dir: state }, dir);
}

#[test]
fn chaos_in_shard_mode_on_redis() {
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    let proxies = (0..REPLICAS).map(|_| Proxy::start(server.port)).collect();
    shard_chaos(Backend::Redis { server, proxies }, chaos_dir());
}

#[test]
fn chaos_in_shard_mode_on_etcd() {
    shard_chaos(etcd_behind_proxies(), chaos_dir());
}

/// Three etcd members; each replica reaches each member through a proxy of
/// its own.
fn etcd_behind_proxies() -> Backend {
    let cluster = EtcdCluster::start(3);
    let proxies = (0..REPLICAS)
        .map(|_| {
            cluster
                .members
                .iter()
                .map(|m| Proxy::start(m.client_port))
                .collect()
        })
        .collect();
    Backend::Etcd { cluster, proxies }
}
