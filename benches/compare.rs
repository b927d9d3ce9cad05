//! leaderrun side by side with `etcdctl lock` and `flock`, in one run, and
//! at scale. Prints one table and writes it, with the machine's description,
//! to `docs/benchmarks.md`.
//!
//! Rows: leaderrun on the file backend, on Redis and on PostgreSQL (when
//! its programs are installed), `etcdctl lock` (when
//! `etcd` and `etcdctl` are installed), and `flock`. Columns: uncontended
//! whole-process cycle, graceful handover p50/p99 (from the first child's last
//! action to the second child's first), crash failover after `kill -9` of the
//! holder (and whether its child outlived it), an idle follower's CPU and
//! backend requests, and the RSS of a holder. Then scale: 100 followers on
//! one key, and 1,000 keys on one Redis.
//!
//! Run with `cargo bench --bench compare`. `LEADERRUN_BENCH_N` sets the
//! samples per measure (default 200); `LEADERRUN_BENCH_SCALE=0` skips the
//! scale runs and `LEADERRUN_BENCH_ROWS=0` the side-by-side rows (a partial
//! run prints its table but leaves `docs/benchmarks.md` alone);
//! `LEADERRUN_BENCH_HA=0` the Sentinel and Cluster runs;
//! `LEADERRUN_BENCH_QUICK=1` measures only the interleaved cycles and
//! handovers, for profiling (`LEADERRUN_BENCH_ONLY=etcd,flock`: only those
//! tools, and in shard mode only those backends; `LEADERRUN_BENCH_AGAINST=/path/to/leaderrun`: each leaderrun row
//! again with that binary, interleaved, to compare two builds (several,
//! comma-separated: a row for each; their rows
//! come last in each round, which costs their cycles 0.17–0.2 ms here: run
//! it twice with the builds swapped);
//! `LEADERRUN_BENCH_LOGS=1`: leaderrun at its default log level, its stderr a
//! pipe that a thread of the bench reads, as a log collector would), and etcd's
//! own floor for a handover when `etcdctl lock` is in. The children are `benches/stamp.c`, compiled here: a static C
//! program that writes CLOCK_MONOTONIC (shared by every process on the host)
//! as its first and last actions, so no shell start-up is counted.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;

use common::postgres_server::PostgresServer;
use common::redis_server::{Cluster, SentinelSet};

const BIN: &str = env!("CARGO_BIN_EXE_leaderrun");
/// Hold value for a child that runs until killed.
const FOREVER: i64 = -1;
/// The lease/session ttl of every tool, for comparable failover.
const TTL_SECS: u64 = 6;
/// The pause before each interleaved cycle.
const SETTLE: Duration = Duration::from_millis(20);

fn main() {
    let samples: usize = env_number("LEADERRUN_BENCH_N").unwrap_or(200);
    let scale = env_number("LEADERRUN_BENCH_SCALE").unwrap_or(1) != 0;
    let rows = env_number("LEADERRUN_BENCH_ROWS").unwrap_or(1) != 0;
    let quick = env_number("LEADERRUN_BENCH_QUICK").unwrap_or(0) != 0;
    let ha = env_number("LEADERRUN_BENCH_HA").unwrap_or(1) != 0;
    let shards = env_number("LEADERRUN_BENCH_SHARDS").unwrap_or(1) != 0;
    let dir = tempfile::Builder::new()
        .prefix("leaderrun-bench-")
        .tempdir()
        .unwrap();
    let stamp = compile_stamp(dir.path());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Benchmarks\n\nMeasured by `cargo bench --bench compare` ({samples} samples per measure; times in ms).\n\n{}\n",
        machine()
    );
    // Every server runs for the whole run: the tools' samples are taken in
    // turn, so that the shared VM's slow spells fall on all of them.
    let redis = Server::redis(dir.path());
    let etcd = Server::etcd(dir.path());
    let postgres = PostgresServer::installed().then(PostgresServer::start);
    let bench = Bench {
        dir: dir.path().to_owned(),
        stamp,
        redis_port: redis.port,
        etcd_port: etcd.as_ref().map(|e| e.port),
    };
    let mut tools = vec![
        Tool {
            name: "leaderrun (file)",
            kind: Kind::Leaderrun {
                url: format!("file:{}", dir.path().join("state").display()),
                bin: BIN,
            },
        },
        Tool {
            name: "leaderrun (redis)",
            kind: Kind::Leaderrun {
                url: format!("redis://127.0.0.1:{}", redis.port),
                bin: BIN,
            },
        },
    ];
    if let Some(postgres) = &postgres {
        tools.push(Tool {
            name: "leaderrun (postgres)",
            kind: Kind::Leaderrun {
                url: postgres.url(),
                bin: BIN,
            },
        });
    }
    if let Some(etcd) = &etcd {
        tools.push(Tool {
            name: "leaderrun (etcd)",
            kind: Kind::Leaderrun {
                url: format!("etcd://127.0.0.1:{}", etcd.port),
                bin: BIN,
            },
        });
        tools.push(Tool {
            name: "etcdctl lock",
            kind: Kind::Etcdctl(format!("http://127.0.0.1:{}", etcd.port)),
        });
    }
    tools.push(Tool {
        name: "flock",
        kind: Kind::Flock(dir.path().join("flock.lock")),
    });
    if quick {
        // Only the interleaved cycles and handovers, for profiling; with
        // LEADERRUN_BENCH_ONLY, only the tools whose name holds one of its
        // comma-separated words.
        if let Ok(only) = std::env::var("LEADERRUN_BENCH_ONLY") {
            tools.retain(|tool| only.split(',').any(|word| tool.name.contains(word)));
        }
        if let Ok(others) = std::env::var("LEADERRUN_BENCH_AGAINST") {
            for (n, other) in others.split(',').enumerate() {
                let other: &'static str = Box::leak(other.to_owned().into_boxed_str());
                let suffix = if n == 0 {
                    String::new()
                } else {
                    format!(" {}", n + 1)
                };
                let twins: Vec<Tool> = tools
                    .iter()
                    .filter_map(|tool| match &tool.kind {
                        Kind::Leaderrun { url, bin } if *bin == BIN => Some(Tool {
                            name: Box::leak(
                                format!("{} against{suffix}", tool.name).into_boxed_str(),
                            ),
                            kind: Kind::Leaderrun {
                                url: url.clone(),
                                bin: other,
                            },
                        }),
                        _ => None,
                    })
                    .collect();
                tools.extend(twins);
            }
        }
        let cycles = bench.interleaved_cycles(&tools, samples);
        let handovers = bench.interleaved_handovers(&tools, samples, 20);
        for ((tool, cycle), handover) in tools.iter().zip(&cycles).zip(&handovers) {
            println!(
                "{:20} cycle p50 {:.2}  handover p50 {:.2} p99 {:.2}",
                tool.name,
                percentile(cycle, 50.0),
                percentile(handover, 50.0),
                percentile(handover, 99.0)
            );
        }
        if let Some(port) = bench
            .etcd_port
            .filter(|_| tools.iter().any(|t| matches!(t.kind, Kind::Etcdctl(_))))
        {
            let floor = etcd_write_seen(port, samples);
            println!(
                "etcd write seen by a watcher p50 {:.2} p99 {:.2}",
                percentile(&floor, 50.0),
                percentile(&floor, 99.0)
            );
        }
        return;
    }
    if rows {
        bench.rows(&mut out, &tools, samples);
    }
    if scale {
        eprintln!("measuring scale");
        bench.scale(&mut out, redis.port);
    }
    if ha {
        eprintln!("measuring Sentinel and Cluster");
        bench.ha(&mut out, samples.div_ceil(2));
    }
    if shards {
        eprintln!("measuring shard mode");
        let mut backends = vec![
            (
                "file",
                format!("file:{}", dir.path().join("shard-state").display()),
                Requests::Leaderrun,
            ),
            (
                "redis",
                format!("redis://127.0.0.1:{}", redis.port),
                Requests::Redis(redis.port),
            ),
        ];
        if let Some(postgres) = &postgres {
            backends.push(("postgres", postgres.url(), Requests::Leaderrun));
        }
        if let Some(etcd) = &etcd {
            backends.push((
                "etcd",
                format!("etcd://127.0.0.1:{}", etcd.port),
                Requests::Etcd(etcd.port),
            ));
        }
        if let Ok(only) = std::env::var("LEADERRUN_BENCH_ONLY") {
            backends.retain(|(name, ..)| only.split(',').any(|word| name.contains(word)));
        }
        shard_mode(&mut out, dir.path(), &backends);
    }
    print!("{out}");
    if rows && scale && ha && shards {
        // The measured part goes between the markers; the history of earlier
        // runs around it is kept by hand.
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/benchmarks.md");
        let (begin, end) = ("<!-- bench:begin -->\n", "<!-- bench:end -->\n");
        let old = fs::read_to_string(&docs).unwrap_or_default();
        let new = match (old.find(begin), old.find(end)) {
            (Some(b), Some(e)) if b < e => format!("{}{begin}{out}{}", &old[..b], &old[e..]),
            _ => format!("{begin}{out}{end}{old}"),
        };
        fs::create_dir_all(docs.parent().unwrap()).unwrap();
        fs::write(&docs, new).unwrap();
        eprintln!("written to {}", docs.display());
    }
}

impl Bench {
    /// The side-by-side table: cycles and handovers interleaved across the
    /// tools, one sample of each in turn; then each tool's failover, idle
    /// follower and RSS.
    fn rows(&self, out: &mut String, tools: &[Tool], samples: usize) {
        eprintln!("measuring cycles");
        let cycles = self.interleaved_cycles(tools, samples);
        eprintln!("measuring handovers");
        let handovers = self.interleaved_handovers(tools, samples, 20);
        let long_holds = self.interleaved_handovers(tools, samples.div_ceil(4), 300);
        let _ = writeln!(
            out,
            "| tool | cycle p50 | cycle p99 | handover p50 | handover p99 | takeover after kill -9 of the holding process | child after kill -9 | idle follower CPU ms/s | idle follower backend requests/s | holder RSS |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for ((tool, cycle), handover) in tools.iter().zip(&cycles).zip(&handovers) {
            *out += &self.row(tool, cycle, handover);
        }
        let p50 = |values: &Vec<f64>| percentile(values, 50.0);
        let flock = tools.len() - 1;
        let _ = writeln!(
            out,
            "\nAgainst flock, from the same interleaved samples: file cycle {:.2}×, file handover {:.2}×, Redis handover {:.2}×.",
            p50(&cycles[0]) / p50(&cycles[flock]),
            p50(&handovers[0]) / p50(&handovers[flock]),
            p50(&handovers[1]) / p50(&handovers[flock]),
        );
        let _ = writeln!(
            out,
            "\nHandover method: a term ends only once every replica queued for the next one, of every tool, is waiting (its threads idle for 20 ms), so no replica's start-up overlaps a handover. Its check, the handover p50 with the children's holds at 20 ms and at 300 ms ({} samples):\n\n| tool | 20 ms holds | 300 ms holds |\n|---|---|---|",
            samples.div_ceil(4)
        );
        for ((tool, short), long) in tools.iter().zip(&handovers).zip(&long_holds) {
            let _ = writeln!(
                out,
                "| {} | {:.2} | {:.2} |",
                tool.name,
                p50(short),
                p50(long)
            );
        }
        if let (Some(port), Some(etcdctl)) = (
            self.etcd_port,
            tools
                .iter()
                .position(|t| matches!(t.kind, Kind::Etcdctl(_))),
        ) {
            eprintln!("measuring etcd's own floor");
            let floor = etcd_write_seen(port, samples);
            let _ = writeln!(
                out,
                "\netcd's own floor for a handover: a write seen by a watcher, by a minimal client (one put on a kept connection after 20 ms of quiet, as in a handover; the time from sending it to a watch's event arriving), with no process told of an exit and none started: p50 {:.2}, p99 {:.2} ms. `etcdctl lock`'s handover p50 is {:.2} ms, so half of it ({:.2} ms) leaves {:.2} ms for the holder to learn that its child ended and the next child to start (a bare `posix_spawn` of the stamp program takes about 0.4 ms here).",
                percentile(&floor, 50.0),
                percentile(&floor, 99.0),
                p50(&handovers[etcdctl]),
                p50(&handovers[etcdctl]) / 2.0,
                p50(&handovers[etcdctl]) / 2.0 - percentile(&floor, 50.0),
            );
        }
        let _ = writeln!(
            out,
            "\n- cycle: one uncontended `TOOL ... -- true`, start to exit, each after a 20 ms pause (so what the previous tool left running, a PostgreSQL session ending or a Go runtime exiting, does not fall on it). handover: a waiting replica's child starts after the holder's child ends (its last action to the next child's first). takeover after kill -9: `kill -9` of the tool's process that holds the lease (leaderrun's supervisor, etcdctl, flock; {TTL_SECS} s ttl for every tool), to the waiting replica's child's start; the killed process's child, if it outlives it, is left running. child after kill -9: whether it went on running. idle follower: a process waiting on a held lease, over 12 s after its first 1.5 s; backend requests: the calls it makes (Redis: commands it sends, scripts and BLPOP, counted by the server; etcd: requests, a watch as one, counted by the server (`grpc_server_started_total`); files and PostgreSQL: lease operations (on PostgreSQL, one statement each), counted by leaderrun's `leaderrun_backend_calls_total`)."
        );
    }

    /// One sample of each tool's cycle in turn.
    /// A short pause before each: what the last tool left running (a
    /// PostgreSQL backend ending its session, a Go runtime's exit) must not
    /// fall on the next tool's sample.
    fn interleaved_cycles(&self, tools: &[Tool], samples: usize) -> Vec<Vec<f64>> {
        let mut cycles = vec![Vec::new(); tools.len()];
        for _ in 0..samples {
            for (tool, cycle) in tools.iter().zip(cycles.iter_mut()) {
                std::thread::sleep(SETTLE);
                cycle.extend(self.cycle(tool, 1));
            }
        }
        cycles
    }

    /// One handover of each tool in turn, each only once every queued
    /// replica of every tool is waiting.
    fn interleaved_handovers(&self, tools: &[Tool], samples: usize, hold_ms: i64) -> Vec<Vec<f64>> {
        let mut rigs: Vec<HandoverRig> = tools
            .iter()
            .map(|tool| HandoverRig::new(self, tool, hold_ms))
            .collect();
        for _ in 0..samples {
            for i in 0..rigs.len() {
                rigs[i].ready();
                for rig in &rigs {
                    rig.wait_until_waiting();
                }
                rigs[i].hand_over();
            }
        }
        rigs.into_iter().map(HandoverRig::finish).collect()
    }
}

impl Bench {
    /// Redis as production runs it: cycle and handover through Sentinel and
    /// Cluster next to one Redis (interleaved), and what a primary's death
    /// does to a term: alone, and with the leader's host.
    fn ha(&self, out: &mut String, samples: usize) {
        let set = SentinelSet::start();
        let cluster = Cluster::start();
        // Past the hold-off of a server younger than the ttl.
        set.primary().wait_uptime(None, TTL_SECS + 1);
        for node in &cluster.nodes {
            node.wait_uptime(None, TTL_SECS + 1);
        }
        let tools = [
            Tool {
                // Not "leaderrun (redis)": its handover files are the rows'.
                name: "leaderrun (redis, one server)",
                kind: Kind::Leaderrun {
                    url: format!("redis://127.0.0.1:{}", self.redis_port),
                    bin: BIN,
                },
            },
            Tool {
                name: "leaderrun (redis sentinel)",
                kind: Kind::Leaderrun {
                    url: set.url(),
                    bin: BIN,
                },
            },
            Tool {
                name: "leaderrun (redis cluster)",
                kind: Kind::Leaderrun {
                    url: cluster.url(),
                    bin: BIN,
                },
            },
        ];
        let cycles = self.interleaved_cycles(&tools, samples);
        let handovers = self.interleaved_handovers(&tools, samples, 20);
        drop((set, cluster));
        let deaths = [
            None,
            Some(self.primary_death(true)),
            Some(self.primary_death(false)),
        ];
        let _ = writeln!(
            out,
            "\n## Redis Sentinel and Cluster\n\nA primary and a replica behind three sentinels (down after 1 s), and three primaries with a replica each (node timeout 1 s), on loopback; {samples} interleaved samples; {TTL_SECS} s ttl.\n\n| backend | cycle p50 | cycle p99 | handover p50 | handover p99 | primary killed: the term went on (renewals every 500 ms) | else, the next term's command after, p50 | primary and the leader's host killed → follower's command, p50 |\n|---|---|---|---|---|---|---|---|"
        );
        for (((tool, cycle), handover), death) in
            tools.iter().zip(&cycles).zip(&handovers).zip(deaths.iter())
        {
            let ms = |v: Option<f64>| v.map_or("n/m".into(), |ms| format!("{ms:.0} ms"));
            let (kept, served, host) = match death {
                Some(d) => (
                    format!("{} of {}", d.kept, d.samples),
                    ms(d.next_command),
                    ms(d.host_death),
                ),
                None => ("n/a".into(), "n/a".into(), "n/a".into()),
            };
            let _ = writeln!(
                out,
                "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {kept} | {served} | {host} |",
                tool.name,
                percentile(cycle, 50.0),
                percentile(cycle, 99.0),
                percentile(handover, 50.0),
                percentile(handover, 99.0),
            );
        }
        let _ = writeln!(
            out,
            "\nPrimary killed: SIGKILL of the primary serving the lease while a leader and a follower run, with renewals every 500 ms (`--renew-every 500ms`: a renewal budget of 3.5 s; at the defaults it is 2 s, shorter than a failover here). The term goes on when the promoted replica has the lease and the leader's renewals reach it within the renewal budget; where the failover takes longer, the leader's command is stopped at the yield point, and the next term's command (on either replica) starts once the lease, found free on a server with another replication history, was held off one ttl. Primary and the leader's host: on another key, the primary, the leader's supervisor, its guard and its command killed at once (SIGKILL), as when one host running both dies; to the follower's command's start: the lease lapses (one ttl) and, found free on a server with another replication history, is held off one ttl more."
        );
    }

    /// `ha`'s last columns for Sentinel or Cluster, 3 samples each, on
    /// servers of their own.
    fn primary_death(&self, sentinel: bool) -> Death {
        let mut death = Death {
            samples: 3,
            kept: 0,
            next_command: None,
            host_death: None,
        };
        let (mut stopped, mut host) = (Vec::new(), Vec::new());
        for i in 0..death.samples {
            let key = format!("death-{i}");
            let lease = format!("leaderrun:{{{key}}}:lease");
            let mut set = sentinel.then(SentinelSet::start);
            let mut cluster = (!sentinel).then(Cluster::start);
            let url = match (&set, &cluster) {
                (Some(s), _) => s.url(),
                (_, Some(c)) => c.url(),
                _ => unreachable!(),
            };
            let tool = Tool {
                name: "ha",
                kind: Kind::Leaderrun {
                    url: url.clone(),
                    bin: BIN,
                },
            };
            let stamps = self.dir.join(format!("{key}-{sentinel}.stamps"));
            // Renewals every 500 ms: a budget of 3.5 s, past a failover here.
            let patient = ["--renew-every", "500ms"];
            let mut holder = self
                .stamped_with(&tool, &key, &stamps, FOREVER, &patient)
                .spawn()
                .unwrap();
            wait_for_lines(&stamps, 1, Duration::from_secs(30));
            let mut follower = self
                .stamped_with(&tool, &key, &stamps, 0, &patient)
                .spawn()
                .unwrap();
            std::thread::sleep(Duration::from_millis(1500));

            // The primary alone: the term goes on if the failover ends
            // within its renewal budget; else the next term starts once
            // the hold-off after the failover passed.
            let killed = monotonic_ns();
            let old = match (&mut set, &mut cluster) {
                (Some(s), _) => {
                    let old = s.primary_port();
                    s.servers.iter_mut().find(|n| n.port == old).unwrap().stop();
                    old
                }
                (_, Some(c)) => c.stop_primary(&lease),
                _ => unreachable!(),
            };
            let until = Instant::now() + Duration::from_secs(TTL_SECS * 3);
            let mut next = None;
            while next.is_none() && Instant::now() < until {
                next = read_stamps(&stamps)
                    .iter()
                    .filter(|(k, t)| k == "start" && *t > killed)
                    .map(|(_, t)| *t)
                    .min();
                std::thread::sleep(Duration::from_millis(20));
            }
            match next {
                Some(started) => stopped.push((started - killed) as f64 / 1e6),
                None if alive_descendant(holder.id()) => death.kept += 1,
                None => {}
            }
            match (&mut set, &mut cluster) {
                (Some(s), _) => s.restart_as_replica(old),
                (_, Some(c)) => c.rejoin(old),
                _ => unreachable!(),
            }

            let _ = holder.kill();
            let _ = holder.wait();
            kill_all(std::slice::from_mut(&mut follower));

            // The new primary and the leader's host (its supervisor, guard
            // and command) at once, on a key of its own.
            let key = format!("host-{i}");
            let lease = format!("leaderrun:{{{key}}}:lease");
            let stamps = self.dir.join(format!("{key}-{sentinel}.stamps"));
            let mut holder = self.stamped(&tool, &key, &stamps, FOREVER).spawn().unwrap();
            wait_for_lines(&stamps, 1, Duration::from_secs(30));
            let mut follower = self.stamped(&tool, &key, &stamps, 0).spawn().unwrap();
            std::thread::sleep(Duration::from_millis(1500));
            let killed = monotonic_ns();
            let mut doomed = guards_of(&key);
            doomed.extend(descendants(holder.id()));
            doomed.push(holder.id());
            for pid in doomed {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            match (&mut set, &mut cluster) {
                (Some(s), _) => {
                    let port = s.primary_port();
                    s.servers
                        .iter_mut()
                        .find(|n| n.port == port)
                        .unwrap()
                        .stop();
                }
                (_, Some(c)) => {
                    c.stop_primary(&lease);
                }
                _ => unreachable!(),
            }
            if wait_for_lines_within(&stamps, 2, Duration::from_secs(TTL_SECS * 6)) {
                let started = read_stamps(&stamps)
                    .iter()
                    .filter(|(k, t)| k == "start" && *t > killed)
                    .map(|(_, t)| *t)
                    .min()
                    .unwrap();
                host.push((started - killed) as f64 / 1e6);
            }
            let _ = holder.kill();
            let _ = holder.wait();
            kill_all(std::slice::from_mut(&mut follower));
        }
        death.next_command = (!stopped.is_empty()).then(|| percentile(&stopped, 50.0));
        death.host_death = (!host.is_empty()).then(|| percentile(&host, 50.0));
        death
    }
}

/// What a primary's death did to a term (`Bench::primary_death`).
struct Death {
    samples: usize,
    /// Samples in which the leader's command ran on through the failover.
    kept: usize,
    /// Where the term ended: from the kill to the next term's command.
    next_command: Option<f64>,
    host_death: Option<f64>,
}

/// The guards of leaderrun processes for `key` (forks of leaderrun, in
/// sessions of their own).
fn guards_of(key: &str) -> Vec<u32> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "leaderrun-guard")
                && fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                    cmdline.split(|b| *b == 0).any(|arg| arg == key.as_bytes())
                })
        })
        .collect()
}

/// Every live process below `pid`.
fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let i = stat.rfind(')')?;
            Some((p, stat[i + 2..].split_whitespace().nth(1)?.parse().ok()?))
        })
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// Whether the stamp child (the leader's command) runs below `pid`.
fn alive_descendant(pid: u32) -> bool {
    descendants(pid).into_iter().any(|p| {
        alive(p) && fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "stamp")
    })
}

fn env_number(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.parse().ok()
}

/// A backend server started for the benchmark, on a free port.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    /// redis-server, up for one ttl so that leaderrun does not hold off.
    fn redis(dir: &Path) -> Server {
        let port = free_port();
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
            .expect("redis-server (scripts/test installs it)");
        std::thread::sleep(Duration::from_secs(TTL_SECS + 1));
        Server { child, port }
    }

    /// etcd, if installed.
    fn etcd(dir: &Path) -> Option<Server> {
        Command::new("etcdctl").arg("version").output().ok()?;
        let (port, peer) = (free_port(), free_port());
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{port}")])
            .args([
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{port}"),
            ])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ])
            .args([
                "--initial-cluster",
                &format!("default=http://127.0.0.1:{peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let server = Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let healthy = Command::new("etcdctl")
                .args([
                    "--endpoints",
                    &format!("http://127.0.0.1:{port}"),
                    "endpoint",
                    "health",
                ])
                .env("ETCDCTL_API", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if healthy {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }
}

struct Tool {
    name: &'static str,
    kind: Kind,
}

enum Kind {
    /// leaderrun on a backend URL, this build's binary or another.
    Leaderrun {
        url: String,
        bin: &'static str,
    },
    Etcdctl(String),
    Flock(PathBuf),
}

impl Tool {
    /// The tool running `child` while it holds `key`.
    fn command(&self, key: &str, child: &[&str]) -> Command {
        self.command_with(key, child, &[])
    }

    /// `command`, with more options for leaderrun.
    fn command_with(&self, key: &str, child: &[&str], options: &[&str]) -> Command {
        let mut cmd = match &self.kind {
            Kind::Leaderrun { url, bin } => {
                let mut cmd = Command::new(bin);
                cmd.args(["--backend", url, "--key", key])
                    .args(log_sink().is_none().then_some("-q"))
                    .args(["--ttl", &format!("{TTL_SECS}s")])
                    .args(options)
                    .arg("--");
                cmd
            }
            Kind::Etcdctl(endpoint) => {
                let mut cmd = Command::new("etcdctl");
                cmd.env("ETCDCTL_API", "3").args([
                    "--endpoints",
                    endpoint,
                    "lock",
                    "--ttl",
                    &TTL_SECS.to_string(),
                    key,
                ]);
                cmd
            }
            Kind::Flock(file) => {
                let mut cmd = Command::new("flock");
                cmd.arg(file.with_extension(key));
                cmd
            }
        };
        cmd.args(child)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let (Kind::Leaderrun { .. }, Some(sink)) = (&self.kind, log_sink()) {
            cmd.stderr(Stdio::from(sink.try_clone().expect("a log pipe")));
        }
        cmd
    }
}

/// With `LEADERRUN_BENCH_LOGS=1`, the write end of a pipe whose lines a
/// thread reads and drops: leaderrun's stderr, as a log collector takes it.
fn log_sink() -> Option<&'static std::os::fd::OwnedFd> {
    static SINK: std::sync::OnceLock<Option<std::os::fd::OwnedFd>> = std::sync::OnceLock::new();
    SINK.get_or_init(|| {
        if env_number("LEADERRUN_BENCH_LOGS").unwrap_or(0) == 0 {
            return None;
        }
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("a pipe");
        std::thread::spawn(move || {
            use std::io::Read as _;
            let mut read = fs::File::from(read);
            let mut buffer = [0u8; 65536];
            while read.read(&mut buffer).is_ok_and(|n| n > 0) {}
        });
        Some(write)
    })
    .as_ref()
}

struct Bench {
    dir: PathBuf,
    stamp: PathBuf,
    redis_port: u16,
    etcd_port: Option<u16>,
}

struct Failover {
    /// Median ms from the kill to the follower's child's start.
    took: Option<f64>,
    /// Whether the killed holder's child was still running at the takeover.
    orphaned: bool,
}

impl Bench {
    /// The rest of one tool's measures, and its table row.
    fn row(&self, tool: &Tool, cycle: &[f64], handover: &[f64]) -> String {
        eprintln!("measuring {}", tool.name);
        // flock's answer is the same every time (the killed holder's child
        // keeps the lock), and etcd's takes a ttl per sample.
        let failover_samples = match tool.kind {
            Kind::Leaderrun { .. } => 20,
            Kind::Etcdctl(_) => 5,
            Kind::Flock(_) => 1,
        };
        let failover = self.failover(tool, failover_samples);
        let (cpu, requests) = self.idle_follower(tool);
        let rss = self.rss(tool);
        format!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {cpu:.3} | {} | {:.1} MB |\n",
            tool.name,
            percentile(cycle, 50.0),
            percentile(cycle, 99.0),
            percentile(handover, 50.0),
            percentile(handover, 99.0),
            match failover.took {
                Some(ms) => format!("{ms:.1} ms p50"),
                None => "never: the lock stays held".into(),
            },
            if failover.orphaned {
                "**kept running**"
            } else {
                "killed"
            },
            requests.map_or("n/a".into(), |r| format!("{r:.2}")),
            rss as f64 / 1024.0,
        )
    }

    fn stamped(&self, tool: &Tool, key: &str, stamps: &Path, hold_ms: i64) -> Command {
        self.stamped_with(tool, key, stamps, hold_ms, &[])
    }

    /// `stamped`, with more options for the tool (leaderrun's only).
    fn stamped_with(
        &self,
        tool: &Tool,
        key: &str,
        stamps: &Path,
        hold_ms: i64,
        options: &[&str],
    ) -> Command {
        let mut cmd = tool.command_with(key, &[self.stamp.to_str().unwrap()], options);
        cmd.env("LEADERRUN_BENCH_STAMP", stamps)
            .env("LEADERRUN_BENCH_HOLD_MS", hold_ms.to_string());
        cmd
    }

    fn cycle(&self, tool: &Tool, samples: usize) -> Vec<f64> {
        (0..samples)
            .map(|_| {
                let start = Instant::now();
                assert!(
                    tool.command("cycle", &["true"]).status().unwrap().success(),
                    "{}",
                    tool.name
                );
                start.elapsed().as_secs_f64() * 1000.0
            })
            .collect()
    }

    /// The holder (child runs forever) is killed with SIGKILL while a
    /// follower waits.
    fn failover(&self, tool: &Tool, samples: usize) -> Failover {
        let mut excess = Vec::new();
        let mut orphaned = false;
        for i in 0..samples {
            let stamps = self
                .dir
                .join(format!("{}-failover-{i}.stamps", slug(tool.name)));
            let key = format!("failover-{i}");
            let mut holder = self.stamped(tool, &key, &stamps, FOREVER).spawn().unwrap();
            wait_for_lines(&stamps, 1, Duration::from_secs(30));
            let first_child = child_pid(holder.id());
            let mut follower = self.stamped(tool, &key, &stamps, 0).spawn().unwrap();
            std::thread::sleep(Duration::from_millis(500));
            let killed = monotonic_ns();
            holder.kill().unwrap();
            holder.wait().unwrap();
            let took = wait_for_lines_within(&stamps, 2, Duration::from_secs(TTL_SECS * 3));
            if let Some(pid) = first_child {
                orphaned |= alive(pid);
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = follower.kill();
            let _ = follower.wait();
            if took {
                let started = read_stamps(&stamps)
                    .iter()
                    .filter(|(k, _)| k == "start")
                    .map(|(_, t)| *t)
                    .max()
                    .unwrap();
                excess.push((started - killed) as f64 / 1e6);
            }
        }
        Failover {
            took: (!excess.is_empty()).then(|| percentile(&excess, 50.0)),
            orphaned,
        }
    }

    /// CPU (ms/s) of a follower waiting on a held lease, and the backend
    /// requests per second it makes: on Redis the commands it sends (EVALSHA,
    /// BLPOP and the like, counted by the server: those the holder alone
    /// sends are taken off), on files and PostgreSQL the lease operations
    /// (statements) leaderrun counts.
    fn idle_follower(&self, tool: &Tool) -> (f64, Option<f64>) {
        let stamps = self.dir.join(format!("{}-idle.stamps", slug(tool.name)));
        let holder = self
            .stamped(tool, "idle", &stamps, FOREVER)
            .spawn()
            .unwrap();
        wait_for_lines(&stamps, 1, Duration::from_secs(30));
        let window = Duration::from_secs(12);
        let redis = matches!(&tool.kind, Kind::Leaderrun { url, .. } if url.starts_with("redis"));
        let etcd = matches!(&tool.kind, Kind::Leaderrun { url, .. } if url.starts_with("etcd"));
        // leaderrun counts its own calls on the other backends.
        let file = matches!(&tool.kind, Kind::Leaderrun { url, .. } if !url.starts_with("redis") && !url.starts_with("etcd"));
        let alone = if redis {
            Some(self.redis_requests_during(window))
        } else if etcd {
            Some(self.etcd_requests_during(window))
        } else {
            None
        };
        let metrics = free_port();
        let address = format!("127.0.0.1:{metrics}");
        let extra: &[&str] = if file {
            &["--metrics-addr", &address]
        } else {
            &[]
        };
        let follower = self
            .stamped_with(tool, "idle", &stamps, 0, extra)
            .spawn()
            .unwrap();
        // Past its first attempts, into its steady wait.
        std::thread::sleep(Duration::from_millis(1500));
        let before = cpu_ticks(follower.id());
        let calls_before = file.then(|| all_backend_calls(metrics));
        let both = if redis {
            Some(self.redis_requests_during(window))
        } else if etcd {
            Some(self.etcd_requests_during(window))
        } else {
            std::thread::sleep(window);
            None
        };
        let after = cpu_ticks(follower.id());
        let file_requests =
            calls_before.map(|before| (all_backend_calls(metrics) - before) / window.as_secs_f64());
        kill_all(&mut [holder, follower]);
        let cpu = (after - before) as f64 * 10.0 / window.as_secs_f64(); // 100 ticks per second
        (cpu, alone.zip(both).map(|(a, b)| b - a).or(file_requests))
    }

    /// Requests per second that clients send to Redis over `window`: the
    /// commands a client sends itself (scripts, BLPOP, connection set-up),
    /// not those the scripts run.
    fn redis_requests_during(&self, window: Duration) -> f64 {
        let before = redis_client_commands(self.redis_port);
        std::thread::sleep(window);
        // INFO is not counted: leaderrun sends it only at startup (its
        // scripts run it inside the server), and the harness reads the
        // counts with it.
        (redis_client_commands(self.redis_port) - before) / window.as_secs_f64()
    }

    /// Requests per second that clients start on etcd over `window`, as
    /// etcd counts them (`grpc_server_started_total`: the JSON gateway's
    /// requests become gRPC calls inside the server; a watch is one).
    fn etcd_requests_during(&self, window: Duration) -> f64 {
        let port = self.etcd_port.expect("etcd runs");
        let before = etcd_started_calls(port);
        std::thread::sleep(window);
        (etcd_started_calls(port) - before) / window.as_secs_f64()
    }

    /// VmRSS (kB) of a tool process holding a lease, past a renewal.
    fn rss(&self, tool: &Tool) -> u64 {
        let stamps = self.dir.join(format!("{}-rss.stamps", slug(tool.name)));
        let mut holder = self.stamped(tool, "rss", &stamps, FOREVER).spawn().unwrap();
        wait_for_lines(&stamps, 1, Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(2500));
        let rss = status_kb(holder.id(), "VmRSS:");
        kill_all(std::slice::from_mut(&mut holder));
        rss
    }

    /// 100 followers on one key (file and Redis), and 1,000 keys on one
    /// Redis, each led by its own leaderrun.
    fn scale(&self, out: &mut String, redis_port: u16) {
        let _ = writeln!(
            out,
            "\n## Scale\n\n| scenario | handover p50 | handover p99 | host CPU busy, ms/s | Redis CPU, ms/s | Redis commands/s |\n|---|---|---|---|---|---|"
        );
        for (name, url) in [
            (
                "file backend, 1 key, 1 leader + 100 followers",
                format!("file:{}", self.dir.join("scale-state").display()),
            ),
            (
                "redis, 1 key, 1 leader + 100 followers",
                format!("redis://127.0.0.1:{redis_port}"),
            ),
        ] {
            let tool = Tool {
                name: "scale",
                kind: Kind::Leaderrun {
                    url: url.clone(),
                    bin: BIN,
                },
            };
            let mut handover = Vec::new();
            let (mut host_ms, mut redis_ms, mut commands, mut seconds) = (0.0, 0.0, 0.0, 0.0);
            for round in 0..3 {
                let stamps = self.dir.join(format!("{}-{round}.stamps", slug(name)));
                // The first leader holds 5 s while the 100 others start and
                // line up, so their start-up is not measured; then every
                // child holds 100 ms, and each of 30 handovers is contested
                // by the others still waiting.
                let mut replicas =
                    vec![self.stamped(&tool, "crowd", &stamps, 5000).spawn().unwrap()];
                wait_for_lines(&stamps, 1, Duration::from_secs(60));
                replicas.extend(
                    (0..100).map(|_| self.stamped(&tool, "crowd", &stamps, 100).spawn().unwrap()),
                );
                wait_for_lines(&stamps, 2, Duration::from_secs(60));
                let host_before = host_busy_ms();
                let redis_before = (
                    redis_cpu_ms(redis_port),
                    redis_info(redis_port, "stats", "total_commands_processed:"),
                );
                let started = Instant::now();
                wait_for_lines(&stamps, 2 + 2 * 30, Duration::from_secs(120));
                seconds += started.elapsed().as_secs_f64();
                host_ms += host_busy_ms() - host_before;
                if url.starts_with("redis") {
                    redis_ms += redis_cpu_ms(redis_port) - redis_before.0;
                    commands += redis_info(redis_port, "stats", "total_commands_processed:")
                        - redis_before.1;
                }
                kill_all(&mut replicas);
                // The 30 handovers of the window, each to one of 70-100 waiting.
                handover.extend(gaps(&stamps).into_iter().take(30));
            }
            let redis = url.starts_with("redis");
            let _ = writeln!(
                out,
                "| {name} | {:.2} | {:.2} | {:.0} | {} | {} |",
                percentile(&handover, 50.0),
                percentile(&handover, 99.0),
                host_ms / seconds,
                if redis {
                    format!("{:.1}", redis_ms / seconds)
                } else {
                    "n/a".into()
                },
                if redis {
                    format!("{:.0}", commands / seconds)
                } else {
                    "n/a".into()
                },
            );
        }

        // 1,000 keys, each with its own leader, renewing every 2 s; then a
        // handover on one of them while the others keep renewing.
        let tool = Tool {
            name: "keys",
            kind: Kind::Leaderrun {
                url: format!("redis://127.0.0.1:{redis_port}"),
                bin: BIN,
            },
        };
        let mut leaders: Vec<Child> = (0..1000)
            .map(|i| {
                tool.command(&format!("key-{i}"), &["sleep", "3600"])
                    .spawn()
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_secs(10));
        let (cpu, commands) = (
            redis_cpu_ms(redis_port),
            redis_info(redis_port, "stats", "total_commands_processed:"),
        );
        std::thread::sleep(Duration::from_secs(10));
        let redis_cpu = (redis_cpu_ms(redis_port) - cpu) / 10.0;
        let redis_commands =
            (redis_info(redis_port, "stats", "total_commands_processed:") - commands) / 10.0;
        let handover = self
            .interleaved_handovers(std::slice::from_ref(&tool), 200, 100)
            .remove(0);
        let rss: u64 = leaders
            .iter()
            .take(20)
            .map(|c| status_kb(c.id(), "VmRSS:"))
            .sum::<u64>()
            / 20;
        kill_all(&mut leaders);
        let _ = writeln!(
            out,
            "| redis, 1,000 keys each led by its own leaderrun (+ a handover on another key) | {:.2} | {:.2} | n/a | {redis_cpu:.1} | {redis_commands:.0} |",
            percentile(&handover, 50.0),
            percentile(&handover, 99.0),
        );
        let _ = writeln!(
            out,
            "\nleaderrun runs one key per process: 1,000 keys are 1,000 supervisors (RSS {:.1} MB each, most of it shared pages of the binary and libc). Handovers in these scenarios are between children that hold 100 ms each (the 100-follower rows pool 3 rounds of 30 handovers; the 1,000-key row has 200), so the start-up of the harness's replacement replicas does not overlap the next handover. Host CPU is every core's busy time over the handovers (leaderrun, Redis, the harness), from /proc/stat; Redis CPU is the server's own user+system time.",
            rss as f64 / 1024.0
        );
    }
}

/// One tool's handovers: replicas queue up on one key; each child stamps,
/// holds `hold_ms`, then waits on a FIFO; opening the FIFO ends the term,
/// and the next replica (waiting) takes over. A term ends only when every
/// queued replica is known to be waiting (its threads have used no CPU for
/// 20 ms): the start-up of a replacement never overlaps a handover,
/// whatever the hold.
struct HandoverRig {
    stamps: PathBuf,
    go: PathBuf,
    spawn: Box<dyn Fn() -> Child>,
    replicas: Vec<(Child, Instant)>,
    round: usize,
}

impl HandoverRig {
    fn new(bench: &Bench, tool: &Tool, hold_ms: i64) -> HandoverRig {
        let name = format!("{}-handover-{hold_ms}", slug(tool.name));
        let stamps = bench.dir.join(format!("{name}.stamps"));
        let go = bench.dir.join(format!("{name}.go"));
        nix::unistd::mkfifo(&go, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // A key of the tool's own: two builds of leaderrun on one backend
        // (LEADERRUN_BENCH_AGAINST) must not share a lease.
        let mut command = bench.stamped(tool, &name, &stamps, hold_ms);
        command.env("LEADERRUN_BENCH_GO", &go);
        let program = command.get_program().to_owned();
        let args: Vec<_> = command.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = command
            .get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
            .collect();
        let spawn = Box::new(move || {
            let mut command = Command::new(&program);
            command
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            for (name, value) in &envs {
                match value {
                    Some(value) => command.env(name, value),
                    None => command.env_remove(name),
                };
            }
            command.spawn().unwrap()
        });
        let replicas = (0..3).map(|_| (spawn(), Instant::now())).collect();
        HandoverRig {
            stamps,
            go,
            spawn,
            replicas,
            round: 0,
        }
    }

    /// The current term runs: its child's start is stamped.
    fn ready(&self) {
        wait_for_lines(&self.stamps, 2 * self.round + 1, Duration::from_secs(60));
    }

    fn wait_until_waiting(&self) {
        for (replica, spawned) in &self.replicas {
            wait_until_waiting(replica.id(), *spawned);
        }
    }

    /// Ends the current term; the next begins; only then the replacement of
    /// the replica that ended starts. Which replica leads next is the
    /// backend's choice, not the order they were started in.
    fn hand_over(&mut self) {
        drop(fs::OpenOptions::new().write(true).open(&self.go).unwrap());
        wait_for_lines(&self.stamps, 2 * self.round + 3, Duration::from_secs(60));
        let ended = loop {
            if let Some(i) = self
                .replicas
                .iter_mut()
                .position(|(r, _)| r.try_wait().unwrap().is_some())
            {
                break i;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        self.replicas.swap_remove(ended);
        self.replicas.push(((self.spawn)(), Instant::now()));
        self.round += 1;
    }

    /// The gaps, once the replicas (and their children: a killed flock or
    /// etcdctl leaves its child running, and holding the lock) are gone.
    fn finish(self) -> Vec<f64> {
        let mut replicas: Vec<Child> = self.replicas.into_iter().map(|(r, _)| r).collect();
        kill_all(&mut replicas);
        gaps(&self.stamps)
    }
}

/// The commands clients sent Redis so far, from `INFO commandstats`: those
/// a client sends itself, not those run by its scripts.
fn redis_client_commands(port: u16) -> f64 {
    let info = redis_info_text(port, "commandstats");
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let client = [
                "evalsha", "eval", "blpop", "hello", "select", "ping", "auth",
            ]
            .contains(&name)
                || name.starts_with("script|")
                || name.starts_with("client|");
            if !client {
                return None;
            }
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse::<f64>()
                .ok()
        })
        .sum()
}

/// The calls etcd on `port` has started (`grpc_server_started_total`).
fn etcd_started_calls(port: u16) -> f64 {
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return 0.0;
    };
    let request =
        format!("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    let mut reply = String::new();
    if std::io::Write::write_all(&mut stream, request.as_bytes()).is_err()
        || std::io::Read::read_to_string(&mut stream, &mut reply).is_err()
    {
        return 0.0;
    }
    reply
        .lines()
        .filter(|l| l.starts_with("grpc_server_started_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// How the shard rows count backend requests: at the server (Redis: the
/// commands clients send; etcd: the calls it started), or as leaderrun counts
/// its own calls (`leaderrun_backend_calls_total`, every shard's and the
/// replica's).
enum Requests {
    Redis(u16),
    Etcd(u16),
    Leaderrun,
}

/// Shards and replicas of the shard rows.
const SHARDS: usize = 64;
const SHARD_REPLICAS: usize = 4;
const SHARD_ROUNDS: usize = 3;

/// 64 shards over 4 replicas, on each backend, at the default timing (ttl
/// 6 s, renewals every 2 s), three rounds each: time from start until every
/// shard runs and until the split is 16/16/16/16; after `kill -9` of a
/// replica's leaderrun (its guard stops its commands and releases their
/// shards), until its shards run elsewhere
/// and the split is 22/21/21; after a fourth replica joins, until it is
/// 16/16/16/16 again; the backend requests per second of the four replicas
/// while settled (10 s); RSS per replica.
fn shard_mode(out: &mut String, dir: &Path, backends: &[(&str, String, Requests)]) {
    let _ = writeln!(
        out,
        "\n## Shard mode\n\n{SHARDS} shards over {SHARD_REPLICAS} replicas, default timing (ttl 6 s, renewals every 2 s), {SHARD_ROUNDS} rounds per backend, p50 (max) in ms:\n\n| backend | every shard runs, from start | split 16/16/16/16, from start | shards of a `kill -9`'d replica run elsewhere | split 22/21/21 after it | split 16×4 after a fourth joins | requests/s settled (4 replicas) | RSS per replica (MB) |\n|---|---|---|---|---|---|---|---|"
    );
    for (name, url, requests) in backends {
        let mut figures: Vec<Vec<f64>> = vec![Vec::new(); 7];
        for round in 0..SHARD_ROUNDS {
            let key = format!("shards-{name}-{round}");
            let owners = dir.join(&key);
            fs::create_dir_all(&owners).unwrap();
            let spawn = |owner: &str, port: u16| -> Child {
                let mut command = Command::new(BIN);
                common::dies_with_the_test(&mut command);
                command
                    .args(["--backend", url, "--key", &key, "--owner", owner])
                    .args(["--shards", &SHARDS.to_string()])
                    .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
                    .args(["--", "sh", "-c"])
                    .arg(format!(
                        "echo $$ $LEADERRUN_OWNER > {}/owner.$LEADERRUN_SHARD; exec sleep 3600",
                        owners.display()
                    ))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            };
            let split = || -> Option<Vec<usize>> {
                let mut by_owner = std::collections::BTreeMap::new();
                for shard in 0..SHARDS {
                    let text = fs::read_to_string(owners.join(format!("owner.{shard}"))).ok()?;
                    let (pid, owner) = text.trim().split_once(' ')?;
                    if !alive(pid.parse().ok()?) {
                        return None;
                    }
                    *by_owner.entry(owner.to_owned()).or_insert(0) += 1;
                }
                let mut shares: Vec<usize> = by_owner.into_values().collect();
                shares.sort_unstable_by(|a, b| b.cmp(a));
                Some(shares)
            };
            // Until `done` holds for two seconds; the time it first held.
            let settle = |from: Instant, done: &dyn Fn(&Vec<usize>) -> bool| -> f64 {
                let mut since: Option<Instant> = None;
                let deadline = from + Duration::from_secs(120);
                while Instant::now() < deadline {
                    match split() {
                        Some(shares) if done(&shares) => {
                            let at = *since.get_or_insert_with(Instant::now);
                            if at.elapsed() >= Duration::from_secs(2) {
                                return (at - from).as_secs_f64() * 1000.0;
                            }
                        }
                        _ => since = None,
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                f64::NAN
            };
            let ports: Vec<u16> = (0..=SHARD_REPLICAS).map(|_| free_port()).collect();
            let started = Instant::now();
            let mut replicas: Vec<Child> = (0..SHARD_REPLICAS)
                .map(|i| spawn(&format!("r{i}"), ports[i]))
                .collect();
            let mut running = f64::NAN;
            while started.elapsed() < Duration::from_secs(120) {
                if split().is_some() {
                    running = started.elapsed().as_secs_f64() * 1000.0;
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            figures[0].push(running);
            let even = vec![SHARDS / SHARD_REPLICAS; SHARD_REPLICAS];
            figures[1].push(settle(started, &|s| *s == even));
            // Settled: the replicas' requests over 10 s.
            let count = || match requests {
                Requests::Redis(port) => redis_client_commands(*port),
                Requests::Etcd(port) => etcd_started_calls(*port),
                Requests::Leaderrun => ports[..SHARD_REPLICAS]
                    .iter()
                    .map(|port| all_backend_calls(*port))
                    .sum(),
            };
            let before = count();
            std::thread::sleep(Duration::from_secs(10));
            figures[5].push((count() - before) / 10.0);
            let rss: u64 = replicas.iter().map(|c| status_kb(c.id(), "VmRSS:")).sum();
            figures[6].push(rss as f64 / SHARD_REPLICAS as f64 / 1024.0);
            // kill -9 of one replica: the guard releases its shards.
            let killed = Instant::now();
            let _ = replicas[0].kill();
            let _ = replicas[0].wait();
            let mut moved = f64::NAN;
            while killed.elapsed() < Duration::from_secs(120) {
                if split().is_some_and(|s| s.len() == SHARD_REPLICAS - 1) {
                    moved = killed.elapsed().as_secs_f64() * 1000.0;
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            figures[2].push(moved);
            figures[3].push(settle(killed, &|s| *s == [22, 21, 21]));
            // A fourth replica joins.
            let joined = Instant::now();
            replicas.push(spawn("r4", ports[SHARD_REPLICAS]));
            figures[4].push(settle(joined, &|s| *s == even));
            for child in &mut replicas {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(child.id() as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            for child in &mut replicas {
                let _ = child.wait();
            }
        }
        let cell = |values: &[f64], digits: usize| {
            let max = values.iter().cloned().fold(f64::NAN, f64::max);
            format!("{:.digits$} ({max:.digits$})", percentile(values, 50.0),)
        };
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {:.1} | {:.1} |",
            cell(&figures[0], 0),
            cell(&figures[1], 0),
            cell(&figures[2], 0),
            cell(&figures[3], 0),
            cell(&figures[4], 0),
            percentile(&figures[5], 50.0),
            percentile(&figures[6], 50.0),
        );
    }
    let _ = writeln!(
        out,
        "\nA replica runs `sh -c 'echo ...; exec sleep 3600'` per shard it holds; a shard runs when the last command started for it is alive. A split counts once it has held for 2 s (the time given is when it began). Requests: Redis, the commands the replicas send (scripts, `BLPOP`; not the commands the scripts run inside the server); etcd, the calls it started (a watch as one); files and PostgreSQL, the calls leaderrun counts (`leaderrun_backend_calls_total`, every shard's and the replica's own). The killed replica's shards are released by its guard, so they move within milliseconds; a host that dies would leave them to lapse at their ttl."
    );
}

/// Every `leaderrun_backend_calls_total` line (shard mode: each shard's and
/// the replica's) of the leaderrun serving metrics on `port`, summed.
fn all_backend_calls(port: u16) -> f64 {
    calls_lines(port)
        .iter()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `leaderrun_backend_calls_total` lines of the leaderrun serving
/// metrics on `port`.
fn calls_lines(port: u16) -> Vec<String> {
    use std::io::{Read as _, Write as _};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return Vec::new();
    };
    let _ = write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
    );
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
        .lines()
        .filter(|l| l.starts_with("leaderrun_backend_calls_total"))
        .map(String::from)
        .collect()
}

/// Kills every replica and its command, and reaps the replicas.
fn kill_all(replicas: &mut [Child]) {
    for child in replicas.iter_mut() {
        if let Some(pid) = child_pid(child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = child.kill();
    }
    for child in replicas.iter_mut() {
        let _ = child.wait();
    }
}

fn redis_info_text(port: u16, section: &str) -> String {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut connection = client.get_connection().unwrap();
    redis::cmd("INFO")
        .arg(section)
        .query(&mut connection)
        .unwrap()
}

fn redis_info(port: u16, section: &str, field: &str) -> f64 {
    redis_info_text(port, section)
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The Redis server's CPU (user + system) in ms.
fn redis_cpu_ms(port: u16) -> f64 {
    (redis_info(port, "cpu", "used_cpu_sys:") + redis_info(port, "cpu", "used_cpu_user:")) * 1000.0
}

fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
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

/// etcd's own part of a handover: `samples` puts, each after 20 ms of quiet,
/// sent on a kept connection by a minimal client, and the time (ms) from
/// each send to its event arriving on a watch (etcd's JSON gateway, over
/// bare HTTP/1.1).
fn etcd_write_seen(port: u16, samples: usize) -> Vec<f64> {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpStream;
    use std::sync::{Arc, Mutex};
    let post = |path: &str, body: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let key = "Zmxvb3I="; // "floor"
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let mut watch = TcpStream::connect(("127.0.0.1", port)).unwrap();
    watch
        .write_all(
            post(
                "/v3/watch",
                &format!(r#"{{"create_request":{{"key":"{key}"}}}}"#),
            )
            .as_bytes(),
        )
        .unwrap();
    let seen = arrivals.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(watch).lines() {
            let Ok(line) = line else { return };
            if line.contains("\"events\"") {
                seen.lock().unwrap().push(monotonic_ns());
            }
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut kv = TcpStream::connect(("127.0.0.1", port)).unwrap();
    kv.set_nodelay(true).unwrap();
    let mut floor = Vec::new();
    for i in 0..samples {
        std::thread::sleep(SETTLE);
        let request = post(
            "/v3/kv/put",
            &format!(
                r#"{{"key":"{key}","value":"{}"}}"#,
                if i % 2 == 0 { "MA==" } else { "MQ==" }
            ),
        );
        let sent = monotonic_ns();
        kv.write_all(request.as_bytes()).unwrap();
        // The reply: headers, then a body of the length they give.
        let mut reply = Vec::new();
        let mut byte = [0u8; 1];
        while !reply.ends_with(b"\r\n\r\n") {
            kv.read_exact(&mut byte).unwrap();
            reply.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&reply).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("a put's reply has a length");
        kv.read_exact(&mut vec![0; length]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(&arrived) = arrivals.lock().unwrap().get(i) {
                floor.push((arrived - sent) as f64 / 1e6);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the watch saw no event for put {i}"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    floor
}

fn monotonic_ns() -> u128 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    now.tv_sec() as u128 * 1_000_000_000 + now.tv_nsec() as u128
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

fn wait_for_lines_within(path: &Path, n: usize, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while read_stamps(path).len() < n {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

fn wait_for_lines(path: &Path, n: usize, timeout: Duration) {
    assert!(
        wait_for_lines_within(path, n, timeout),
        "timed out waiting for {}",
        path.display()
    );
}

/// Waits (up to 10 s) until `pid` has run for at least 20 ms and its
/// threads have used no CPU over the last 20 ms: it is waiting for the lease.
fn wait_until_waiting(pid: u32, spawned: Instant) {
    let cpu_ns = || -> u64 {
        fs::read_dir(format!("/proc/{pid}/task"))
            .map(|tasks| {
                tasks
                    .filter_map(|t| t.ok())
                    .filter_map(|t| fs::read_to_string(t.path().join("schedstat")).ok())
                    .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                    .sum()
            })
            .unwrap_or(0)
    };
    let give_up = Instant::now() + Duration::from_secs(10);
    let mut last = cpu_ns();
    while Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(20));
        let now = cpu_ns();
        if now == last && spawned.elapsed() >= Duration::from_millis(20) {
            return;
        }
        last = now;
    }
}

/// The tool's command among the children of `parent`: the stamp program
/// (not leaderrun's guard or the keeper of its memory, which are its
/// children too, and come first).
fn child_pid(parent: u32) -> Option<u32> {
    fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rfind(')')
                    .and_then(|i| stat[i + 2..].split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(parent)
                    && fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| c.trim() == "stamp")
            })
        })
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .is_some_and(|i| !stat[i + 2..].starts_with('Z'))
    })
}

fn status_kb(pid: u32, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(field))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the comm.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// CPU time (ms) the whole host has spent busy, over every core.
fn host_busy_ms() -> f64 {
    let stat = fs::read_to_string("/proc/stat").unwrap();
    let ticks: Vec<u64> = stat.lines().next().unwrap()[3..]
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    // user nice system idle iowait irq softirq steal ...: all but idle, iowait.
    let busy: u64 = ticks.iter().take(8).sum::<u64>() - ticks[3] - ticks[4];
    busy as f64 * 10.0
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((p / 100.0) * (sorted.len() - 1) as f64).round() as usize]
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
    let memory = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().next().map(|l| {
                l.split_whitespace()
                    .nth(1)
                    .unwrap_or("0")
                    .parse::<u64>()
                    .unwrap_or(0)
                    / 1024
                    / 1024
            })
        })
        .unwrap_or(0);
    let version = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .ok()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_owned()
            })
            .unwrap_or_else(|| "not installed".into())
    };
    format!(
        "Machine: {cores} cores ({cpu}), {memory} GiB, Linux {}; {}; {}; {}; etcdctl {}; {}.",
        kernel.trim(),
        version("redis-server", "--version"),
        version("psql", "--version"),
        version("etcd", "--version"),
        version("etcdctl", "version").trim_start_matches("etcdctl version: "),
        version("flock", "--version"),
    )
}
