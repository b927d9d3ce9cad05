//! The etcd backend against real etcd members on loopback: one for the
//! basics and auth, three for failures of the etcd leader and of quorum.

mod common;

use std::time::{Duration, Instant};

use common::etcd_server::EtcdCluster;
use common::{RUNS, Sandbox, alive, first_term, tokens, wait_until};
use leaderrun::backend::BackendOptions;
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(30);

#[test]
fn a_term_a_handover_and_status_on_one_member() {
    let etcd = EtcdCluster::start(1);
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun_on(&etcd.url(), "basic")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
    // A release wakes the follower: its command starts at once, not at
    // its next attempt (10 s away).
    let (took, token) = sandbox.graceful_handover(&etcd.url(), "handover");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(token, "2");
    let mut leader = first_term(&sandbox, &etcd.url(), "status", &[]);
    let status = common::Run::new(&sandbox.path(""))
        .args([
            "status",
            "--backend",
            &etcd.url(),
            "--key",
            "status",
            "--json",
        ])
        .run();
    assert_eq!(status.code, 0, "{}", status.stderr);
    let json: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(json["token"], 1, "{json}");
    assert_eq!(json["candidates"].as_array().unwrap().len(), 1, "{json}");
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
    let status = common::Run::new(&sandbox.path(""))
        .args(["status", "--backend", &etcd.url(), "--key", "status"])
        .run();
    assert_eq!(
        status.code, 3,
        "free after a graceful stop: {}",
        status.stdout
    );
}

/// The end of a run hands the lease straight to the follower first in line
/// (one transaction writes the next token and the lease key on the
/// follower's etcd lease), then revokes the holder's etcd lease, so none is
/// left to expire. A follower with a fence floor to apply first is never
/// handed a lease: it takes it itself, above its floor.
#[test]
fn a_release_hands_the_lease_to_the_first_in_line_and_revokes_its_own() {
    let etcd = EtcdCluster::start(1);
    let sandbox = Sandbox::new();
    for (round, floor) in [(0, None), (1, Some("100"))] {
        let stop = format!("stop-{round}");
        let mut leader = sandbox
            .leaderrun_on(&etcd.url(), "hand")
            .args(["-v"])
            .sh(&format!(
                "echo $LEADERRUN_TOKEN > a-token-{round}; while [ ! -e {stop} ]; do sleep 0.01; done"
            ))
            .spawn();
        assert!(
            wait_until(LONG, || !sandbox
                .read(&format!("a-token-{round}"))
                .is_empty()),
            "{}",
            leader.stderr()
        );
        let mut follower = sandbox.leaderrun_on(&etcd.url(), "hand");
        follower.args(["--campaign-every", "10s"]);
        if let Some(floor) = floor {
            follower.args(["--fence-floor-cmd", &format!("echo {floor}")]);
        }
        let mut follower = follower
            .sh(&format!("echo $LEADERRUN_TOKEN > b-token-{round}"))
            .spawn();
        assert!(follower.wait_log("campaign started", LONG));
        std::thread::sleep(Duration::from_millis(500));
        std::fs::write(sandbox.path(&stop), "").unwrap();
        assert_eq!(leader.wait(LONG), Some(0), "{}", leader.stderr());
        assert_eq!(follower.wait(LONG), Some(0), "{}", follower.stderr());
        let held: u64 = sandbox
            .read(&format!("a-token-{round}"))
            .trim()
            .parse()
            .unwrap();
        let taken: u64 = sandbox
            .read(&format!("b-token-{round}"))
            .trim()
            .parse()
            .unwrap();
        let handed = leader.stderr().contains("lease handed over");
        match floor {
            None => assert!(
                handed && taken == held + 1,
                "{held} -> {taken}: {}\nfollower: {}",
                leader.stderr(),
                follower.stderr()
            ),
            Some(floor) => assert!(
                !handed && taken == floor.parse::<u64>().unwrap() + 1,
                "{held} -> {taken}: {}",
                leader.stderr()
            ),
        }
        let leases = etcd.etcdctl(&["lease", "list"]);
        assert_eq!(
            String::from_utf8_lossy(&leases.stdout).trim(),
            "found 0 leases",
            "an etcd lease outlived its run"
        );
    }
}

/// A lease handed over is the follower's without a request, and its term
/// counts from the follower's last keep-alive (before the hand-over), not
/// from when it learned of it: the store says so (`acquired_since`), and
/// the server keeps the key at least a ttl from then.
#[test]
fn a_lease_handed_over_lasts_a_ttl_from_the_followers_last_keep_alive() {
    use leaderrun::backend::{Attempt, Identity, LeaseConfig};

    let etcd = EtcdCluster::start(1);
    let backend = leaderrun::backend::parse(Some(&etcd.url()), &BackendOptions::default()).unwrap();
    // A follower takes a lease handed to it without a request if it kept
    // its etcd lease alive within half a ttl: 3 s here, ample on a busy
    // machine for what happens between its grant and the hand-over.
    let ttl = Duration::from_secs(6);
    let store = |owner: &str| {
        backend
            .lease(LeaseConfig {
                key: "handed".into(),
                me: Identity::new(owner),
                ttl,
                call_timeout: Duration::from_secs(2),
                hand_over: true,
            })
            .unwrap()
    };
    let requests = || {
        common::get(etcd.members[0].client_port, "/metrics")
            .1
            .lines()
            .filter(|l| l.starts_with("grpc_server_started_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let (a, b, c) = (store("a"), store("b"), store("c"));
            a.check().await.unwrap();
            b.check().await.unwrap();
            let Ok(Attempt::Acquired { token }) = a.acquire(1).await else {
                panic!("a did not acquire");
            };
            assert!(matches!(b.acquire(1).await, Ok(Attempt::Held(_))));
            let waiting = common::waiting_in_line(&b).await;
            // Time passes since b's last keep-alive (its grant, at check).
            tokio::time::sleep(ttl / 8).await;
            let released = Instant::now();
            assert!(a.release_last(token).await.unwrap());
            waiting.await.unwrap();
            let before = requests();
            let handed = b.acquire(2).await;
            let asked = requests() - before;
            let Ok(Attempt::Acquired { token: handed }) = handed else {
                panic!("b was not handed the lease: {handed:?}");
            };
            assert_eq!(
                (handed, asked),
                (token + 1, 0.0),
                "handed without a request"
            );
            let since = b
                .acquired_since()
                .expect("b says when its lease was kept alive");
            assert!(since < released, "counted from before the hand-over");
            tokio::time::sleep_until(tokio::time::Instant::from_std(since + ttl.mul_f64(0.75)))
                .await;
            match c.acquire(1).await {
                Ok(Attempt::Held(holder)) => assert_eq!(holder.token, handed),
                other => panic!("b's lease lapsed before a ttl from its keep-alive: {other:?}"),
            }
        });
}

#[test]
fn users_and_passwords_are_etcds_and_never_leak() {
    let etcd = EtcdCluster::start(1);
    for args in [
        &["user", "add", "root:r00t-pw"][..],
        &["user", "grant-role", "root", "root"],
        &["user", "add", "app:app-s3cret"],
        &["role", "add", "leaderrun"],
        &[
            "role",
            "grant-permission",
            "leaderrun",
            "--prefix=true",
            "readwrite",
            "leaderrun/",
        ],
        &["user", "grant-role", "app", "leaderrun"],
        &["auth", "enable"],
    ] {
        let out = etcd.etcdctl(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let sandbox = Sandbox::new();
    let url = etcd.url().replace("etcd://", "etcd://app:app-s3cret@");
    let out = sandbox
        .leaderrun_on(&url, "auth")
        .sh("env > env.txt; echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
    assert!(!sandbox.read("env.txt").contains("app-s3cret"));
    for wrong in ["etcd://app:nope@", "etcd://"] {
        let url = etcd.url().replace("etcd://", wrong);
        let out = sandbox.leaderrun_on(&url, "auth").sh("touch ran").run();
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(!out.stderr.contains("nope"), "{}", out.stderr);
        assert!(!sandbox.path("ran").exists());
    }
}

/// Three members: the etcd leader killed (SIGKILL) and stopped (SIGSTOP)
/// during a term; two members keep quorum, the term goes on, and tokens
/// keep growing after.
#[test]
fn a_term_survives_the_etcd_leader_killed_or_stopped() {
    let mut etcd = EtcdCluster::start(3);
    let sandbox = Sandbox::new();
    // A renewal budget of 3.5 s: an election (250 ms timeout here) fits in
    // it on a busy machine too.
    let patient = ["--ttl", "6s", "--renew-every", "500ms"];
    let mut leader = first_term(&sandbox, &etcd.url(), "survive", &patient);
    let first = etcd.leader();
    etcd.members[first].stop();
    std::thread::sleep(Duration::from_secs(3));
    etcd.members[first].start();
    etcd.wait_healthy();
    let second = etcd.leader();
    etcd.members[second].pause();
    std::thread::sleep(Duration::from_secs(3));
    etcd.members[second].resume();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(tokens(&sandbox), [1], "{}", leader.stderr());
    assert!(alive(sandbox.wait_pid("pids")), "{}", leader.stderr());
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
    let out = sandbox
        .leaderrun_on(&etcd.url(), "survive")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "2"), "{}", out.stderr);
}

/// Quorum lost (two of three members stopped): the leader's command is told
/// and gone before its deadline; nobody else leads meanwhile.
#[test]
fn a_lost_quorum_stops_the_command_before_the_lease_could_lapse() {
    let mut etcd = EtcdCluster::start(3);
    let sandbox = Sandbox::new();
    let leader = first_term(&sandbox, &etcd.url(), "quorum", &[]);
    let follower = sandbox.leaderrun_on(&etcd.url(), "quorum").sh(RUNS).spawn();
    std::thread::sleep(Duration::from_millis(500));
    let pid = sandbox.wait_pid("pids");
    let lost = Instant::now();
    etcd.members[1].stop();
    etcd.members[2].stop();
    // The FAST ttl is 2 s: the command is dead by then.
    assert!(
        wait_until(Duration::from_secs(2), || !alive(pid)),
        "{}",
        leader.stderr()
    );
    assert!(lost.elapsed() < Duration::from_secs(2));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(tokens(&sandbox), [1], "nobody led without quorum");
    etcd.members[1].start();
    etcd.members[2].start();
    etcd.wait_healthy();
    assert!(
        wait_until(LONG, || tokens(&sandbox).len() == 2),
        "{}\n{}",
        leader.stderr(),
        follower.stderr()
    );
    let tokens = tokens(&sandbox);
    assert!(tokens[1] > tokens[0], "{tokens:?}");
}

/// 100 followers of one key, each with its own watch: a release wakes
/// exactly one of them, not all.
#[test]
fn a_hundred_followers_do_not_stampede() {
    let etcd = EtcdCluster::start(1);
    let backend = leaderrun::backend::parse(Some(&etcd.url()), &BackendOptions::default()).unwrap();
    // Every follower has its place and its watch.
    let woken = common::wakes_of_a_hundred_followers(&*backend, |followers| {
        followers.iter().all(|f| f.wakes_on_release())
    });
    assert_eq!(woken, 1, "followers woken");
}

/// The whole cluster stopped and started again on its data: tokens go on
/// from where they were.
#[test]
fn a_whole_cluster_restart_never_sends_tokens_back() {
    let mut etcd = EtcdCluster::start(3);
    let sandbox = Sandbox::new();
    let token = |sandbox: &Sandbox| {
        let out = sandbox
            .leaderrun_on(&etcd.url(), "restart")
            .sh("echo $LEADERRUN_TOKEN")
            .run();
        assert_eq!(out.code, 0, "{}", out.stderr);
        out.stdout.trim().parse::<u64>().unwrap()
    };
    assert_eq!(token(&sandbox), 1);
    assert_eq!(token(&sandbox), 2);
    for member in &mut etcd.members {
        member.stop();
    }
    for member in &mut etcd.members {
        member.start();
    }
    etcd.wait_healthy();
    let out = sandbox
        .leaderrun_on(&etcd.url(), "restart")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "3"), "{}", out.stderr);
}

/// The holder cut off from every member by a proxy that black-holes its
/// traffic: its command is told and gone before the other replica's starts.
#[test]
fn a_holder_cut_off_from_the_cluster_stops_before_anyone_else_leads() {
    let etcd = EtcdCluster::start(3);
    let proxies: Vec<common::proxy::Proxy> = etcd
        .members
        .iter()
        .map(|m| common::proxy::Proxy::start(m.client_port))
        .collect();
    let through: Vec<String> = proxies
        .iter()
        .map(|p| format!("127.0.0.1:{}", p.port))
        .collect();
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun_on(&format!("etcd://{}", through.join(",")), "cut")
        .sh("echo $$ > a-pid.tmp; mv a-pid.tmp a-pid; trap 'exit 0' TERM; while :; do sleep 0.02; done")
        .spawn();
    assert!(
        wait_until(LONG, || sandbox.path("a-pid").exists()),
        "{}",
        leader.stderr()
    );
    // The new leader's command looks whether the old one still runs.
    let follower = sandbox
        .leaderrun_on(&etcd.url(), "cut")
        .sh("if kill -0 $(cat a-pid) 2>/dev/null; then touch overlap; fi; touch b-started; sleep 300")
        .spawn();
    std::thread::sleep(Duration::from_millis(500));
    for proxy in &proxies {
        proxy.black_hole(true);
    }
    assert!(
        wait_until(LONG, || sandbox.path("b-started").exists()),
        "{}\n{}",
        leader.stderr(),
        follower.stderr()
    );
    assert!(
        !sandbox.path("overlap").exists(),
        "the old command still ran:\n{}\n{}",
        leader.stderr(),
        follower.stderr()
    );
}

/// etcds://: the server's certificate checked against --tls-ca-file, and a
/// client certificate shown where the server asks for one.
#[test]
fn tls_with_a_private_ca_and_a_client_certificate() {
    let (etcd, certs) = EtcdCluster::start_tls(true);
    let sandbox = Sandbox::new();
    let path = |name: &str| certs.join(name).display().to_string();
    let tries: [(&[&str], bool); 3] = [
        // The certificate is signed by a CA the public roots do not hold.
        (&[], false),
        // Trusted, but without the client certificate etcd asks for.
        (&["--tls-ca-file", &path("ca.pem")], false),
        (
            &[
                "--tls-ca-file",
                &path("ca.pem"),
                "--tls-cert-file",
                &path("server.pem"),
                "--tls-key-file",
                &path("server.key"),
            ],
            true,
        ),
    ];
    for (args, works) in tries {
        let out = sandbox
            .leaderrun_on(&etcd.url(), "tls")
            .args(args)
            .args(["--wait", "2s"])
            .sh("echo $LEADERRUN_TOKEN")
            .run();
        if works {
            assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
        } else {
            assert_ne!(out.code, 0, "{args:?}: {}", out.stderr);
            assert!(out.stdout.is_empty());
        }
    }
    // A client certificate is for etcds:// only.
    let out = sandbox
        .leaderrun_on("redis://127.0.0.1:1", "tls")
        .args([
            "--tls-cert-file",
            &path("server.pem"),
            "--tls-key-file",
            &path("server.key"),
        ])
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("etcds://"), "{}", out.stderr);
    let _ = std::fs::remove_dir_all(&certs);
}
