//! Redis as production runs it: a primary and a replica behind three
//! sentinels, and a three-primary Cluster with a replica each, all real
//! `redis-server` processes on loopback. Failovers (asked for, a primary
//! killed, a primary stopped) never let two terms' commands run at once,
//! and tokens only grow.

mod common;

use std::time::{Duration, Instant};

use common::redis_server::{Cluster, SERVICE, SentinelSet, free_port};
use common::{RUNS, Sandbox, alive, ensure_dead, first_term, tokens, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(30);

/// A ttl of 6 s, renewals every 500 ms: a renewal budget of about 4 s, in
/// which a failover asked for completes.
const PATIENT: [&str; 4] = ["--ttl", "6s", "--renew-every", "500ms"];

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

/// After a failover: `status` reads the lease, token 1 and one candidate,
/// leading, through `url`; the leader's metrics say it leads.
fn status_and_metrics_say_leading(sandbox: &Sandbox, url: &str, key: &str, metrics: u16) {
    let status = common::Run::new(&sandbox.path(""))
        .args(["status", "--backend", url, "--key", key, "--json"])
        .run();
    assert_eq!(status.code, 0, "{}", status.stderr);
    let json: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(json["token"], 1, "{json}");
    let candidates = json["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 1, "{json}");
    assert_eq!(candidates[0]["leading"], true, "{json}");
    let (code, text) = common::get(metrics, "/metrics");
    assert_eq!(code, 200);
    for line in ["leaderrun_leading{", "leaderrun_token{"] {
        let value = text
            .lines()
            .find(|l| l.starts_with(line))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or_else(|| panic!("no {line} in {text}"));
        assert_eq!(value, "1", "{text}");
    }
}

#[test]
fn a_term_goes_on_through_a_sentinel_failover_it_asked_for() {
    let set = SentinelSet::start();
    let sandbox = Sandbox::new();
    let metrics = free_port();
    let mut leader = first_term(
        &sandbox,
        &set.url(),
        "ha",
        &[
            &PATIENT[..],
            &["--metrics-addr", &format!("127.0.0.1:{metrics}")],
        ]
        .concat(),
    );
    set.failover();
    // Renewals go to the new primary, which has the lease: the same term.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(tokens(&sandbox), [1], "{}", leader.stderr());
    assert!(alive(sandbox.wait_pid("pids")), "{}", leader.stderr());
    status_and_metrics_say_leading(&sandbox, &set.url(), "ha", metrics);
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
        let leader = first_term(&sandbox, &set.url(), "down", &[]);
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

    let metrics = free_port();
    let mut leader = first_term(
        &sandbox,
        &cluster.url(),
        "ha",
        &[
            &PATIENT[..],
            &["--metrics-addr", &format!("127.0.0.1:{metrics}")],
        ]
        .concat(),
    );
    // A failover asked for: the replica takes over with the lease.
    cluster.failover("leaderrun:{ha}:lease");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(tokens(&sandbox), [1], "{}", leader.stderr());
    status_and_metrics_say_leading(&sandbox, &cluster.url(), "ha", metrics);
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn a_killed_cluster_primary_hands_the_slot_to_its_replica_and_tokens_grow() {
    let mut cluster = Cluster::start();
    let sandbox = Sandbox::new();
    let leader = first_term(&sandbox, &cluster.url(), "down", &[]);
    cluster.kill_primary("leaderrun:{down}:lease");
    wait_terms(&sandbox, 2, &leader);
    for pid in sandbox.lines("pids") {
        ensure_dead(nix::unistd::Pid::from_raw(pid.parse().unwrap()));
    }
}

#[test]
fn the_sentinels_password_comes_from_a_flag_or_the_environment_and_never_reaches_the_command() {
    let set = SentinelSet::start_with(Some("s3ntinel-pw"), false);
    let sandbox = Sandbox::new();
    // None, or a wrong one: refused, named, nothing run.
    for wrong in [None, Some("nope")] {
        let mut run = sandbox.leaderrun_on(&set.url(), "pw");
        if let Some(password) = wrong {
            run.args(["--sentinel-password", password]);
        }
        let out = run.sh("touch ran").run();
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(out.stderr.contains("--sentinel-password"), "{}", out.stderr);
        assert!(!sandbox.path("ran").exists());
    }
    let out = sandbox
        .leaderrun_on(&set.url(), "pw")
        .env("LEADERRUN_SENTINEL_PASSWORD", "s3ntinel-pw")
        .sh("env > env.txt; echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
    assert!(!sandbox.read("env.txt").contains("s3ntinel-pw"));
    assert!(!out.stderr.contains("s3ntinel-pw"));
    let out = sandbox
        .leaderrun_on(&set.url(), "pw")
        .args(["--sentinel-password", "s3ntinel-pw"])
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "2"), "{}", out.stderr);
    // A password for sentinels with no sentinel URL is a mistake.
    let out = sandbox
        .leaderrun_on(&format!("redis://127.0.0.1:{}", set.primary_port()), "pw")
        .args(["--sentinel-password", "s3ntinel-pw"])
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("redis+sentinel://"), "{}", out.stderr);
}

#[test]
fn sentinels_or_a_cluster_that_cannot_be_reached_are_named_and_retried() {
    let sandbox = Sandbox::new();
    let closed = [free_port(), free_port()];
    for url in [
        format!(
            "redis+sentinel://127.0.0.1:{},127.0.0.1:{}/svc",
            closed[0], closed[1]
        ),
        format!(
            "redis+cluster://127.0.0.1:{},127.0.0.1:{}",
            closed[0], closed[1]
        ),
    ] {
        let started = Instant::now();
        let out = sandbox
            .leaderrun_on(&url, "gone")
            .args(["--wait", "2s"])
            .sh("touch ran")
            .run();
        // Retried (as for a server that is down) until --wait gives up.
        assert!(
            started.elapsed() >= Duration::from_secs(2),
            "{}",
            out.stderr
        );
        assert_ne!(out.code, 0, "{}", out.stderr);
        assert!(
            out.stderr.contains(&format!("127.0.0.1:{}", closed[0])),
            "{}",
            out.stderr
        );
        assert!(out.stderr.contains("unreachable"), "{}", out.stderr);
        assert!(!sandbox.path("ran").exists());
        let status = common::Run::new(&sandbox.path(""))
            .args(["status", "--backend", &url, "--key", "gone"])
            .run();
        assert_ne!(status.code, 0, "{}", status.stderr);
        assert!(
            status.stderr.contains(&format!("127.0.0.1:{}", closed[0])),
            "{}",
            status.stderr
        );
    }
}

/// A replica promoted without the lease (it never got the last writes):
/// the replica that waited does not take the free lease before one ttl,
/// by when the old leader's command is dead; the token still grows.
#[test]
fn a_promoted_replica_that_missed_the_lease_hands_it_out_only_after_one_ttl() {
    let set = SentinelSet::start();
    let sandbox = Sandbox::new();
    let key = "missed";
    let leader = first_term(&sandbox, &set.url(), key, &PATIENT);
    let follower = sandbox
        .leaderrun_on(&set.url(), key)
        .args(PATIENT)
        .sh(RUNS)
        .spawn();
    std::thread::sleep(Duration::from_secs(1));
    // The replica loses the lease and the counter, as if the primary had
    // died before they reached it.
    let replica = set.replica();
    replica
        .command(None, &["CONFIG", "SET", "replica-read-only", "no"])
        .unwrap();
    replica
        .command(
            None,
            &[
                "DEL",
                &format!("leaderrun:{{{key}}}:lease"),
                &format!("leaderrun:{{{key}}}:counter"),
            ],
        )
        .unwrap();
    let promoted = Instant::now();
    set.failover();
    // The old term ends (its renewal finds no lease); the next one starts
    // one ttl (6 s) after the lease was found free, with a greater token.
    wait_terms(&sandbox, 2, &leader);
    let took = promoted.elapsed();
    assert!(
        took >= Duration::from_secs(5),
        "the next term began {took:?} after the failover"
    );
    let mut log = leader.stderr();
    log.push_str(&follower.stderr());
    assert!(log.contains("replication history"), "{log}");
}

#[test]
fn tls_through_the_sentinels_and_to_every_cluster_node() {
    let sandbox = Sandbox::new();
    let set = SentinelSet::start_with(None, true);
    let cluster = Cluster::start_with(true);
    for (url, ca) in [
        (set.url(), set.ca().unwrap()),
        (cluster.url(), cluster.ca().unwrap()),
    ] {
        assert!(url.starts_with("rediss+"), "{url}");
        // The CA is the test's own: without it, the certificate is unknown.
        let out = sandbox
            .leaderrun_on(&url, "tls")
            .args(["--wait", "2s"])
            .sh("touch ran")
            .run();
        assert_ne!(out.code, 0, "{}", out.stderr);
        assert!(
            out.stderr.to_lowercase().contains("certificate"),
            "{}",
            out.stderr
        );
        assert!(!sandbox.path("ran").exists());
        let out = sandbox
            .leaderrun_on(&url, "tls")
            .arg("--tls-ca-file")
            .arg(&ca)
            .sh("echo $LEADERRUN_TOKEN")
            .run();
        assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
        let status = common::Run::new(&sandbox.path(""))
            .args([
                "status",
                "--backend",
                &url,
                "--key",
                "tls",
                "--json",
                "--tls-ca-file",
            ])
            .arg(&ca)
            .run();
        // Free (exit 3), the counter read through TLS.
        assert_eq!(status.code, 3, "{}", status.stderr);
        assert!(status.stdout.contains("\"counter\":1"), "{}", status.stdout);
    }
}

/// The lease's slot moves to another primary during a term, key by key:
/// the client follows ASK (and waits out TRYAGAIN) while it moves and MOVED
/// after; the term goes on, and the counter moved with it.
#[test]
fn a_term_goes_on_while_its_slot_moves_to_another_primary() {
    let cluster = Cluster::start();
    let sandbox = Sandbox::new();
    let lease = "leaderrun:{moving}:lease";
    let mut leader = first_term(&sandbox, &cluster.url(), "moving", &PATIENT);
    let from = cluster.primary_of(lease).port;
    let to = *cluster.primaries().iter().find(|p| **p != from).unwrap();
    // 700 ms between keys: renewals (every 500 ms) meet the slot half moved.
    cluster.migrate_slot(lease, to, Duration::from_millis(700));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(tokens(&sandbox), [1], "{}", leader.stderr());
    assert!(alive(sandbox.wait_pid("pids")), "{}", leader.stderr());
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
    let out = sandbox
        .leaderrun_on(&cluster.url(), "moving")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "2"), "{}", out.stderr);
}
