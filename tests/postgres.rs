//! The PostgreSQL backend against real servers the tests initdb and start
//! on free ports, and pause, stop, restart and cut sessions of.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postgres_server::PostgresServer;
use common::redis_server::free_port;
use common::{Sandbox, alive, ensure_dead, wait_dead, wait_until};
use leaderrun::backend::{Attempt, BackendOptions, Identity, LeaseConfig, LeaseStore};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(20);

/// Timing with a 4 s renewal budget (ttl 6 s, renewals every 500 ms): a
/// restart of the server fits in it.
const PATIENT: [&str; 4] = ["--ttl", "6s", "--renew-every", "500ms"];

/// The sandbox's `tokens` file, as numbers.
fn tokens(sandbox: &Sandbox) -> Vec<u64> {
    sandbox
        .lines("tokens")
        .iter()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// A command that records its token and pid and runs until stopped.
const RUNS: &str = "trap 'date +%s%N > yielded; exit 0' TERM; echo $$ > child.pid; echo $LEADERRUN_TOKEN >> tokens; while :; do sleep 0.02; done";

#[test]
fn tokens_grow_across_terms_and_server_restarts() {
    let mut server = PostgresServer::start();
    let sandbox = Sandbox::new();
    let mut seen = Vec::new();
    for stop in [None, Some(Signal::SIGINT), Some(Signal::SIGQUIT)] {
        if let Some(signal) = stop {
            // A fast shutdown, then an immediate one (a crash: recovery).
            server.stop_with(signal);
            server.run();
        }
        for _ in 0..2 {
            let out = sandbox
                .leaderrun_on(&server.url(), "grow")
                .sh("echo $LEADERRUN_TOKEN")
                .run();
            assert_eq!(out.code, 0, "{}", out.stderr);
            seen.push(out.stdout.trim().parse::<u64>().unwrap());
        }
    }
    assert_eq!(seen, [1, 2, 3, 4, 5, 6]);
}

#[test]
fn a_graceful_stop_wakes_the_follower_by_notify() {
    let server = PostgresServer::start();
    let (gap, token) = Sandbox::new().graceful_handover(&server.url(), "handover");
    assert!(
        gap < Duration::from_secs(2),
        "follower took {gap:?} with a 10 s campaign period"
    );
    assert_eq!(token, "2");
}

/// The backend pid of every session leaderrun has open.
fn sessions(server: &PostgresServer) -> Vec<String> {
    server
        .psql(
            "postgres",
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'leaderrun'",
        )
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_follower_takes_its_place_again_after_its_session_is_terminated() {
    let server = PostgresServer::start();
    let sandbox = Sandbox::new();
    let _leader = sandbox.leader_until_stop(&server.url(), "resub");
    let follower = sandbox
        .leaderrun_on(&server.url(), "resub")
        .args(["--campaign-every", "10s"])
        .sh("touch b-started")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_millis(500));
    let place = server.psql(
        "postgres",
        "SELECT listen_pid FROM leaderrun_candidate WHERE key = 'resub' AND NOT leads",
    );
    assert!(!place.is_empty(), "the follower has no place in line");
    server.psql("postgres", &format!("SELECT pg_terminate_backend({place})"));
    // It notices the drop, makes a new connection and takes a new place.
    assert!(wait_until(LONG, || {
        let now = server.psql(
            "postgres",
            "SELECT listen_pid FROM leaderrun_candidate WHERE key = 'resub' AND NOT leads AND placed_at IS NOT NULL",
        );
        !now.is_empty() && now != place
    }));
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
fn the_holders_session_terminated_or_the_server_restarted_keeps_its_term() {
    let mut server = PostgresServer::start();
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun_on(&server.url(), "keep")
        .args(PATIENT)
        .sh(RUNS)
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    for session in sessions(&server) {
        server.psql(
            "postgres",
            &format!("SELECT pg_terminate_backend({session})"),
        );
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !sessions(&server).is_empty(),
        "no new session:\n{}",
        leader.stderr()
    );
    for signal in [Signal::SIGINT, Signal::SIGQUIT] {
        server.stop_with(signal);
        server.run();
        // Renewals go through again, on a new connection.
        std::thread::sleep(Duration::from_secs(2));
    }
    assert!(alive(child), "the term ended:\n{}", leader.stderr());
    assert_eq!(tokens(&sandbox), [1]);
    assert!(!sandbox.path("yielded").exists(), "{}", leader.stderr());
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn a_server_paused_within_the_budget_keeps_the_term_and_past_it_ends_it() {
    let server = PostgresServer::start();
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun_on(&server.url(), "paused")
        .sh(RUNS)
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    // Shorter than the 600 ms budget of the test timing: nothing happens.
    server.pause();
    std::thread::sleep(Duration::from_millis(300));
    server.resume();
    std::thread::sleep(Duration::from_secs(1));
    assert!(alive(child) && !sandbox.path("yielded").exists());

    let paused = Instant::now();
    server.pause();
    // The last renewal was sent at most 400 ms before the pause: the yield
    // comes at most 1 s after it and the kill at most 1.8 s after it.
    assert!(
        wait_until(LONG, || sandbox.path("yielded").exists()),
        "{}",
        leader.stderr()
    );
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
    assert!(leader.running(), "leaderrun must survive a paused server");
    server.resume();
    assert!(
        wait_until(LONG, || tokens(&sandbox).len() == 2),
        "{}",
        leader.stderr()
    );
    assert_eq!(tokens(&sandbox), [1, 2]);
    leader.signal(Signal::SIGTERM);
    leader.wait(LONG);
}

#[test]
fn a_server_that_is_down_is_waited_for_and_bad_credentials_exit_2() {
    let mut server = PostgresServer::start();
    server.create_user("app", "s3cret", Some("app"));
    let sandbox = Sandbox::new();

    for (url, says) in [
        (
            server.url_for("app", Some("not-it"), "app"),
            "refused the credentials",
        ),
        (
            server.url_for("app", Some("s3cret"), "nowhere"),
            "does not exist",
        ),
        (server.url_for("app", None, "app"), "asks for a password"),
    ] {
        let out = sandbox
            .leaderrun_on(&url, "creds")
            .env_remove("PGPASSWORD")
            .env("PGPASSFILE", sandbox.path("none"))
            .sh("touch ran")
            .run();
        assert_eq!(out.code, 2, "{url}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{url}: {}", out.stderr);
        assert!(!out.stderr.contains("not-it"), "{}", out.stderr);
        assert!(!sandbox.path("ran").exists());
    }

    // Down: campaigning retries until it is up.
    let closed = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let out = sandbox
        .leaderrun_on(&closed, "down")
        .arg("--no-wait")
        .sh("true")
        .run();
    assert_eq!(out.code, 69, "{}", out.stderr);
    server.stop_with(Signal::SIGINT);
    let mut waiting = sandbox
        .leaderrun_on(&server.url(), "down")
        .sh("echo $LEADERRUN_TOKEN > token")
        .spawn();
    std::thread::sleep(Duration::from_secs(2));
    assert!(waiting.running());
    server.run();
    assert_eq!(waiting.wait(LONG), Some(0), "{}", waiting.stderr());
    assert_eq!(sandbox.read("token").trim(), "1");
}

#[test]
fn the_least_privilege_role_of_the_schema_files_is_enough() {
    let server = PostgresServer::start();
    server.create_user("lr_app", "s3cret", None);
    server.psql("postgres", "CREATE DATABASE jobs");
    let sql = |file: &str, vars: &[&str]| {
        let path = format!("{}/sql/{file}", env!("CARGO_MANIFEST_DIR"));
        let mut args: Vec<&str> = Vec::new();
        for var in vars {
            args.extend(["-v", var]);
        }
        args.extend(["-f", &path]);
        let out = server.psql_as("postgres", "jobs", &args);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let sandbox = Sandbox::new();
    let url = format!(
        "{}?schema=lr",
        server.url_for("lr_app", Some("s3cret"), "jobs")
    );

    // Before the tables exist, a role that may not create them is told how.
    let out = sandbox.leaderrun_on(&url, "least").sh("touch ran").run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("psql -v schema=lr -f sql/postgres.sql"),
        "{}",
        out.stderr
    );

    // The DBA makes them, but forgets the grants: each missing one named.
    sql("postgres.sql", &["schema=lr"]);
    let out = sandbox.leaderrun_on(&url, "least").sh("touch ran").run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("lacks USAGE on schema lr"),
        "{}",
        out.stderr
    );
    assert!(!sandbox.path("ran").exists());

    sql("postgres-grant.sql", &["schema=lr", "role=lr_app"]);
    // Running the schema file again changes nothing.
    sql("postgres.sql", &["schema=lr"]);
    let out = sandbox
        .leaderrun_on(&url, "least")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "1"), "{}", out.stderr);
    // A follower, a notice, a handover and status, all under that role.
    let (_, token) = sandbox.graceful_handover(&url, "least-handover");
    assert_eq!(token, "2");
    let out = sandbox
        .leaderrun_on(&url, "least")
        .args(["--fence-floor-cmd", "echo 40"])
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "41"), "{}", out.stderr);
    let status = common::Run::new(&sandbox.path(""))
        .args(["status", "--backend", &url, "--key", "least", "--json"])
        .run();
    // Exit 3: free; the counter is where the fence floor moved it.
    assert_eq!(status.code, 3, "{}", status.stderr);
    assert!(
        status.stdout.contains("\"counter\":41"),
        "{}",
        status.stdout
    );
}

#[test]
fn tls_verify_full_with_the_harness_ca_and_refusals_it_must_make() {
    let server = PostgresServer::start_tls();
    let ca = server.ca_file();
    let sandbox = Sandbox::new();
    let base = format!("postgres://postgres@localhost:{}/postgres", server.port);
    let run = |query: &str| {
        sandbox
            .leaderrun_on(&format!("{base}?{query}"), "tls")
            .sh("echo $LEADERRUN_TOKEN")
            .run()
    };
    let ok = run(&format!("sslmode=verify-full&sslrootcert={}", ca.display()));
    assert_eq!((ok.code, ok.stdout.trim()), (0, "1"), "{}", ok.stderr);
    // The same CA through --tls-ca-file.
    let out = sandbox
        .leaderrun_on(&format!("{base}?sslmode=verify-full"), "tls")
        .args(["--tls-ca-file", ca.to_str().unwrap()])
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "2"), "{}", out.stderr);
    // Without the CA the certificate is not trusted: refused, exit 2.
    let out = run("sslmode=verify-full");
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("certificate"), "{}", out.stderr);
    // A name the certificate does not have: refused by verify-full, taken
    // by verify-ca (the chain only), as libpq does.
    let other = format!(
        "postgres://postgres@db.example:{}/postgres?hostaddr=127.0.0.1&sslrootcert={}",
        server.port,
        ca.display()
    );
    let out = sandbox
        .leaderrun_on(&format!("{other}&sslmode=verify-full"), "tls")
        .sh("true")
        .run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("not valid for name"), "{}", out.stderr);
    let out = sandbox
        .leaderrun_on(&format!("{other}&sslmode=verify-ca"), "tls")
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "3"), "{}", out.stderr);
    // require: encrypted, nothing verified (libpq's meaning).
    let out = run("sslmode=require");
    assert_eq!((out.code, out.stdout.trim()), (0, "4"), "{}", out.stderr);
}

#[test]
fn passwords_from_the_environment_or_a_private_file_never_reach_the_child_or_logs() {
    let server = PostgresServer::start();
    server.create_user("app", "hunter2", Some("app"));
    let sandbox = Sandbox::new();
    let url = server.url_for("app", None, "app");
    let out = sandbox
        .leaderrun_on(&url, "secret")
        .arg("-vv")
        .env("PGPASSWORD", "hunter2")
        .sh("env")
        .run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        !out.stdout.contains("hunter2"),
        "the child saw it:\n{}",
        out.stdout
    );
    assert!(!out.stderr.contains("hunter2"), "logged:\n{}", out.stderr);

    let passfile = sandbox.path("pgpass");
    std::fs::write(
        &passfile,
        format!("# test\n127.0.0.1:{}:app:app:hunter2\n", server.port),
    )
    .unwrap();
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();
    let with_file = |url: &str| {
        sandbox
            .leaderrun_on(url, "secret")
            .env_remove("PGPASSWORD")
            .env("PGPASSFILE", &passfile)
            .sh("echo $LEADERRUN_TOKEN")
            .run()
    };
    let out = with_file(&url);
    assert_eq!((out.code, out.stdout.trim()), (0, "2"), "{}", out.stderr);
    // The URL's passfile= names it too.
    let out = sandbox
        .leaderrun_on(&format!("{url}?passfile={}", passfile.display()), "secret")
        .env_remove("PGPASSWORD")
        .env("HOME", sandbox.path(""))
        .sh("echo $LEADERRUN_TOKEN")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "3"), "{}", out.stderr);
    // Readable by others: ignored, as libpq ignores it, and said so.
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = with_file(&url);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("readable by others"), "{}", out.stderr);
}

#[test]
fn status_shows_the_holder_and_every_replica() {
    let server = PostgresServer::start();
    let sandbox = Sandbox::new();
    let _leader = sandbox.leader_until_stop(&server.url(), "watched");
    let follower = sandbox
        .leaderrun_on(&server.url(), "watched")
        .sh("true")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    let status = common::Run::new(&sandbox.path(""))
        .args([
            "status",
            "--backend",
            &server.url(),
            "--key",
            "watched",
            "--json",
        ])
        .run();
    assert_eq!(status.code, 0, "{}", status.stderr);
    let json: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(json["token"], 1, "{json}");
    assert_eq!(json["candidates"].as_array().unwrap().len(), 2, "{json}");
    std::fs::write(sandbox.path("stop"), "").unwrap();
}

/// The supervisor alone dies (kill -9): its guard releases the lease, so
/// the follower does not wait out the lease's remaining 3-5 s.
#[test]
fn the_guard_hands_the_lease_over_when_only_the_supervisor_dies() {
    let server = PostgresServer::start();
    let sandbox = Sandbox::new();
    let took = common::takeover_after_the_supervisor_dies(
        &sandbox,
        &server.url(),
        &["--ttl", "5s", "--renew-every", "1s"],
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
}

/// 100 followers of one key, each on its own connection: a release wakes
/// exactly one of them, not all.
#[test]
fn a_hundred_followers_do_not_stampede() {
    let server = PostgresServer::start();
    let backend =
        leaderrun::backend::parse(Some(&server.url()), &BackendOptions::default()).unwrap();
    let woken = common::wakes_of_a_hundred_followers(&*backend, |_| {
        server.psql(
            "postgres",
            "SELECT count(*) FROM leaderrun_candidate WHERE placed_at IS NOT NULL",
        ) == "100"
    });
    assert_eq!(woken, 1, "followers woken");
}

/// `examples/postgres/publish.sh`: the fence is checked in the job's own
/// transaction. A leader whose supervisor is paused past its lease still
/// runs its job; the job's late write, with the old token, is refused in
/// the same transaction, after the new leader's write went in.
#[test]
fn the_fence_in_the_jobs_own_transaction_refuses_a_stale_leaders_write() {
    let server = PostgresServer::start();
    let root = env!("CARGO_MANIFEST_DIR");
    let table = server.psql_as(
        "postgres",
        "postgres",
        &["-f", &format!("{root}/examples/postgres/digests.sql")],
    );
    assert!(table.status.success());
    let sandbox = Sandbox::new();
    let url = server.url();
    let publish = format!("{root}/examples/postgres/publish.sh");
    let a = sandbox
        .leaderrun_on(&url, "digest")
        .env("DATABASE_URL", &url)
        .sh(&format!(
            "{publish} first && touch a-wrote; while [ ! -e go ]; do sleep 0.05; done; {publish} late; echo $? > a-late; sleep 300"
        ))
        .spawn();
    assert!(
        wait_until(LONG, || sandbox.path("a-wrote").exists()),
        "{}",
        a.stderr()
    );
    // The supervisor stops; its job runs on, past the lease (ttl 2 s).
    a.signal(Signal::SIGSTOP);
    let b = sandbox
        .leaderrun_on(&url, "digest")
        .env("DATABASE_URL", &url)
        .sh(&format!("{publish} second && touch b-wrote; sleep 300"))
        .spawn();
    assert!(
        wait_until(LONG, || sandbox.path("b-wrote").exists()),
        "{}",
        b.stderr()
    );
    std::fs::write(sandbox.path("go"), "").unwrap();
    assert!(wait_until(LONG, || sandbox.read("a-late").contains('\n')));
    assert_eq!(
        sandbox.read("a-late").trim(),
        "3",
        "the stale write was not refused"
    );
    assert_eq!(
        server.psql(
            "postgres",
            "SELECT token || ':' || body FROM digests ORDER BY written_at"
        ),
        "1:first\n2:second"
    );
    a.signal(Signal::SIGCONT);
}

/// `leaderrun_fence` share-locks the lease row to the end of the job's
/// transaction: a lease that lapses meanwhile is not acquired by anyone
/// until that transaction ends, so its writes never land after a newer
/// term's.
#[test]
fn no_one_acquires_while_a_fenced_transaction_is_open() {
    let server = PostgresServer::start();
    let backend =
        leaderrun::backend::parse(Some(&server.url()), &BackendOptions::default()).unwrap();
    let store = |owner: &str| -> Arc<dyn LeaseStore> {
        backend
            .lease(LeaseConfig {
                key: "locked".into(),
                me: Identity::new(owner),
                ttl: Duration::from_millis(500),
                call_timeout: Duration::from_millis(300),
                hand_over: false,
            })
            .unwrap()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (a, b) = (store("a"), store("b"));
    let token = runtime.block_on(async {
        a.check().await.unwrap();
        match a.acquire(1).await {
            Ok(Attempt::Acquired { token }) => token,
            other => panic!("{other:?}"),
        }
    });
    // The job's transaction: the fence, then 2 s of work.
    let sql =
        format!("BEGIN; SELECT leaderrun_fence('locked', {token}); SELECT pg_sleep(2); COMMIT;");
    let mut psql = server.psql_command("postgres", "postgres");
    psql.args(["-c", &sql]);
    let job = std::thread::spawn(move || {
        let out = psql.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Instant::now()
    });
    let began = Instant::now();
    let acquired = runtime.block_on(async {
        loop {
            if let Ok(Attempt::Acquired { .. }) = b.acquire(1).await {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let committed = job.join().unwrap();
    assert!(
        acquired >= committed - Duration::from_millis(100),
        "acquired {:?} after the start, the job committed {:?} after",
        acquired - began,
        committed - began
    );
    assert!(acquired - began >= Duration::from_millis(1500));
}
