//! Benchmarks of leaderrun on the embedded file backend, printed as a table:
//!
//! - whole-process cycle of `leaderrun --key k -- true` against
//!   `flock FILE true` (target: within 2×);
//! - graceful handover, from the first child's last action to the second
//!   child's first (target: p50 ≤ 2 ms);
//! - crash failover, from `kill -9` of the leader to the follower's child;
//! - RSS of a leading leaderrun (target: ≤ 4 MB) and of its guard;
//! - CPU of an idle follower.
//!
//! Run with `cargo bench --bench file_backend`. `LEADERRUN_BENCH_N` sets the
//! number of samples (default 200).
//!
//! The children are `benches/stamp.c`, compiled statically by this benchmark
//! (or, without a C compiler, this benchmark binary itself in "stamp" mode):
//! it writes CLOCK_MONOTONIC (which every process on the host shares) to a
//! file as its first and last actions, so no shell start-up is counted.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_leaderrun");
const FOREVER: i64 = -1;

fn main() {
    if let Ok(file) = std::env::var("LEADERRUN_BENCH_STAMP") {
        return stamp_child(Path::new(&file));
    }
    let samples: usize = std::env::var("LEADERRUN_BENCH_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::Builder::new()
        .prefix("leaderrun-bench-")
        .tempdir()
        .unwrap();
    let (child, child_kind) = compile_stamp(dir.path());
    let bench = Bench {
        dir: dir.path().to_owned(),
        me: child,
    };

    println!("leaderrun file backend benchmark ({samples} samples each; times in ms)");
    println!("{}", machine());
    println!("children: {child_kind}");
    println!();
    println!("| measure | p50 | p90 | p99 | mean |");
    println!("|---|---|---|---|---|");
    let flock = bench.cycle_flock(samples);
    row("cycle: flock FILE true", &flock);
    let leaderrun = bench.cycle_leaderrun(samples);
    row("cycle: leaderrun --key k -- true", &leaderrun);
    let handover = bench.handover(samples);
    row(
        "graceful handover (last action → next first action)",
        &handover,
    );
    let failover = bench.failover(samples.min(30));
    row("crash failover (kill -9 → follower's child)", &failover);
    println!();
    println!(
        "cycle ratio leaderrun/flock (p50): {:.2}×",
        percentile(&leaderrun, 50.0) / percentile(&flock, 50.0)
    );
    let (rss, guard_rss, pss) = bench.rss();
    println!(
        "RSS of a leading leaderrun: {rss} kB (PSS {pss} kB); its guard process: {guard_rss} kB"
    );
    let (cpu, seconds) = bench.idle_follower_cpu();
    println!("idle follower CPU: {cpu:.3} ms per second over {seconds} s");
}

/// Builds the C stamp child; falls back to this binary in stamp mode.
fn compile_stamp(dir: &Path) -> (PathBuf, &'static str) {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/stamp.c");
    let out = dir.join("stamp");
    for (flags, kind) in [
        (&["-static"][..], "static C stamp program"),
        (&[][..], "dynamic C stamp program"),
    ] {
        let built = Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&out)
            .arg(&source)
            .args(flags)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if built {
            return (out, kind);
        }
    }
    (
        std::env::current_exe().unwrap(),
        "this benchmark binary in stamp mode (no C compiler)",
    )
}

/// Child mode: stamp, optionally wait, stamp, exit.
fn stamp_child(file: &Path) {
    let mut out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .unwrap();
    writeln!(out, "start {}", monotonic_ns()).unwrap();
    let hold: i64 = std::env::var("LEADERRUN_BENCH_HOLD_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if hold < 0 {
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    std::thread::sleep(Duration::from_millis(hold as u64));
    writeln!(out, "end {}", monotonic_ns()).unwrap();
}

fn monotonic_ns() -> u128 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    now.tv_sec() as u128 * 1_000_000_000 + now.tv_nsec() as u128
}

struct Bench {
    dir: PathBuf,
    me: PathBuf,
}

impl Bench {
    fn leaderrun(&self, key: &str) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "--backend",
            &format!("file:{}", self.dir.join("state").display()),
            "--key",
            key,
            "-q",
        ])
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
            .arg(&self.me);
        cmd
    }

    fn cycle_flock(&self, samples: usize) -> Vec<f64> {
        let lock = self.dir.join("flock.lock");
        time_runs(samples, || {
            Command::new("flock")
                .arg(&lock)
                .arg("true")
                .status()
                .unwrap()
        })
    }

    fn cycle_leaderrun(&self, samples: usize) -> Vec<f64> {
        time_runs(samples, || {
            let mut cmd = self.leaderrun("cycle");
            cmd.args(["--", "true"]);
            cmd.status().unwrap()
        })
    }

    /// Replicas queue up on one key; each child stamps, holds 20 ms, stamps
    /// and exits, and the next replica (already waiting) takes over.
    fn handover(&self, samples: usize) -> Vec<f64> {
        let stamps = self.dir.join("handover.stamps");
        let spawn = || self.stamped("handover", &stamps, 20).spawn().unwrap();
        let mut queue: std::collections::VecDeque<Child> = (0..3).map(|_| spawn()).collect();
        for round in 0..samples {
            let mut leader = queue.pop_front().unwrap();
            leader.wait().unwrap();
            // Start the replacement replica only once the next term has
            // begun, so its start-up does not compete with the handover.
            wait_for_lines(&stamps, 2 * round + 3);
            queue.push_back(spawn());
        }
        for mut replica in queue {
            let _ = replica.kill();
            let _ = replica.wait();
        }
        gaps(&stamps, "end", "start")
    }

    /// A leader whose child runs forever is killed with SIGKILL while a
    /// follower waits; the follower's child stamps its start.
    fn failover(&self, samples: usize) -> Vec<f64> {
        let mut out = Vec::new();
        for i in 0..samples {
            let stamps = self.dir.join(format!("failover-{i}.stamps"));
            let key = format!("failover-{i}");
            let mut leader = self.stamped(&key, &stamps, FOREVER).spawn().unwrap();
            wait_for_lines(&stamps, 1);
            let mut follower = self.stamped(&key, &stamps, 0).spawn().unwrap();
            std::thread::sleep(Duration::from_millis(50));
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
            out.push((started - killed) as f64 / 1e6);
        }
        out
    }

    /// (VmRSS of leaderrun, VmRSS of its guard, PSS of leaderrun), in kB.
    fn rss(&self) -> (u64, u64, u64) {
        let stamps = self.dir.join("rss.stamps");
        let mut leader = self.stamped("rss", &stamps, FOREVER).spawn().unwrap();
        wait_for_lines(&stamps, 1);
        std::thread::sleep(Duration::from_millis(2500)); // past a renewal
        let pid = leader.id();
        let rss = status_kb(pid, "VmRSS:");
        let pss = fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
            .ok()
            .and_then(|t| field_kb(&t, "Pss:"))
            .unwrap_or(0);
        let guard = find_process("leaderrun-guard").map_or(0, |g| status_kb(g, "VmRSS:"));
        leader.kill().unwrap();
        leader.wait().unwrap();
        (rss, guard, pss)
    }

    fn idle_follower_cpu(&self) -> (f64, u64) {
        let stamps = self.dir.join("idle.stamps");
        let mut leader = self.stamped("idle", &stamps, FOREVER).spawn().unwrap();
        wait_for_lines(&stamps, 1);
        let mut follower = self.stamped("idle", &stamps, 0).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let seconds = 5;
        let before = cpu_ticks(follower.id());
        std::thread::sleep(Duration::from_secs(seconds));
        let after = cpu_ticks(follower.id());
        for child in [&mut leader, &mut follower] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        let ticks_per_second = 100.0; // USER_HZ on Linux
        (
            (after - before) as f64 / ticks_per_second * 1000.0 / seconds as f64,
            seconds,
        )
    }
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

/// For each `from` stamp, the gap to the next `to` stamp after it, in ms.
fn gaps(path: &Path, from: &str, to: &str) -> Vec<f64> {
    let mut stamps = read_stamps(path);
    stamps.sort_by_key(|(_, t)| *t);
    stamps
        .windows(2)
        .filter(|w| w[0].0 == from && w[1].0 == to)
        .map(|w| (w[1].1 - w[0].1) as f64 / 1e6)
        .collect()
}

fn wait_for_lines(path: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
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
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the comm.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank]
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
