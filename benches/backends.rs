//! Benchmarks of leaderrun on both backends, printed as one table:
//!
//! - whole-process cycle of `leaderrun --key k -- true`, next to
//!   `flock FILE true` (file target: within 2× flock; Redis target: at most
//!   half of `etcdctl lock`'s 24–29 ms);
//! - graceful handover, from the first child's last action to the second
//!   child's first (file target: p50 ≤ 2 ms; Redis: p50 ≤ 3 ms, p99 ≤ 10 ms);
//! - crash failover, from `kill -9` of the leader to the follower's child,
//!   and for Redis its excess over the lease's remaining ttl (target ≤ 50 ms);
//! - RSS of a leading leaderrun (targets: 4 MB file, 5 MB Redis);
//! - an idle follower's CPU, and its Redis commands per second.
//!
//! Run with `cargo bench --bench backends`. `LEADERRUN_BENCH_N` sets the
//! number of samples (default 200). Redis needs `redis-server` on PATH.
//!
//! The children are `benches/stamp.c`, compiled here: a static C program
//! that writes CLOCK_MONOTONIC (shared by every process on the host) to a
//! file as its first and last actions, so the figures are leaderrun's, not a
//! shell's start-up.

use std::collections::VecDeque;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_leaderrun");
/// Hold value for a child that runs until killed.
const FOREVER: i64 = -1;

fn main() {
    let samples: usize = std::env::var("LEADERRUN_BENCH_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::Builder::new()
        .prefix("leaderrun-bench-")
        .tempdir()
        .unwrap();
    let stamp = compile_stamp(dir.path());
    println!("leaderrun benchmark: {samples} samples per row, times in ms");
    println!("{}", machine());
    println!();
    println!("| measure | p50 | p90 | p99 | mean |");
    println!("|---|---|---|---|---|");
    let lock = dir.path().join("flock.lock");
    let flock = time_runs(samples, || {
        Command::new("flock")
            .arg(&lock)
            .arg("true")
            .status()
            .unwrap()
    });
    row("cycle: flock FILE true", &flock);

    let file = Bench {
        name: "file",
        url: format!("file:{}", dir.path().join("state").display()),
        dir: dir.path().to_owned(),
        stamp: stamp.clone(),
        redis: None,
    };
    let file_results = file.run(samples, &flock);

    let redis = redis_server(dir.path());
    let redis_results = redis.as_ref().map(|(_, port)| {
        Bench {
            name: "redis",
            url: format!("redis://127.0.0.1:{port}"),
            dir: dir.path().to_owned(),
            stamp: stamp.clone(),
            redis: Some(redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap()),
        }
        .run(samples, &flock)
    });

    println!();
    for line in file_results
        .into_iter()
        .chain(redis_results.into_iter().flatten())
    {
        println!("{line}");
    }
    if let Some((mut server, _)) = redis {
        let _ = server.kill();
        let _ = server.wait();
    } else {
        println!("redis: skipped (no redis-server on PATH)");
    }
}

struct Bench {
    name: &'static str,
    url: String,
    dir: PathBuf,
    stamp: PathBuf,
    redis: Option<redis::Client>,
}

impl Bench {
    /// Prints this backend's rows; returns its summary lines.
    fn run(&self, samples: usize, flock: &[f64]) -> Vec<String> {
        let name = self.name;
        let cycle = time_runs(samples, || {
            self.leaderrun("cycle")
                .args(["--", "true"])
                .status()
                .unwrap()
        });
        row(&format!("{name}: cycle leaderrun --key k -- true"), &cycle);
        let handover = self.handover(samples);
        row(&format!("{name}: graceful handover"), &handover);
        let (failover, excess) = self.failover(samples.min(30));
        row(
            &format!("{name}: crash failover (kill -9 → next child)"),
            &failover,
        );
        if let Some(excess) = &excess {
            row(
                &format!("{name}: crash failover beyond the remaining ttl"),
                excess,
            );
        }
        let (rss, pss, guard) = self.rss();
        let (cpu, commands) = self.idle_follower();
        let mut lines = vec![
            format!(
                "{name}: cycle p50 {:.2}× flock's",
                percentile(&cycle, 50.0) / percentile(flock, 50.0)
            ),
            format!(
                "{name}: RSS of a leading leaderrun {rss} kB (PSS {pss} kB), its guard {guard} kB"
            ),
            format!("{name}: idle follower CPU {cpu:.3} ms/s"),
        ];
        if let Some(commands) = commands {
            lines.push(format!(
                "{name}: idle follower Redis commands {commands:.2}/s"
            ));
        }
        lines
    }

    fn leaderrun(&self, key: &str) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(["--backend", &self.url, "--key", key, "-q"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        cmd
    }

    /// leaderrun leading a stamp child that holds `hold_ms` (FOREVER: until killed).
    fn stamped(&self, key: &str, stamps: &Path, hold_ms: i64) -> Command {
        let mut cmd = self.leaderrun(key);
        cmd.env("LEADERRUN_BENCH_STAMP", stamps)
            .env("LEADERRUN_BENCH_HOLD_MS", hold_ms.to_string())
            .arg("--")
            .arg(&self.stamp);
        cmd
    }

    /// Replicas queue up on one key; each child stamps, holds 20 ms, stamps
    /// and exits, and the next replica (already waiting) takes over.
    fn handover(&self, samples: usize) -> Vec<f64> {
        let stamps = self.dir.join(format!("{}-handover.stamps", self.name));
        let spawn = || self.stamped("handover", &stamps, 20).spawn().unwrap();
        let mut queue: VecDeque<Child> = (0..3).map(|_| spawn()).collect();
        for round in 0..samples {
            let mut leader = queue.pop_front().unwrap();
            leader.wait().unwrap();
            // Start the replacement only once the next term has begun, so its
            // start-up does not compete with the handover being measured.
            wait_for_lines(&stamps, 2 * round + 3);
            queue.push_back(spawn());
        }
        for mut replica in queue {
            let _ = replica.kill();
            let _ = replica.wait();
        }
        gaps(&stamps)
    }

    /// A leader whose child runs forever is killed with SIGKILL while a
    /// follower waits. Returns the takeover times and, for Redis, how much
    /// later than the lease's remaining ttl at the kill they came. A 2 s ttl
    /// keeps the Redis rows short; the excess does not depend on it.
    fn failover(&self, samples: usize) -> (Vec<f64>, Option<Vec<f64>>) {
        let mut takeovers = Vec::new();
        let mut excess = Vec::new();
        for i in 0..samples {
            let stamps = self.dir.join(format!("{}-failover-{i}.stamps", self.name));
            let key = format!("failover-{i}");
            let short = [
                ("LEADERRUN_TTL", "2s"),
                ("LEADERRUN_RENEW_EVERY", "500ms"),
                ("LEADERRUN_YIELD_GRACE", "500ms"),
                ("LEADERRUN_RELEASE_TIMEOUT", "300ms"),
                ("LEADERRUN_MARGIN", "200ms"),
            ];
            let mut leader = self
                .stamped(&key, &stamps, FOREVER)
                .envs(short)
                .spawn()
                .unwrap();
            wait_for_lines(&stamps, 1);
            let mut follower = self.stamped(&key, &stamps, 0).envs(short).spawn().unwrap();
            std::thread::sleep(Duration::from_millis(100));
            let remaining = self.redis.as_ref().map(|client| {
                let mut connection = client.get_connection().unwrap();
                let pttl: i64 = redis::cmd("PTTL")
                    .arg(format!("leaderrun:{{{key}}}:lease"))
                    .query(&mut connection)
                    .unwrap();
                pttl as f64
            });
            let killed = monotonic_ns();
            leader.kill().unwrap();
            leader.wait().unwrap();
            wait_for_lines(&stamps, 2);
            follower.wait().unwrap();
            let started = read_stamps(&stamps)
                .iter()
                .filter(|(k, _)| k == "start")
                .map(|(_, t)| *t)
                .max()
                .unwrap();
            let took = (started - killed) as f64 / 1e6;
            takeovers.push(took);
            if let Some(remaining) = remaining {
                excess.push(took - remaining);
            }
        }
        (takeovers, self.redis.as_ref().map(|_| excess))
    }

    /// (VmRSS of leaderrun, its PSS, VmRSS of its guard), in kB, while
    /// leading and past a renewal.
    fn rss(&self) -> (u64, u64, u64) {
        let stamps = self.dir.join(format!("{}-rss.stamps", self.name));
        let mut leader = self.stamped("rss", &stamps, FOREVER).spawn().unwrap();
        wait_for_lines(&stamps, 1);
        std::thread::sleep(Duration::from_millis(2500));
        let pid = leader.id();
        let rss = status_kb(pid, "VmRSS:");
        let pss = fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
            .ok()
            .and_then(|t| field_kb(&t, "Pss:"))
            .unwrap_or(0);
        let guard = find_process("leaderrun-guard").map_or(0, |g| status_kb(g, "VmRSS:"));
        leader.kill().unwrap();
        leader.wait().unwrap();
        (rss, pss, guard)
    }

    /// CPU (ms per second) of a follower waiting on a held lease, and for
    /// Redis the commands per second it adds to the server's count.
    fn idle_follower(&self) -> (f64, Option<f64>) {
        let stamps = self.dir.join(format!("{}-idle.stamps", self.name));
        let mut leader = self.stamped("idle", &stamps, FOREVER).spawn().unwrap();
        wait_for_lines(&stamps, 1);
        let window = Duration::from_secs(6);
        let leader_only = self.commands_during(window);
        let mut follower = self.stamped("idle", &stamps, 0).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let before = cpu_ticks(follower.id());
        let with_follower = self.commands_during(window);
        let after = cpu_ticks(follower.id());
        for child in [&mut leader, &mut follower] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        let cpu = (after - before) as f64 * 10.0 / window.as_secs_f64(); // 100 ticks/s
        let commands = leader_only
            .zip(with_follower)
            .map(|(alone, both)| both - alone);
        (cpu, commands)
    }

    /// Commands per second the Redis server processed over `window` (less
    /// the INFO calls that measure it); sleeps `window` for the file backend.
    fn commands_during(&self, window: Duration) -> Option<f64> {
        let Some(client) = &self.redis else {
            std::thread::sleep(window);
            return None;
        };
        let total = || {
            let mut connection = client.get_connection().unwrap();
            let info: String = redis::cmd("INFO")
                .arg("stats")
                .query(&mut connection)
                .unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix("total_commands_processed:"))
                .unwrap()
                .trim()
                .parse::<f64>()
                .unwrap()
        };
        let before = total();
        std::thread::sleep(window);
        Some((total() - before - 1.0) / window.as_secs_f64())
    }
}

/// A redis-server on a free port, up for one default ttl (6 s) so that
/// leaderrun does not hold acquisitions off.
fn redis_server(dir: &Path) -> Option<(Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
        ])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_secs(7));
    Some((child, port))
}

fn compile_stamp(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/stamp.c");
    let out = dir.join("stamp");
    for static_link in [true, false] {
        let mut cc = Command::new("cc");
        cc.args(["-O2", "-o"])
            .arg(&out)
            .arg(&source)
            .stderr(Stdio::null());
        if static_link {
            cc.arg("-static");
        }
        if cc.status().is_ok_and(|s| s.success()) {
            return out;
        }
    }
    panic!("the benchmark needs a C compiler (cc) for benches/stamp.c");
}

fn monotonic_ns() -> u128 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    now.tv_sec() as u128 * 1_000_000_000 + now.tv_nsec() as u128
}

fn time_runs(samples: usize, mut run: impl FnMut() -> std::process::ExitStatus) -> Vec<f64> {
    (0..samples)
        .map(|_| {
            let start = Instant::now();
            assert!(run().success());
            start.elapsed().as_secs_f64() * 1000.0
        })
        .collect()
}

fn read_stamps(path: &Path) -> Vec<(String, u128)> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (kind, t) = line.split_once(' ')?;
            Some((kind.to_owned(), t.parse().ok()?))
        })
        .collect()
}

/// For each "end" stamp followed by a "start" stamp, the gap in ms.
fn gaps(path: &Path) -> Vec<f64> {
    let mut stamps = read_stamps(path);
    stamps.sort_by_key(|(_, t)| *t);
    stamps
        .windows(2)
        .filter(|w| w[0].0 == "end" && w[1].0 == "start")
        .map(|w| (w[1].1 - w[0].1) as f64 / 1e6)
        .collect()
}

fn wait_for_lines(path: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while read_stamps(path).len() < n {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn status_kb(pid: u32, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| field_kb(&t, field))
        .unwrap_or(0)
}

fn field_kb(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn find_process(name: &str) -> Option<u32> {
    fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name))
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the comm.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((p / 100.0) * (sorted.len() - 1) as f64).round() as usize]
}

fn row(name: &str, values: &[f64]) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    println!(
        "| {name} | {:.2} | {:.2} | {:.2} | {mean:.2} |",
        percentile(values, 50.0),
        percentile(values, 90.0),
        percentile(values, 99.0)
    );
}

fn machine() -> String {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("machine: {cores} cores, {cpu}, Linux {}", kernel.trim())
}
