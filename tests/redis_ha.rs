//! Redis as production runs it: a primary and a replica behind three
//! sentinels, and a three-primary Cluster with a replica each, all real
//! `redis-server` processes on loopback. Failovers (asked for, a primary
//! killed, a primary stopped) never let two terms' commands run at once,
//! and tokens only grow.

mod common;

use std::time::{Duration, Instant};

use common::redis_server::{Cluster, SERVICE, SentinelSet};
use common::{Sandbox, alive, ensure_dead, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(30);

/// A ttl of 6 s, renewals every 500 ms: a renewal budget of about 4 s, in
/// which a failover asked for completes.
const PATIENT: [&str; 4] = ["--ttl", "6s", "--renew-every", "500ms"];

/// Records its token and pid, and runs until stopped.
const RUNS: &str = "echo $$ >> pids; echo $LEADERRUN_TOKEN >> tokens; trap 'exit 0' TERM; while :; do sleep 0.02; done";

fn tokens(sandbox: &Sandbox) -> Vec<u64> {
    sandbox
        .lines("tokens")
        .iter()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// Waits until `n` terms started, each after the last one's command died.
fn wait_terms(sandbox: &Sandbox, n: usize, leader: &common::Replica) {
    assert!(
        wait_until(LONG, || tokens(sandbox).len() >= n),
        "{}",
        leader.stderr()
    );
    let tokens = tokens(sandbox);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens went back: {tokens:?}"
    );
    // Only the newest term's command is alive.
    let pids: Vec<i32> = sandbox
        .lines("pids")
        .iter()
        .map(|p| p.parse().unwrap())
        .collect();
    for pid in &pids[..pids.len() - 1] {
        assert!(
            !alive(nix::unistd::Pid::from_raw(*pid)),
            "an old term's command still runs"
        );
    }
}

#[test]
fn a_term_goes_on_through_a_sentinel_failover_it_asked_for() {
    let set = SentinelSet::start();
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun_on(&set.url(), "ha")
        .args(PATIENT)
        .sh(RUNS)
        .spawn();
    assert!(
        wait_until(LONG, || tokens(&sandbox).len() == 1),
        "{}",
        leader.stderr()
    );
    set.failover();
    // Renewals go to the new primary, which has the lease: the same term.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(tokens(&sandbox), [1], "{}", leader.stderr());
    assert!(alive(sandbox.wait_pid("pids")), "{}", leader.stderr());
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
    // The counter is on the new primary: tokens go on growing.
    let out = sandbox
        .leaderrun_on(&set.url(), "ha")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "2"), "{}", out.stderr);
}

#[test]
fn a_killed_or_stopped_primary_ends_the_term_and_the_next_starts_on_the_new_one() {
    for signal in [Signal::SIGKILL, Signal::SIGSTOP] {
        let mut set = SentinelSet::start();
        let sandbox = Sandbox::new();
        let leader = sandbox.leaderrun_on(&set.url(), "down").sh(RUNS).spawn();
        assert!(
            wait_until(LONG, || tokens(&sandbox).len() == 1),
            "{}",
            leader.stderr()
        );
        let old = set.primary_port();
        let primary = set.servers.iter_mut().find(|s| s.port == old).unwrap();
        if signal == Signal::SIGKILL {
            primary.stop();
        } else {
            primary.pause();
        }
        let failed = Instant::now();
        set.wait_new_primary(old);
        // The term ended by its deadline (600 ms budget); the next began on
        // the new primary, once the hold-off after a changed server passed.
        wait_terms(&sandbox, 2, &leader);
        let took = failed.elapsed();
        if signal == Signal::SIGSTOP {
            set.servers.iter().find(|s| s.port == old).unwrap().resume();
        }
        assert!(took < LONG, "{took:?}");
        std::thread::sleep(Duration::from_secs(2));
        wait_terms(&sandbox, 2, &leader);
        for pid in sandbox.lines("pids") {
            ensure_dead(nix::unistd::Pid::from_raw(pid.parse().unwrap()));
        }
    }
}

#[test]
fn an_unknown_service_is_refused_and_wait_asks_replicas_to_acknowledge() {
    let set = SentinelSet::start();
    let sandbox = Sandbox::new();
    let unknown = set.url().replace(&format!("/{SERVICE}"), "/nosuch");
    let out = sandbox.leaderrun_on(&unknown, "svc").sh("touch ran").run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("no service \"nosuch\""),
        "{}",
        out.stderr
    );
    assert!(!sandbox.path("ran").exists());

    // One replica: wait=1 is met, wait=2 never is (no lease counts).
    let out = sandbox
        .leaderrun_on(&format!("{}?wait=1", set.url()), "svc")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
    let out = sandbox
        .leaderrun_on(&format!("{}?wait=2", set.url()), "svc")
        .args(["--wait", "3s"])
        .sh("touch ran")
        .run();
    assert_ne!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("acknowledged"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());

    let status = common::Run::new(&sandbox.path(""))
        .args(["status", "--backend", &set.url(), "--key", "svc", "--json"])
        .run();
    assert!(status.stdout.contains("\"counter\":"), "{}", status.stderr);
}

#[test]
fn a_cluster_runs_each_lease_on_its_slot_and_follows_failovers() {
    let cluster = Cluster::start();
    let sandbox = Sandbox::new();
    // Many keys over the slots, one leaderrun each.
    let keys: Vec<String> = (0..12).map(|i| format!("job-{i}")).collect();
    let runs: Vec<common::Replica> = keys
        .iter()
        .map(|key| {
            sandbox
                .leaderrun_on(&cluster.url(), key)
                .sh(&format!("echo $LEADERRUN_TOKEN > {key}.token"))
                .spawn()
        })
        .collect();
    for (mut run, key) in runs.into_iter().zip(&keys) {
        assert_eq!(run.wait(LONG), Some(0), "{}", run.stderr());
        assert_eq!(sandbox.read(&format!("{key}.token")).trim(), "1");
    }

    let mut leader = sandbox
        .leaderrun_on(&cluster.url(), "ha")
        .args(PATIENT)
        .sh(RUNS)
        .spawn();
    assert!(
        wait_until(LONG, || tokens(&sandbox).len() == 1),
        "{}",
        leader.stderr()
    );
    // A failover asked for: the replica takes over with the lease.
    let primary = cluster.primary_of("leaderrun:{ha}:lease");
    let replica = cluster.replica_of(primary);
    replica.command(None, &["CLUSTER", "FAILOVER"]).unwrap();
    assert!(wait_until(LONG, || cluster
        .primary_of("leaderrun:{ha}:lease")
        .port
        == replica.port));
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(tokens(&sandbox), [1], "{}", leader.stderr());
    let status = common::Run::new(&sandbox.path(""))
        .args([
            "status",
            "--backend",
            &cluster.url(),
            "--key",
            "ha",
            "--json",
        ])
        .run();
    assert_eq!(status.code, 0, "{}", status.stderr);
    assert!(status.stdout.contains("\"token\":1"), "{}", status.stdout);
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn a_killed_cluster_primary_hands_the_slot_to_its_replica_and_tokens_grow() {
    let mut cluster = Cluster::start();
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun_on(&cluster.url(), "down")
        .sh(RUNS)
        .spawn();
    assert!(
        wait_until(LONG, || tokens(&sandbox).len() == 1),
        "{}",
        leader.stderr()
    );
    let port = cluster.primary_of("leaderrun:{down}:lease").port;
    cluster
        .nodes
        .iter_mut()
        .find(|n| n.port == port)
        .unwrap()
        .stop();
    wait_terms(&sandbox, 2, &leader);
    for pid in sandbox.lines("pids") {
        ensure_dead(nix::unistd::Pid::from_raw(pid.parse().unwrap()));
    }
}
