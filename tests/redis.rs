//! The Redis backend against real `redis-server` processes that the tests
//! start on free ports, and stop, pause, restart and flush.

mod common;

use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::redis_server::{RedisServer, free_port};
use common::{Sandbox, alive, ensure_dead, wait_dead, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(20);

/// A server that has been up long enough (2 s, the test ttl) for leaderrun
/// to acquire from it.
fn ready_server() -> RedisServer {
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    server
}

#[test]
fn tokens_grow_across_terms() {
    let server = ready_server();
    let sandbox = Sandbox::new();
    for expected in 1..=3 {
        let out = sandbox
            .leaderrun_on(server.url(), "grow")
            .sh("echo $LEADERRUN_TOKEN")
            .run();
        assert_eq!(
            (out.code, out.stdout.trim()),
            (0, expected.to_string().as_str()),
            "{}",
            out.stderr
        );
    }
}

#[test]
fn tokens_keep_growing_across_a_redis_restart_while_replicas_live() {
    let mut server = ready_server();
    let sandbox = Sandbox::new();
    for _ in 0..3 {
        assert_eq!(
            sandbox
                .leaderrun_on(server.url(), "restart")
                .sh("true")
                .run()
                .code,
            0
        );
    }
    let job = "echo $LEADERRUN_TOKEN >> tokens; trap 'exit 0' TERM; while :; do sleep 0.02; done";
    let _a = sandbox
        .leaderrun_on(server.url(), "restart")
        .sh(job)
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 1));
    let _b = sandbox
        .leaderrun_on(server.url(), "restart")
        .sh(job)
        .spawn();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sandbox.lines("tokens"), ["4"]);

    // Without persistence the restarted server has no lease and no counter.
    server.restart();
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "no new term"
    );
    let tokens: Vec<u64> = sandbox
        .lines("tokens")
        .iter()
        .map(|t| t.parse().unwrap())
        .collect();
    assert!(
        tokens[1] > tokens[0],
        "token went from {} to {} across the restart",
        tokens[0],
        tokens[1]
    );
}

#[test]
fn a_restarted_redis_is_not_acquired_from_for_one_ttl() {
    let sandbox = Sandbox::new();
    let server = RedisServer::start();
    let started = Instant::now();
    let mut replica = sandbox
        .leaderrun_on(server.url(), "holdoff")
        .sh("echo $LEADERRUN_TOKEN > token")
        .spawn();
    assert_eq!(replica.wait(LONG), Some(0), "{}", replica.stderr());
    let took = started.elapsed();
    // uptime_in_seconds must reach the 2 s ttl.
    assert!(
        took >= Duration::from_millis(1800),
        "acquired {took:?} after the server started"
    );
    assert!(
        replica.stderr().contains("lease held off"),
        "{}",
        replica.stderr()
    );
    assert_eq!(sandbox.read("token").trim(), "1");
}

#[test]
fn a_redis_whose_run_id_changed_is_held_off_for_one_ttl() {
    // Two servers, both up longer than the ttl. Switching from one to the
    // other, which never saw the lease, is a failover to a replica that
    // missed the last writes: the data is older than what the leader was
    // told, though the new server did not restart.
    let (a, b) = (ready_server(), ready_server());
    let proxy = Proxy::start(a.port);
    let url = format!("redis://127.0.0.1:{}", proxy.port);
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun_on(&url, "failover")
        .sh("trap 'exit 0' TERM; echo $LEADERRUN_TOKEN >> tokens; while :; do sleep 0.02; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 1));
    proxy.retarget(b.port);
    proxy.drop_connections();
    let switched = Instant::now();
    // The next renewal, on b, finds no lease: the term is lost. b's run id
    // is not the one leaderrun knew, so it waits one ttl before acquiring.
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "{}",
        leader.stderr()
    );
    let took = switched.elapsed();
    assert!(
        took >= Duration::from_millis(1800),
        "acquired on the new server {took:?} after the switch"
    );
    assert!(
        leader.stderr().contains("new run id"),
        "{}",
        leader.stderr()
    );
    // And the token still grew, though b's counter started from nothing.
    assert_eq!(sandbox.lines("tokens"), ["1", "2"]);
    leader.signal(Signal::SIGTERM);
    leader.wait(LONG);
}

#[test]
fn an_acquire_that_timed_out_but_ran_later_is_not_lost() {
    // While Redis is paused, a follower's acquire times out in leaderrun but
    // stays queued on the server, which runs it on resuming: the lease is
    // then held by the follower's instance before the follower knows. Its
    // next attempt must return that same token at once, not find the lease
    // "held by someone" and wait out the ttl for a new one.
    let server = ready_server();
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun_on(server.url(), "queued")
        .sh("touch a-started; sleep 300")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("a-started").exists()));
    let mut follower = sandbox
        .leaderrun_on(server.url(), "queued")
        .sh("echo $LEADERRUN_TOKEN > b-token")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_millis(300));
    server.pause();
    leader.signal(Signal::SIGKILL);
    // Longer than the ttl: the dead leader's lease lapses while paused.
    std::thread::sleep(Duration::from_millis(3000));
    let resumed = Instant::now();
    server.resume();
    assert!(
        wait_until(LONG, || !sandbox.read("b-token").is_empty()),
        "{}",
        follower.stderr()
    );
    let took = resumed.elapsed();
    assert_eq!(sandbox.read("b-token").trim(), "2", "{}", follower.stderr());
    assert!(
        took < Duration::from_millis(1500),
        "led {took:?} after the resume (ttl 2 s)"
    );
    assert_eq!(follower.wait(LONG), Some(0));
}

#[test]
fn a_graceful_stop_hands_over_without_waiting_for_the_next_attempt() {
    let server = ready_server();
    let (gap, token) = Sandbox::new().graceful_handover(server.url(), "handover");
    assert!(
        gap < Duration::from_secs(2),
        "follower took {gap:?} with a 10 s campaign period"
    );
    assert_eq!(token, "2");
}

#[test]
fn a_follower_rejoins_the_line_after_its_connection_is_killed() {
    let server = ready_server();
    let sandbox = Sandbox::new();
    let _leader = sandbox.leader_until_stop(server.url(), "resub");
    let follower = sandbox
        .leaderrun_on(server.url(), "resub")
        .args(["--campaign-every", "10s"])
        .sh("touch b-started")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_millis(500));
    // The follower's place in line is the connection waiting in BLPOP.
    let clients = text(server.command(None, &["CLIENT", "LIST"]).unwrap());
    let waiting: Vec<&str> = clients
        .lines()
        .filter(|line| line.contains("cmd=blpop"))
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
        .collect();
    assert_eq!(waiting.len(), 1, "{clients}");
    server
        .command(None, &["CLIENT", "KILL", "ID", waiting[0]])
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let released = Instant::now();
    std::fs::write(sandbox.path("stop"), "").unwrap();
    assert!(wait_until(LONG, || sandbox.path("b-started").exists()));
    assert!(
        released.elapsed() < Duration::from_secs(3),
        "took {:?}",
        released.elapsed()
    );
}

#[test]
fn a_follower_wakes_at_a_dead_holders_expiry() {
    let server = ready_server();
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun_on(server.url(), "expiry")
        .sh("touch a-started; sleep 300")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("a-started").exists()));
    let follower = sandbox
        .leaderrun_on(server.url(), "expiry")
        .args(["--campaign-every", "30s"])
        .sh("touch b-started")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    leader.signal(Signal::SIGKILL);
    // The lease lapses in Redis at most ttl (2 s) after the last renewal;
    // the follower knows when and does not wait for its 30 s period.
    assert!(wait_until(LONG, || sandbox.path("b-started").exists()));
    let took = killed.elapsed();
    assert!(
        took < Duration::from_millis(3500),
        "took over after {took:?}"
    );
}

#[test]
fn deleting_the_lease_key_ends_the_term_at_once_and_a_greater_token_follows() {
    let server = ready_server();
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun_on(server.url(), "deleted")
        .sh("trap 'date +%s%N > yielded; exit 0' TERM; echo $LEADERRUN_TOKEN >> tokens; while :; do sleep 0.02; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 1));
    let deleted = Instant::now();
    server
        .command(None, &["DEL", "leaderrun:{deleted}:lease"])
        .unwrap();
    assert!(wait_until(LONG, || sandbox.path("yielded").exists()));
    // The next renewal (every 400 ms) finds the lease gone.
    assert!(
        deleted.elapsed() < Duration::from_millis(1500),
        "yielded {:?} after",
        deleted.elapsed()
    );
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "{}",
        leader.stderr()
    );
    assert_eq!(sandbox.lines("tokens"), ["1", "2"]);
    assert!(
        leader.stderr().contains("reason=lost"),
        "{}",
        leader.stderr()
    );
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn a_paused_redis_ends_the_term_before_the_deadline_and_leaderrun_leads_again() {
    let server = ready_server();
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun_on(server.url(), "paused")
        .sh("trap 'date +%s%N > yielded' TERM; echo $$ > child.pid; echo $LEADERRUN_TOKEN >> tokens; while :; do sleep 0.02; done")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    let paused = Instant::now();
    server.pause();
    // The last renewal was sent at most 400 ms before the pause: the yield
    // comes at most 1 s after it (D − yield_grace) and the kill at most
    // 1.8 s after it (E − margin), however long Redis stays silent.
    assert!(wait_until(LONG, || sandbox.path("yielded").exists()));
    let yielded = paused.elapsed();
    let died = wait_dead(child, LONG).map(|_| paused.elapsed());
    ensure_dead(child);
    assert!(
        yielded <= Duration::from_millis(1300),
        "yield {yielded:?} after the pause"
    );
    let died = died.expect("the child outlived its term");
    assert!(
        died <= Duration::from_millis(2100),
        "child died {died:?} after the pause"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(leader.running(), "leaderrun must survive a paused backend");
    server.resume();
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "{}",
        leader.stderr()
    );
    assert_eq!(sandbox.lines("tokens"), ["1", "2"]);
    assert!(alive(sandbox.wait_pid("child.pid")));
    leader.signal(Signal::SIGTERM);
    leader.wait(LONG);
}

#[test]
fn acl_users_and_passwords_authenticate_and_a_wrong_one_is_a_clear_error() {
    let (server, url) = acl_server(&["~*", "&*", "+@all"]);
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun_on(&url, "acl")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);

    let wrong = server.url().replacen("://", "://app:not-it@", 1);
    let out = sandbox.leaderrun_on(&wrong, "acl").sh("touch ran").run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("refused the credentials"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("not-it"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());

    let requirepass = RedisServer::start_with(&["--requirepass", "hunter2"]);
    requirepass.wait_uptime(Some(":hunter2"), 2);
    let url = requirepass.url().replacen("://", "://:hunter2@", 1);
    let out = sandbox
        .leaderrun_on(&url, "pass")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
}

#[test]
fn the_password_never_reaches_logs_or_the_child() {
    let server = RedisServer::start_with(&["--requirepass", "hunter2"]);
    server.wait_uptime(Some(":hunter2"), 2);
    let sandbox = Sandbox::new();
    let url = server.url().replacen("://", "://:hunter2@", 1);
    let out = sandbox
        .leaderrun_on(&url, "secret")
        .arg("-vv")
        .sh("env")
        .run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        !out.stdout.contains("hunter2"),
        "the child saw the password:\n{}",
        out.stdout
    );
    assert!(
        !out.stderr.contains("hunter2"),
        "the log shows the password:\n{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("redis://:***@127.0.0.1"),
        "{}",
        out.stderr
    );

    // Through the environment, and when the server cannot be reached.
    let closed = format!("redis://:hunter2@127.0.0.1:{}", free_port());
    let out = common::Run::new(&sandbox.path(""))
        .env("LEADERRUN_BACKEND", &closed)
        .args(["--key", "secret", "--no-wait", "-vv"])
        .sh("env")
        .run();
    assert_eq!(out.code, 69, "{}", out.stderr);
    assert!(!out.stderr.contains("hunter2"), "{}", out.stderr);
}

#[test]
fn tls_with_a_private_ca() {
    let (server, ca) = RedisServer::start_tls();
    let sandbox = Sandbox::new();
    // Wait out the hold-off through leaderrun itself (the harness has no TLS).
    let out = sandbox
        .leaderrun_on(server.url(), "tls")
        .args(["--tls-ca-file", ca.to_str().unwrap()])
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);

    // Without the CA the certificate is not trusted: the server cannot be asked.
    let out = sandbox
        .leaderrun_on(server.url(), "tls")
        .arg("--no-wait")
        .sh("true")
        .run();
    assert_eq!(out.code, 69, "{}", out.stderr);
}

#[test]
fn unix_socket() {
    let server = RedisServer::start_unix();
    server.wait_uptime(None, 2);
    let sandbox = Sandbox::new();
    let url = format!("{}?db=3", server.url());
    let out = sandbox
        .leaderrun_on(&url, "unix")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
    let status = std::process::Command::new(common::BIN)
        .args(["status", "--backend", &url, "--key", "unix", "--json"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["counter"], 1, "{json}");
}

#[test]
fn no_wait_against_a_closed_port_gives_up_with_69() {
    let sandbox = Sandbox::new();
    let url = format!("redis://127.0.0.1:{}", free_port());
    let out = sandbox
        .leaderrun_on(&url, "closed")
        .arg("--no-wait")
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 69, "{}", out.stderr);
    assert!(out.stderr.contains("backend unreachable"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());
}

#[test]
fn no_wait_on_a_held_lease_gives_up_with_75_and_status_shows_the_holder() {
    let server = ready_server();
    let sandbox = Sandbox::new();
    let _leader = sandbox
        .leaderrun_on(server.url(), "held")
        .args(["--owner", "leader-1"])
        .sh("touch started; sleep 300")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    let out = sandbox
        .leaderrun_on(server.url(), "held")
        .arg("--no-wait")
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 75, "{}", out.stderr);
    let status = std::process::Command::new(common::BIN)
        .args([
            "status",
            "--backend",
            server.url(),
            "--key",
            "held",
            "--json",
        ])
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(0));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        (json["holder"].as_str(), json["token"].as_u64()),
        (Some("leader-1"), Some(1)),
        "{json}"
    );
    let closed = std::process::Command::new(common::BIN)
        .args([
            "status",
            "--backend",
            &format!("redis://127.0.0.1:{}", free_port()),
            "--key",
            "held",
        ])
        .output()
        .unwrap();
    assert_eq!(closed.status.code(), Some(69));
}

/// Followers wait in a line, and a release wakes the one at its head. A
/// follower that comes to lead by other means than a wake (here: the
/// holder was killed, and on Redis its lease lapsed) must leave the line,
/// or its own release would wake nobody: the next follower would wait for
/// a poll. The second leader's claim is refused, so it releases and goes on
/// running (a replica that exits frees its place anyway).
#[test]
fn a_leader_leaves_the_line_so_its_release_wakes_the_next() {
    let server = ready_server();
    for backend in ["file", "redis"] {
        let sandbox = Sandbox::new();
        let url = match backend {
            "file" => sandbox.backend(),
            _ => server.url().to_owned(),
        };
        let spawn = |claim: &str, script: &str| {
            sandbox
                .leaderrun_on(&url, "line")
                // A follower's poll at the lease's expiry comes 5 s after
                // the release at the soonest, its other polls 10 s after.
                .args(["--ttl", "6s", "--renew-every", "1s"])
                .args(["--campaign-every", "10s", "--claim-cmd", claim])
                .sh(script)
                .spawn()
        };
        let first = spawn("true", "touch first; exec sleep 300");
        assert!(
            wait_until(LONG, || sandbox.path("first").exists()),
            "{backend}"
        );
        let second = spawn(
            "touch second; while [ ! -e go ]; do sleep 0.01; done; date +%s%N > released; exit 1",
            "sleep 300",
        );
        assert!(second.wait_log("campaign started", LONG), "{backend}");
        std::thread::sleep(Duration::from_millis(500));
        first.signal(Signal::SIGKILL);
        assert!(
            wait_until(LONG, || sandbox.path("second").exists()),
            "{backend}"
        );
        let mut third = spawn("true", "date +%s%N > started");
        assert!(third.wait_log("campaign started", LONG), "{backend}");
        std::thread::sleep(Duration::from_millis(500));
        std::fs::write(sandbox.path("go"), "").unwrap();
        assert_eq!(third.wait(LONG), Some(0), "{backend}: {}", third.stderr());
        second.signal(Signal::SIGTERM);
        let released: u128 = sandbox.read("released").trim().parse().unwrap();
        let started: u128 = sandbox.read("started").trim().parse().unwrap();
        let gap = Duration::from_nanos(started.saturating_sub(released) as u64);
        assert!(
            gap < Duration::from_secs(1),
            "{backend}: the third took {gap:?} after the second's release"
        );
    }
}

/// An ACL user that may not BLPOP has no place in line: followers fall back
/// to polling, and the line task backs off instead of spinning.
#[test]
fn a_user_without_blpop_polls_and_does_not_spin() {
    let (server, url) = acl_server(&["~*", "&*", "+@all", "-blpop"]);
    let sandbox = Sandbox::new();
    let _leader = sandbox.leader_until_stop(&url, "acl");
    let mut follower = sandbox
        .leaderrun_on(&url, "acl")
        .sh("touch b-started")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_secs(3));
    let stats = text(server.command(None, &["INFO", "commandstats"]).unwrap());
    let refused: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_blpop:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
        .map_or(0, |n| n.parse().unwrap());
    // Asked, refused, and backing off to 2 s: a handful in 3 s, not
    // thousands.
    assert!(
        (1..=10).contains(&refused),
        "{refused} BLPOPs refused in 3 s\n{stats}"
    );
    std::fs::write(sandbox.path("stop"), "").unwrap();
    assert_eq!(follower.wait(LONG), Some(0), "{}", follower.stderr());
    assert!(sandbox.path("b-started").exists());
}

/// A server's text answer (CLIENT LIST, INFO).
fn text(value: redis::Value) -> String {
    match value {
        redis::Value::BulkString(bytes) => String::from_utf8(bytes).unwrap(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("expected text, got {other:?}"),
    }
}

/// A server with an ACL user `app` (password `s3cret`, with these `rules`),
/// up long enough to acquire from, and its URL as `app`.
fn acl_server(rules: &[&str]) -> (RedisServer, String) {
    let mut args = vec!["--user", "app", "on", ">s3cret"];
    args.extend(rules);
    let server = RedisServer::start_with(&args);
    server.wait_uptime(Some("app:s3cret"), 2);
    let url = server.url().replacen("://", "://app:s3cret@", 1);
    (server, url)
}

/// The rules of the README's least-privilege ACL line.
fn readme_acl_rules() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let line = readme
        .lines()
        .find_map(|l| l.strip_prefix("    ACL SETUSER leaderrun on >PASSWORD "))
        .expect("the README's ACL line");
    line.split(' ').map(str::to_owned).collect()
}

/// The README's least-privilege ACL, word for word: a leader, a follower
/// woken from the line, status and the candidates' withdrawal all work
/// with it, and Redis logs no denied command.
#[test]
fn the_readme_least_privilege_acl_is_enough() {
    let rules = readme_acl_rules();
    let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
    let (server, url) = acl_server(&rules);
    let sandbox = Sandbox::new();
    let leader = sandbox.leader_until_stop(&url, "least");
    let mut follower = sandbox
        .leaderrun_on(&url, "least")
        .args(["--campaign-every", "10s"])
        .sh("echo $LEADERRUN_TOKEN > b-token")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_millis(500));
    let status = std::process::Command::new(common::BIN)
        .args(["status", "--backend", &url, "--key", "least"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&status.stdout);
    assert_eq!(status.status.code(), Some(0), "{shown}");
    assert!(shown.contains("candidates: 2"), "{shown}");
    let released = Instant::now();
    std::fs::write(sandbox.path("stop"), "").unwrap();
    assert_eq!(follower.wait(LONG), Some(0), "{}", follower.stderr());
    assert!(
        released.elapsed() < Duration::from_secs(3),
        "{:?}",
        released.elapsed()
    );
    assert_eq!(sandbox.read("b-token").trim(), "2");
    drop(leader);
    let log = server.command(None, &["ACL", "LOG"]).unwrap();
    assert!(
        matches!(&log, redis::Value::Array(entries) if entries.is_empty()),
        "denied: {log:?}"
    );
}

/// The supervisor alone dies (kill -9): its guard, once the term's
/// processes are dead, releases the lease with the term's token, so the
/// follower does not wait out the lease's remaining 3-5 s.
#[test]
fn the_guard_hands_the_lease_over_when_only_the_supervisor_dies() {
    let server = RedisServer::start();
    server.wait_uptime(None, 5);
    let sandbox = Sandbox::new();
    let took = common::takeover_after_the_supervisor_dies(
        &sandbox,
        server.url(),
        &["--ttl", "5s", "--renew-every", "1s"],
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
}

/// The stores of three replicas of one key that take a lease a release
/// hands over (as the supervisor's are), with a ttl of `ttl`.
fn handover_stores(
    server: &RedisServer,
    key: &str,
    ttl: Duration,
) -> [std::sync::Arc<dyn leaderrun::backend::LeaseStore>; 3] {
    handover_stores_at(server.url(), key, ttl)
}

/// `handover_stores`, on the server at `url`.
fn handover_stores_at(
    url: &str,
    key: &str,
    ttl: Duration,
) -> [std::sync::Arc<dyn leaderrun::backend::LeaseStore>; 3] {
    use leaderrun::backend::{BackendOptions, Identity, LeaseConfig};
    let backend = leaderrun::backend::parse(Some(url), &BackendOptions::default()).unwrap();
    ["a", "b", "c"].map(|owner| {
        backend
            .lease(LeaseConfig {
                key: key.into(),
                me: Identity::new(owner),
                ttl,
                call_timeout: Duration::from_secs(2),
                hand_over: true,
            })
            .unwrap()
    })
}

/// Every command the server ran, but those the test itself sends to count.
fn commands_run(server: &RedisServer) -> u64 {
    text(server.command(None, &["INFO", "commandstats"]).unwrap())
        .lines()
        .filter(|l| !l.starts_with("cmdstat_info:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

/// `a` holds the lease (its token returned), `b` follows and waits in
/// line.
async fn held_and_followed(
    a: &std::sync::Arc<dyn leaderrun::backend::LeaseStore>,
    b: &std::sync::Arc<dyn leaderrun::backend::LeaseStore>,
) -> (u64, tokio::task::JoinHandle<()>) {
    use leaderrun::backend::Attempt;
    let Ok(Attempt::Acquired { token }) = a.acquire(1).await else {
        panic!("a did not acquire");
    };
    assert!(matches!(b.acquire(1).await, Ok(Attempt::Held(_))));
    (token, common::waiting_in_line(b).await)
}

/// A follower sends its acquisition behind its `BLPOP`, so Redis runs it
/// the moment the release's wake is served: the lease is the follower's
/// without a request after the release, and its term counts from when that
/// attempt was sent (before the release), not from when the follower
/// learned of it: the store says so (`acquired_since`), and the server keeps
/// the lease at least a ttl from then.
#[test]
fn a_release_hands_the_lease_to_the_follower_without_a_request_after_it() {
    use leaderrun::backend::Attempt;

    let server = ready_server();
    let ttl = Duration::from_secs(2);
    let [a, b, c] = handover_stores(&server, "behind", ttl);
    block_on(async {
        let (token, waiting) = held_and_followed(&a, &b).await;
        tokio::time::sleep(ttl / 8).await;
        let released = Instant::now();
        assert!(a.release_last(token).await.unwrap());
        waiting.await.unwrap();
        let before = commands_run(&server);
        let handed = b.acquire(1).await;
        let asked = commands_run(&server) - before;
        let Ok(Attempt::Acquired { token: handed }) = handed else {
            panic!("b was not handed the lease: {handed:?}");
        };
        assert_eq!((handed, asked), (token + 1, 0), "handed without a request");
        let since = b
            .acquired_since()
            .expect("b says when its acquisition was sent");
        assert!(since < released, "counted from before the release");
        tokio::time::sleep_until(tokio::time::Instant::from_std(since + ttl.mul_f64(0.75))).await;
        match c.acquire(1).await {
            Ok(Attempt::Held(holder)) => assert_eq!(holder.token, handed),
            other => panic!("b's lease lapsed before a ttl from its attempt: {other:?}"),
        }
    });
}

/// How many times the server ran `command` (`INFO commandstats`; a
/// subcommand as `client|reply`).
fn calls_of(server: &RedisServer, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:calls=");
    text(server.command(None, &["INFO", "commandstats"]).unwrap())
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// `a` holds; `b` takes the lease in line at `a`'s release and leads; `c`
/// waits in line behind it. Returns `b`'s token and `c`'s wait.
async fn handed_to_b_with_c_in_line(
    a: &std::sync::Arc<dyn leaderrun::backend::LeaseStore>,
    b: &std::sync::Arc<dyn leaderrun::backend::LeaseStore>,
    c: &std::sync::Arc<dyn leaderrun::backend::LeaseStore>,
) -> (u64, tokio::task::JoinHandle<()>) {
    use leaderrun::backend::Attempt;
    let (token, b_waiting) = held_and_followed(a, b).await;
    assert!(a.release_last(token).await.unwrap());
    b_waiting.await.unwrap();
    let Ok(Attempt::Acquired { token: handed }) = b.acquire(1).await else {
        panic!("b was not handed the lease");
    };
    // b's term has started: its place in line goes.
    b.leading();
    assert!(matches!(c.acquire(1).await, Ok(Attempt::Held(_))));
    (handed, common::waiting_in_line(c).await)
}

/// A term that began in line releases on the line's connection, idle since,
/// with Redis's reply skipped (nothing for Redis to write back while it
/// serves the next follower), then confirms on the command connection: the
/// release says it released, the next follower in line takes the lease, and
/// the server ran the release twice, once unanswered.
#[test]
fn a_term_begun_in_line_releases_unanswered_then_confirms() {
    use leaderrun::backend::Attempt;

    let server = ready_server();
    let [a, b, c] = handover_stores(&server, "quiet", Duration::from_secs(2));
    block_on(async {
        let (token, c_waiting) = handed_to_b_with_c_in_line(&a, &b, &c).await;
        let skipped = calls_of(&server, "client|reply");
        let ran = calls_of(&server, "evalsha");
        assert!(b.release_last(token).await.unwrap(), "b says it released");
        assert_eq!(
            calls_of(&server, "client|reply") - skipped,
            1,
            "one reply skipped"
        );
        assert!(
            calls_of(&server, "evalsha") - ran >= 2,
            "released, then confirmed"
        );
        c_waiting.await.unwrap();
        assert_eq!(
            c.acquire(1).await.ok(),
            Some(Attempt::Acquired { token: token + 1 })
        );
    });
}

/// The unanswered release can fail unseen (here Redis forgot its scripts,
/// so the `EVALSHA` met `NOSCRIPT`): the confirmation then releases, and the
/// next follower still takes over at once, not at the lease's expiry.
#[test]
fn an_unanswered_release_that_failed_is_made_by_its_confirmation() {
    use leaderrun::backend::Attempt;

    let server = ready_server();
    let ttl = Duration::from_secs(2);
    let [a, b, c] = handover_stores(&server, "confirmed", ttl);
    block_on(async {
        let (token, c_waiting) = handed_to_b_with_c_in_line(&a, &b, &c).await;
        server.command(None, &["SCRIPT", "FLUSH"]).unwrap();
        let released = Instant::now();
        assert!(b.release_last(token).await.unwrap(), "b says it released");
        c_waiting.await.unwrap();
        // c's own attempt in line met NOSCRIPT too: it asks now.
        assert_eq!(
            c.acquire(1).await.ok(),
            Some(Attempt::Acquired { token: token + 1 })
        );
        assert!(released.elapsed() < ttl / 2, "{:?}", released.elapsed());
    });
}

/// A user who may not turn replies off (an ACL from before `client|reply`
/// was in the README's line) gets answered releases: the follower in line
/// still takes over at once, and Redis logs the one denial per line
/// connection (its check, with `INFO server`), none per release.
#[test]
fn a_user_without_client_reply_releases_answered() {
    use leaderrun::backend::Attempt;

    let rules = readme_acl_rules();
    let rules: Vec<&str> = rules
        .iter()
        .map(String::as_str)
        .filter(|r| *r != "+client|reply")
        .collect();
    let (server, url) = acl_server(&rules);
    let [a, b, c] = handover_stores_at(&url, "answered", Duration::from_secs(2));
    block_on(async {
        let (token, c_waiting) = handed_to_b_with_c_in_line(&a, &b, &c).await;
        let released = Instant::now();
        assert!(b.release_last(token).await.unwrap(), "b says it released");
        c_waiting.await.unwrap();
        assert_eq!(
            c.acquire(1).await.ok(),
            Some(Attempt::Acquired { token: token + 1 })
        );
        assert!(
            released.elapsed() < Duration::from_secs(1),
            "{:?}",
            released.elapsed()
        );
    });
    // One entry (Redis counts the same denial in it): b's line and c's.
    let log = server.command(None, &["ACL", "LOG"]).unwrap();
    let redis::Value::Array(entries) = &log else {
        panic!("{log:?}")
    };
    let [redis::Value::Array(entry)] = &entries[..] else {
        panic!("one kind of denial: {log:?}")
    };
    let field = |name: &str| {
        let at = entry.iter().position(|v| format!("{v:?}").contains(name))?;
        entry.get(at + 1).cloned()
    };
    assert_eq!(
        field("object").map(text).as_deref(),
        Some("client|reply"),
        "{log:?}"
    );
    assert_eq!(field("count"), Some(redis::Value::Int(2)), "{log:?}");
}

/// A lease the line's attempt took at a release, which no term took (the
/// replica stopped first), goes with the replica's shutdown notice, and
/// wakes the next follower: nobody waits for it to lapse.
#[test]
fn a_lease_taken_in_line_that_no_term_took_is_given_up_at_exit() {
    use leaderrun::backend::Attempt;

    let server = ready_server();
    let [a, b, c] = handover_stores(&server, "untaken", Duration::from_secs(2));
    block_on(async {
        let (token, b_waiting) = held_and_followed(&a, &b).await;
        assert!(matches!(c.acquire(1).await, Ok(Attempt::Held(_))));
        let c_waiting = common::waiting_in_line(&c).await;
        assert!(a.release_last(token).await.unwrap());
        b_waiting.await.unwrap();
        // b's line holds the lease now; b exits without a term.
        b.withdraw().await.unwrap();
        c_waiting.await.unwrap();
        match c.acquire(1).await {
            Ok(Attempt::Acquired { token: taken }) => assert_eq!(taken, token + 2),
            other => panic!("c did not take the lease b gave up: {other:?}"),
        }
        let observed = c.observe().await.unwrap();
        assert!(
            observed.candidates.iter().all(|r| r.owner != "b"),
            "{observed:?}"
        );
    });
}

/// An acquisition the line made longer ago than half a ttl is not taken as
/// it is: the term would begin with little of its ttl left. The attempt is
/// made again, as the same attempt (the same token), with a fresh ttl.
#[test]
fn a_lease_taken_in_line_long_ago_is_renewed_by_a_repeated_attempt() {
    use leaderrun::backend::Attempt;

    let server = ready_server();
    let ttl = Duration::from_secs(2);
    let [a, b, _] = handover_stores(&server, "stale", ttl);
    block_on(async {
        let (token, waiting) = held_and_followed(&a, &b).await;
        assert!(a.release_last(token).await.unwrap());
        waiting.await.unwrap();
        tokio::time::sleep(ttl / 2 + Duration::from_millis(100)).await;
        let before = commands_run(&server);
        let again = b.acquire(1).await;
        assert!(commands_run(&server) > before, "b asked again");
        assert_eq!(again.ok(), Some(Attempt::Acquired { token: token + 1 }));
        assert_eq!(
            b.acquired_since(),
            None,
            "counted from the repeated attempt"
        );
        let left: i64 = match server
            .command(None, &["PTTL", "leaderrun:{stale}:lease"])
            .unwrap()
        {
            redis::Value::Int(ms) => ms,
            other => panic!("{other:?}"),
        };
        assert!(
            left > 1500,
            "the repeated attempt renewed the lease: {left} ms left"
        );
    });
}

/// An attempt sent behind a `BLPOP` runs whenever the wake comes, so it may
/// run for a replica that has left since (its shutdown notice removed its
/// record): it takes nothing, and passes the wake on to the next follower.
/// Here the attempt is sent by hand, first in line, for a replica that
/// never had a record.
#[test]
fn an_attempt_in_line_for_a_replica_that_left_takes_nothing_and_passes_the_wake_on() {
    use leaderrun::backend::Attempt;

    let server = ready_server();
    let [a, b, _] = handover_stores(&server, "ghost", Duration::from_secs(2));
    let script = [
        include_str!("../src/backend/redis/scripts/beat.lua"),
        include_str!("../src/backend/redis/scripts/acquire.lua"),
    ]
    .concat();
    block_on(async {
        let Ok(Attempt::Acquired { token }) = a.acquire(1).await else {
            panic!("a did not acquire");
        };
        let client = redis::Client::open(server.url()).unwrap();
        let mut ghost = client.get_multiplexed_async_connection().await.unwrap();
        let keys = [
            "lease",
            "counter",
            "candidates",
            "released",
            "history",
            "heldoff",
            "line",
        ]
        .map(|name| format!("leaderrun:{{ghost}}:{name}"));
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("BLPOP").arg(&keys[6]).arg(10);
        pipe.cmd("EVAL")
            .arg(&script)
            .arg(keys.len())
            .arg(&keys[..])
            .arg(&[
                "0123456789abcdef",
                "1",
                "ghost",
                "2000",
                "0",
                "",
                "2",
                "1 2 host ghost",
                "",
                "9007199254740991",
                "1",
                "0",
            ]);
        let ghost_turn = tokio::spawn(async move {
            let replies: Vec<redis::Value> = pipe.query_async(&mut ghost).await.unwrap();
            replies
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(matches!(b.acquire(1).await, Ok(Attempt::Held(_))));
        let waiting = common::waiting_in_line(&b).await;
        assert!(a.release_last(token).await.unwrap());
        let replies = ghost_turn.await.unwrap();
        assert!(
            matches!(&replies[0], redis::Value::Array(_)),
            "the ghost took the wake: {replies:?}"
        );
        let declined: (i64, u64, String, i64) =
            redis::from_redis_value(replies[1].clone()).unwrap();
        assert_eq!(declined.0, 7, "the ghost's attempt was declined");
        waiting.await.unwrap();
        assert_eq!(
            b.acquire(1).await.ok(),
            Some(Attempt::Acquired { token: token + 1 }),
            "b took the wake passed on"
        );
        let observed = b.observe().await.unwrap();
        assert!(
            observed.candidates.iter().all(|r| r.owner != "ghost"),
            "{observed:?}"
        );
    });
}
