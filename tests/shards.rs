//! Shard mode (`--shards N`, SPEC §6a) with real replicas: the split, the
//! hand-over when a replica joins, stops or is killed, a crashing shard, a
//! replica with another count, `status`, metrics; on the file backend, a
//! real Redis and a real etcd.
//!
//! Every shard's command takes a lock on `held.<shard>` without waiting: a
//! second command of the same shard that finds the lock taken writes to
//! `overlaps`, which must stay empty.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::etcd_server::EtcdCluster;
use common::postgres_server::PostgresServer;
use common::redis_server::RedisServer;
use common::redis_server::free_port;
use common::{BIN, Replica, Sandbox, alive, get, wait_until};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::process::Command;

/// A shard's command: holds its shard's lock, says who runs it, and exits
/// 0 on SIGTERM.
const SHARD: &str = r#"exec 9>"held.$LEADERRUN_SHARD"
flock -n 9 || echo "$LEADERRUN_SHARD" >> overlaps
echo "$LEADERRUN_SHARD $LEADERRUN_TOKEN $LEADERRUN_OWNER $LEADERRUN_KEY $LEADERRUN_SHARDS" >> starts
echo "$$ $LEADERRUN_OWNER" > "owner.$LEADERRUN_SHARD.new"
mv "owner.$LEADERRUN_SHARD.new" "owner.$LEADERRUN_SHARD"
trap 'kill $sleeping; exit 0' TERM
sleep 300 &
sleeping=$!
wait $sleeping"#;

const LONG: Duration = Duration::from_secs(20);

/// How long a split must hold to count as settled.
const STABLE: Duration = Duration::from_secs(1);

struct Fleet<'a> {
    sandbox: &'a Sandbox,
    backend: String,
    key: &'static str,
    n: u32,
}

impl Fleet<'_> {
    fn replica(&self, owner: &str, extra: &[&str]) -> Replica {
        self.sandbox
            .leaderrun_on(&self.backend, self.key)
            .args(["--owner", owner, "--shards", &self.n.to_string()])
            .args(extra)
            .sh(SHARD)
            .spawn()
    }

    /// Who runs each shard now (the last command started for it is alive),
    /// by owner: None unless every shard runs.
    fn split(&self) -> Option<BTreeMap<String, usize>> {
        let mut split = BTreeMap::new();
        for shard in 0..self.n {
            let last = self.sandbox.read(&format!("owner.{shard}"));
            let (pid, owner) = last.trim().split_once(' ')?;
            if !alive(Pid::from_raw(pid.parse().ok()?)) {
                return None;
            }
            *split.entry(owner.to_owned()).or_insert(0) += 1;
        }
        Some(split)
    }

    /// The shares, largest first, once every shard runs.
    fn shares(&self) -> Option<Vec<usize>> {
        let mut shares: Vec<usize> = self.split()?.into_values().collect();
        shares.sort_unstable_by(|a, b| b.cmp(a));
        Some(shares)
    }

    /// Waits until every shard runs with these shares, and they stay so for
    /// a second; returns how long it took to get there.
    fn settles_to(&self, shares: &[usize], within: Duration, why: &str) -> Duration {
        let started = Instant::now();
        let mut last = None;
        let mut since: Option<Instant> = None;
        let settled = wait_until(within, || {
            last = self.shares();
            if last.as_deref() != Some(shares) {
                since = None;
                return false;
            }
            since.get_or_insert_with(Instant::now).elapsed() >= STABLE
        });
        assert!(
            settled,
            "{why}: expected shares {shares:?} within {within:?}, last seen {last:?} ({:?}); started:\n{}overlaps: {}",
            self.split(),
            self.sandbox.read("starts"),
            self.sandbox.read("overlaps")
        );
        since.map_or(started.elapsed(), |at| at - started)
    }

    /// Nothing ran twice at once, and each shard's tokens grew.
    fn check_history(&self) {
        assert_eq!(
            self.sandbox.read("overlaps"),
            "",
            "two commands of a shard at once"
        );
        let mut tokens: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for line in self.sandbox.lines("starts") {
            let fields: Vec<&str> = line.split(' ').collect();
            assert_eq!(
                fields[3], self.key,
                "LEADERRUN_KEY is the key given: {line}"
            );
            assert_eq!(fields[4], self.n.to_string(), "LEADERRUN_SHARDS: {line}");
            tokens
                .entry(fields[0].parse().unwrap())
                .or_default()
                .push(fields[1].parse().unwrap());
        }
        for (shard, tokens) in &tokens {
            assert!(
                tokens.windows(2).all(|w| w[0] < w[1]),
                "shard {shard}: tokens {tokens:?}"
            );
        }
    }
}

/// Three replicas split eight shards 3/3/2; a fourth joins: 2/2/2/2 within
/// three renewal periods; `kill -9` of one: its shards run elsewhere within
/// their ttl (at once: its guard releases them), 3/3/2; a graceful stop of
/// one: the other two take its shards at once, 4/4.
fn split_kill_join_stop(sandbox: &Sandbox, backend: String) {
    let fleet = Fleet {
        sandbox,
        backend,
        key: "jobs",
        n: 8,
    };
    let a = fleet.replica("a", &[]);
    let mut b = fleet.replica("b", &[]);
    let _c = fleet.replica("c", &[]);
    let took = fleet.settles_to(&[3, 3, 2], LONG, "three replicas");
    eprintln!("every shard ran, split 3/3/2, {took:?} after start");

    let _d = fleet.replica("d", &[]);
    let took = fleet.settles_to(&[2, 2, 2, 2], LONG, "after a fourth joined");
    eprintln!("a fourth replica: 2/2/2/2 after {took:?} (renewal period 400 ms)");
    assert!(
        took < Duration::from_secs(4),
        "the split took {took:?} after a join"
    );

    let held_by_a = fleet.split().unwrap().get("a").copied().unwrap_or(0);
    a.signal(Signal::SIGKILL);
    let took = fleet.settles_to(&[3, 3, 2], LONG, "after kill -9");
    eprintln!("kill -9 of a replica holding {held_by_a}: 3/3/2 after {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "the killed replica's shards ran elsewhere only {took:?} later (ttl 2 s)"
    );

    b.signal(Signal::SIGTERM);
    let took = fleet.settles_to(&[4, 4], LONG, "after a graceful stop");
    eprintln!("graceful stop of a replica: 4/4 after {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the stopped replica's shards ran elsewhere only {took:?} later"
    );
    assert_eq!(b.wait(LONG), Some(0), "a stopped shard replica exits 0");
    fleet.check_history();
}

#[test]
fn shards_split_and_move_on_files() {
    let sandbox = Sandbox::new();
    split_kill_join_stop(&sandbox, sandbox.backend());
}

/// `kill -9` of one of four replicas of 64 file shards: every one of its
/// shards runs elsewhere on the releases its guard makes. The same replica
/// may be first in line for many of them and have room for only some, and
/// its wake must travel the line to a replica with room; the followers'
/// attempts are 30 s apart here (and the leases' ttl 30 s), so a wake that
/// stops on the way shows as a shard not running for 30 s.
#[test]
fn every_shard_of_a_killed_replica_runs_elsewhere_on_its_release() {
    let sandbox = Sandbox::new();
    let fleet = Fleet {
        sandbox: &sandbox,
        backend: sandbox.backend(),
        key: "many",
        n: 64,
    };
    let slow = ["--campaign-every", "30s", "--ttl", "30s"];
    let replicas: Vec<Replica> = ["a", "b", "c", "d"]
        .iter()
        .map(|owner| fleet.replica(owner, &slow))
        .collect();
    let took = fleet.settles_to(&[16, 16, 16, 16], Duration::from_secs(60), "four replicas");
    eprintln!("four replicas of 64 shards: 16/16/16/16 after {took:?}");
    replicas[0].signal(Signal::SIGKILL);
    let took = fleet.settles_to(&[22, 21, 21], Duration::from_secs(25), "after kill -9");
    eprintln!("kill -9 of one of four replicas of 64 shards: 22/21/21 after {took:?}");
    assert!(
        took < Duration::from_secs(10),
        "the killed replica's shards ran elsewhere only {took:?} later"
    );
    fleet.check_history();
}

#[test]
fn shards_split_and_move_on_redis() {
    let sandbox = Sandbox::new();
    let redis = RedisServer::start();
    split_kill_join_stop(&sandbox, redis.url().to_owned());
}

#[test]
fn shards_split_and_move_on_etcd() {
    let sandbox = Sandbox::new();
    let etcd = EtcdCluster::start(1);
    split_kill_join_stop(&sandbox, etcd.url());
}

#[test]
fn shards_split_and_move_on_postgres() {
    let sandbox = Sandbox::new();
    let postgres = PostgresServer::start();
    split_kill_join_stop(&sandbox, postgres.url());
}

/// A replica that joins and leaves within a renewal period moves no shard:
/// the others count a newcomer only once it has stayed a whole period.
#[test]
fn a_replica_that_joins_and_leaves_at_once_moves_no_shard() {
    let sandbox = Sandbox::new();
    let fleet = Fleet {
        sandbox: &sandbox,
        backend: sandbox.backend(),
        key: "flap",
        n: 8,
    };
    let _a = fleet.replica("a", &[]);
    let _b = fleet.replica("b", &[]);
    fleet.settles_to(&[4, 4], LONG, "two replicas");
    let before = sandbox.lines("starts").len();
    for _ in 0..3 {
        let mut visitor = fleet.replica("visitor", &[]);
        std::thread::sleep(Duration::from_millis(150));
        visitor.signal(Signal::SIGTERM);
        assert_eq!(visitor.wait(LONG), Some(0));
    }
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(fleet.shares(), Some(vec![4, 4]));
    assert_eq!(
        sandbox.lines("starts").len(),
        before,
        "a shard moved:\n{}",
        sandbox.read("starts")
    );
}

/// `status` shows each shard's holder and token (text and JSON); metrics
/// carry a `shard` label; `/leader` is 200 while the replica runs a shard.
#[test]
fn status_and_metrics_show_each_shard() {
    let sandbox = Sandbox::new();
    let fleet = Fleet {
        sandbox: &sandbox,
        backend: sandbox.backend(),
        key: "seen",
        n: 3,
    };
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let _a = fleet.replica("a", &["--metrics-addr", &address]);
    fleet.settles_to(&[3], LONG, "one replica");
    let status = |json: &[&str]| {
        Command::new(BIN)
            .args(["status", "--backend", &sandbox.backend(), "--key", "seen"])
            .args(json)
            .output()
            .unwrap()
    };
    let text = status(&[]);
    let shown = String::from_utf8_lossy(&text.stdout);
    assert_eq!(text.status.code(), Some(0), "{shown}");
    assert!(shown.contains("shards:     3 (3 held)"), "{shown}");
    assert!(shown.contains("shard 2: a, token 1"), "{shown}");
    let json = status(&["--json"]);
    let value: serde_json::Value = serde_json::from_slice(&json.stdout).expect("one JSON object");
    assert_eq!(value["shards"], 3);
    assert_eq!(value["held"], 3);
    assert_eq!(value["by_shard"][1]["holder"], "a");
    assert_eq!(value["candidates"][0]["shards"], 3);
    let (code, body) = get(port, "/metrics");
    assert_eq!(code, 200);
    assert!(
        body.contains("leaderrun_leading{key=\"seen\",owner=\"a\",shard=\"2\"} 1"),
        "{body}"
    );
    assert_eq!(get(port, "/leader").0, 200);
}

/// A shard whose command exits 1 at once starts again at most once per
/// campaign period; the other shard runs on.
#[test]
fn a_crashing_shard_restarts_at_most_once_per_campaign_period() {
    let sandbox = Sandbox::new();
    let mut replica = sandbox
        .leaderrun("crash")
        .args(["--shards", "2", "--campaign-every", "300ms"])
        .sh(r#"echo run >> "starts.$LEADERRUN_SHARD"; [ "$LEADERRUN_SHARD" = 0 ] && exit 1; exec sleep 300"#)
        .spawn();
    std::thread::sleep(Duration::from_secs(3));
    let crashes = sandbox.lines("starts.0").len();
    assert!(
        (3..=11).contains(&crashes),
        "shard 0 started {crashes} times in 3 s (campaign period 300 ms)"
    );
    assert_eq!(sandbox.lines("starts.1").len(), 1, "shard 1 ran once");
    assert!(replica.running());
    replica.signal(Signal::SIGTERM);
    assert_eq!(replica.wait(LONG), Some(0));
}

/// A replica started with another `--shards` than the key's oldest takes no
/// shard and says why; the oldest keeps its shards.
#[test]
fn a_replica_with_another_shard_count_takes_no_shard() {
    let sandbox = Sandbox::new();
    let fleet = Fleet {
        sandbox: &sandbox,
        backend: sandbox.backend(),
        key: "counts",
        n: 4,
    };
    let _a = fleet.replica("a", &[]);
    fleet.settles_to(&[4], LONG, "one replica");
    let other = Fleet { n: 8, ..fleet };
    let b = other.replica("b", &[]);
    assert!(b.wait_log("taking no shard", LONG), "{}", b.stderr());
    assert!(b.stderr().contains("--shards 4"), "{}", b.stderr());
    std::thread::sleep(Duration::from_secs(1));
    let fleet = Fleet { n: 4, ..other };
    assert_eq!(
        fleet.shares(),
        Some(vec![4]),
        "the oldest keeps every shard"
    );
    assert!(!sandbox.read("starts").contains(" b "), "b ran a shard");
}

/// Each shard's hooks get the shard: a fence floor per shard moves each
/// shard's own counter.
#[test]
fn each_shard_has_its_own_counter_and_hooks() {
    let sandbox = Sandbox::new();
    let mut replica = sandbox
        .leaderrun("floors")
        .args(["--shards", "3"])
        .args([
            "--fence-floor-cmd",
            "echo $(( (LEADERRUN_SHARD + 1) * 100 ))",
        ])
        .sh(r#"echo "$LEADERRUN_SHARD $LEADERRUN_TOKEN" >> tokens; exec sleep 300"#)
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 3));
    let mut tokens = sandbox.lines("tokens");
    tokens.sort();
    assert_eq!(tokens, ["0 101", "1 201", "2 301"]);
    replica.signal(Signal::SIGTERM);
    assert_eq!(replica.wait(LONG), Some(0));
}

/// Bad `--shards` values and `--shards` with a wait: exit 2, naming the value
/// and the fix; nothing runs.
#[test]
fn bad_shard_counts_are_refused() {
    let sandbox = Sandbox::new();
    for (args, says) in [
        (vec!["--shards", "0"], "from 1 to 4096"),
        (vec!["--shards", "4097"], "from 1 to 4096"),
        (vec!["--shards", "many"], "whole number"),
        (vec!["--shards", "4", "--no-wait"], "runs until stopped"),
        (vec!["--shards", "4", "--wait", "5s"], "drop them"),
    ] {
        let out = sandbox.leaderrun("bad").args(&args).sh("touch ran").run();
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
        assert!(!sandbox.path("ran").exists(), "{args:?} ran the command");
    }
}
