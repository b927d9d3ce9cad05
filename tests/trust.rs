//! What a new user and a hostile input trip over: each test pins one trap
//! that once silently made two leaders, skipped a run, leaked a secret,
//! panicked, or said the wrong thing. Named after the trap.

mod common;

use std::io::Read as _;
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use common::redis_server::{RedisServer, free_port};
use common::{BIN, Sandbox, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(20);

/// Runs leaderrun with `args` (and `env`) and a command that must not run.
fn refused_with(sandbox: &Sandbox, env: &[(&str, &str)], args: &[&str]) -> common::Finished {
    let mut run = common::Run::new(&sandbox.path(""));
    for (name, value) in env {
        run.env(name, value);
    }
    let out = run.args(args).sh("touch ran").run();
    assert!(!sandbox.path("ran").exists(), "{args:?}: the command ran");
    out
}

// 1. A relative state directory gave each working directory a lease of
// its own: every replica led.
#[test]
fn a_relative_state_directory_is_refused_by_run_and_by_status() {
    let sandbox = Sandbox::new();
    let out = refused_with(&sandbox, &[], &["--backend", "file:state", "--key", "k"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("relative"), "{}", out.stderr);
    assert!(
        out.stderr.contains("file:///"),
        "the absolute form: {}",
        out.stderr
    );
    assert!(!sandbox.path("state").exists());
    let status = Command::new(BIN)
        .args(["status", "--backend", "file:state", "--key", "k"])
        .current_dir(sandbox.path(""))
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(2), "status agrees");
}

// 3. A Redis younger than a ttl held --no-wait off, and cron's `|| [ $? -eq
// 75 ]` skipped the run while status said the lease was free.
#[test]
fn no_wait_waits_out_a_hold_off_once_and_then_runs() {
    let server = RedisServer::start();
    let sandbox = Sandbox::new();
    let started = Instant::now();
    let out = sandbox
        .leaderrun_on(server.url(), "fresh")
        .arg("--no-wait")
        .sh("echo ran")
        .run();
    assert_eq!((out.code, out.stdout.trim()), (0, "ran"), "{}", out.stderr);
    assert!(out.stderr.contains("lease held off"), "{}", out.stderr);
    // At most about a ttl (2 s here), whole seconds rounded up.
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

// 4. A lease gone before its known expiry (FLUSHALL, DEL, eviction) was
// taken at once while its holder's child ran on.
#[test]
fn a_lease_that_vanishes_before_its_expiry_is_waited_out_not_taken() {
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    let sandbox = Sandbox::new();
    let job = "echo \"start $(date +%s%N)\" >> events; \
               trap 'echo \"end $(date +%s%N)\" >> events; exit 0' TERM; \
               while :; do sleep 0.01; done";
    let replica = || {
        sandbox
            .leaderrun_on(server.url(), "vanish")
            .args(["--renew-every", "1s", "--ttl", "3s"])
            .sh(job)
            .spawn()
    };
    let _a = replica();
    assert!(wait_until(LONG, || sandbox.lines("events").len() == 1));
    let _b = replica();
    std::thread::sleep(Duration::from_millis(500)); // b has seen a's lease
    server.command(None, &["FLUSHALL"]).unwrap();
    // Whichever replica leads next, its child starts after the first ended.
    assert!(wait_until(LONG, || sandbox
        .lines("events")
        .iter()
        .filter(|l| l.starts_with("start"))
        .count()
        == 2));
    let events = sandbox.lines("events");
    let kinds: Vec<&str> = events
        .iter()
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert_eq!(
        kinds[..3],
        ["start", "end", "start"],
        "the children overlapped: {events:?}"
    );
}

#[test]
fn a_redis_that_can_evict_the_lease_is_warned_about_at_startup() {
    let server =
        RedisServer::start_with(&["--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru"]);
    server.wait_uptime(None, 2);
    let sandbox = Sandbox::new();
    let out = sandbox.leaderrun_on(server.url(), "evict").sh("true").run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("maxmemory-policy volatile-lru"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("noeviction"), "{}", out.stderr);
}

// 5. A term that ended by its deadline while the backend was paused left
// its record; the next term found it and reused its token.
fn a_new_term_after_a_deadline_draws_a_greater_token(
    sandbox: &Sandbox,
    backend: &str,
    pause: impl FnOnce(),
    resume: impl FnOnce(),
) {
    let mut leader = common::Run::new(&sandbox.path(""));
    leader
        .args(["--backend", backend, "--key", "reuse"])
        .args(["--ttl", "10s", "--renew-every", "1s", "--yield-grace", "1s"])
        .args([
            "--release-timeout",
            "1s",
            "--margin",
            "5s",
            "--campaign-every",
            "100ms",
        ])
        .sh("echo $LEADERRUN_TOKEN >> tokens; trap 'exit 0' TERM; while :; do sleep 0.01; done");
    let mut leader = leader.spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 1));
    std::thread::sleep(Duration::from_millis(500));
    pause();
    // Paused past the deadline (yield at 3 s, kill at 5 s) and the release.
    std::thread::sleep(Duration::from_millis(4500));
    resume();
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "{}",
        leader.stderr()
    );
    leader.signal(Signal::SIGTERM);
    assert!(leader.wait(LONG).is_some());
    let tokens = sandbox.lines("tokens");
    let (first, second): (u64, u64) = (tokens[0].parse().unwrap(), tokens[1].parse().unwrap());
    assert!(second > first, "tokens {tokens:?}: {}", leader.stderr());
}

#[test]
fn a_new_term_after_a_deadline_draws_a_greater_token_on_redis() {
    let server = RedisServer::start();
    server.wait_uptime(None, 10);
    a_new_term_after_a_deadline_draws_a_greater_token(
        &Sandbox::new(),
        server.url(),
        || server.pause(),
        || server.resume(),
    );
}

#[test]
fn a_new_term_after_a_deadline_draws_a_greater_token_on_the_file_backend() {
    let sandbox = Sandbox::new();
    let blocker = std::cell::RefCell::new(None);
    a_new_term_after_a_deadline_draws_a_greater_token(
        &sandbox,
        &sandbox.backend(),
        || *blocker.borrow_mut() = Some(sandbox.hold_the_mutex()),
        || {
            let mut held = blocker.borrow_mut().take().unwrap();
            held.kill().unwrap();
            held.wait().unwrap();
        },
    );
}

// 6. A ttl of 2^64 ns or more wrapped the file backend's stored expiry; 8.
// absurd durations panicked, some after the command ran.
#[test]
fn absurd_durations_are_refused_naming_the_value_and_the_bound() {
    let sandbox = Sandbox::new();
    let b = sandbox.backend();
    for (flag, value) in [
        ("--ttl", "18446744075s 209551616ns"),
        ("--ttl", "300000000000y"),
        ("--ttl", "18446744073709551615s"),
        ("--hold-for", "300000000000y"),
        ("--wait", "300000000000y"),
        ("--renew-every", "300000000000y"),
        ("--campaign-every", "300000000000y"),
        ("--yield-grace", "300000000000y"),
    ] {
        let out = refused_with(&sandbox, &[], &["--backend", &b, "--key", "k", flag, value]);
        assert_eq!(out.code, 2, "{flag} {value}: {}", out.stderr);
        assert!(out.stderr.contains(flag), "{flag}: {}", out.stderr);
        assert!(out.stderr.contains("1year"), "{flag}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }
}

// 7. A password with an unencoded `/` went into the error message.
#[test]
fn a_password_never_reaches_an_error_whatever_breaks_the_url() {
    let sandbox = Sandbox::new();
    for url in [
        "redis://app:c2VjcmV0/cGFzcw==@host:6379/0",
        "redis://app:hunter2/x@h",
        "rediss://:hunter2",
        "redis://:hunter2@host:6399?x=1",
    ] {
        let by_flag = refused_with(&sandbox, &[], &["--backend", url, "--key", "k"]);
        let by_env = refused_with(&sandbox, &[("LEADERRUN_BACKEND", url)], &["--key", "k"]);
        for out in [by_flag, by_env] {
            assert_eq!(out.code, 2, "{url}: {}", out.stderr);
            for secret in ["c2VjcmV0", "cGFzcw", "hunter2"] {
                assert!(!out.stderr.contains(secret), "{url}: {}", out.stderr);
            }
        }
    }
}

// 9. A floor above the largest token is refused with a clear error.
#[test]
fn a_fence_floor_above_the_largest_token_is_refused() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("floor")
        .args(["--fence-floor-cmd", "echo 1152921504606846977"])
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 65, "{}", out.stderr);
    assert!(out.stderr.contains("largest token"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());
}

// 10. A missing ACL permission or a database out of range was "unreachable":
// campaigning forever.
#[test]
fn a_missing_permission_or_database_is_a_configuration_error_at_startup() {
    let server = RedisServer::start_with(&[
        "--user",
        "app",
        "on",
        ">s3cret",
        "~leaderrun:*",
        "+@all",
        "-info",
    ]);
    server.wait_uptime(None, 2);
    let sandbox = Sandbox::new();
    let url = server.url().replacen("://", "://app:s3cret@", 1);
    let out = refused_with(&sandbox, &[], &["--backend", &url, "--key", "acl"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("lacks a permission"), "{}", out.stderr);
    assert!(out.stderr.contains("INFO"), "names it: {}", out.stderr);
    assert!(!out.stderr.contains("s3cret"), "{}", out.stderr);

    let url = format!("{}/99", server.url());
    let out = refused_with(&sandbox, &[], &["--backend", &url, "--key", "db"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("database 99 does not exist"),
        "{}",
        out.stderr
    );
}

// 11. Say what is actually wrong.
#[test]
fn a_query_a_taken_port_or_a_server_that_is_not_redis_is_named() {
    let sandbox = Sandbox::new();
    let out = refused_with(
        &sandbox,
        &[],
        &["--backend", "redis://host:6399?x=1", "--key", "k"],
    );
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("unknown query parameter \"x\""),
        "{}",
        out.stderr
    );

    // An HTTP server, and one that answers garbage.
    for answer in ["HTTP/1.1 400 Bad Request\r\n\r\n", "garbage\r\n"] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = answer.to_owned();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let answer = answer.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 512];
                    let _ = stream.read(&mut buf);
                    let _ = std::io::Write::write_all(&mut stream, answer.as_bytes());
                });
            }
        });
        let url = format!("redis://127.0.0.1:{port}");
        let out = refused_with(&sandbox, &[], &["--backend", &url, "--key", "k"]);
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(
            out.stderr.contains("does not answer as a Redis server"),
            "{}",
            out.stderr
        );
    }
}

// 12. A server that accepts connections but never answers: the waits are
// bounded by what the user asked, and a stop is prompt.
#[test]
fn a_server_that_never_answers_does_not_stretch_the_wait_or_the_stop() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            held.push(stream);
        }
    });
    let url = format!("redis://127.0.0.1:{port}");
    let sandbox = Sandbox::new();
    let default_timing = |extra: &[&str]| {
        let mut run = common::Run::new(&sandbox.path(""));
        run.args(["--backend", &url, "--key", "silent"]).args(extra);
        run
    };
    // One call timeout (2 s by default), not three.
    let started = Instant::now();
    let out = default_timing(&["--no-wait"]).sh("touch ran").run();
    assert_eq!(out.code, 69, "{}", out.stderr);
    assert!(
        started.elapsed() < Duration::from_millis(3500),
        "--no-wait took {:?}",
        started.elapsed()
    );

    let started = Instant::now();
    let out = default_timing(&["--wait", "1s"]).sh("touch ran").run();
    assert_eq!(out.code, 69, "{}", out.stderr);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "--wait 1s took {:?}",
        started.elapsed()
    );

    let mut following = default_timing(&[]).sh("touch ran").spawn();
    std::thread::sleep(Duration::from_millis(2500));
    let stopped = Instant::now();
    following.signal(Signal::SIGTERM);
    assert_eq!(following.wait(LONG), Some(0));
    assert!(
        stopped.elapsed() < Duration::from_secs(1),
        "the stop took {:?}",
        stopped.elapsed()
    );
    assert!(!sandbox.path("ran").exists());
}

// 13. Accepted but meaningless or harmful.
#[test]
fn a_yield_signal_that_tells_nothing_and_a_token_variable_that_harms_are_refused() {
    let sandbox = Sandbox::new();
    let b = sandbox.backend();
    for signal in ["STOP", "CONT", "CHLD", "TSTP"] {
        let out = refused_with(
            &sandbox,
            &[],
            &["--backend", &b, "--key", "k", "--yield-signal", signal],
        );
        assert_eq!(out.code, 2, "{signal}: {}", out.stderr);
        assert!(out.stderr.contains("use TERM"), "{signal}: {}", out.stderr);
    }
    for name in ["PATH", "HOME", "LD_PRELOAD"] {
        let out = refused_with(
            &sandbox,
            &[],
            &["--backend", &b, "--key", "k", "--token-env", name],
        );
        assert_eq!(out.code, 2, "{name}: {}", out.stderr);
        assert!(
            out.stderr.contains("such as FENCE"),
            "{name}: {}",
            out.stderr
        );
    }
}

// 14. A leaderrun inside a leaderrun's command, without --key, took its
// parent's key from LEADERRUN_KEY and waited on itself forever.
#[test]
fn a_nested_leaderrun_does_not_take_its_parents_key() {
    let sandbox = Sandbox::new();
    let nested = format!(
        "{BIN} --backend {} -- true; echo \"inner $?\"",
        sandbox.backend()
    );
    let out = sandbox
        .leaderrun("outer")
        .args(["--wait", "10s"])
        .sh(&nested)
        .run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout.trim(), "inner 2", "{}", out.stderr);
    assert!(
        out.stderr.contains("give this leaderrun its own --key"),
        "{}",
        out.stderr
    );
    // With a key of its own it runs.
    let nested = format!(
        "{BIN} --backend {} --key inner -- echo inner ran",
        sandbox.backend()
    );
    let out = sandbox.leaderrun("outer").sh(&nested).run();
    assert_eq!(
        (out.code, out.stdout.trim()),
        (0, "inner ran"),
        "{}",
        out.stderr
    );
}

// 15. Candidate records of replicas killed with kill -9 piled up: only a
// graceful exit removed expired ones.
#[test]
fn candidate_records_of_killed_replicas_do_not_pile_up() {
    let sandbox = Sandbox::new();
    let fast = [
        "--ttl",
        "1s",
        "--renew-every",
        "200ms",
        "--margin",
        "100ms",
        "--yield-grace",
        "300ms",
        "--release-timeout",
        "200ms",
    ];
    let records = || {
        std::fs::read_dir(sandbox.state_dir())
            .map(|dir| {
                dir.filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .path()
                        .extension()
                        .is_some_and(|x| x == "candidate")
                })
                .count()
            })
            .unwrap_or(0)
    };
    for killed in 1..=20 {
        let mut leader = sandbox.leaderrun("pile").args(fast).sh("sleep 30").spawn();
        assert!(
            wait_until(LONG, || records() >= killed),
            "{}",
            leader.stderr()
        );
        leader.signal(Signal::SIGKILL);
        assert!(leader.wait(LONG).is_some());
    }
    assert!(records() >= 20, "the killed replicas' records are there");
    // A replica that leads on, and never exits gracefully, removes the
    // expired ones as it renews.
    let mut leader = sandbox.leaderrun("pile").args(fast).sh("sleep 30").spawn();
    assert!(
        wait_until(LONG, || records() <= 1),
        "{} records left",
        records()
    );
    leader.signal(Signal::SIGKILL);
    assert!(leader.wait(LONG).is_some());
}

// 17, 18. Forgetting `--`, and one error style for every error.
#[test]
fn every_error_reads_leaderrun_error_and_a_missing_double_dash_gets_a_hint() {
    let out = Command::new(BIN)
        .args(["--key", "demo", "echo", "hi"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr.starts_with("leaderrun: error: "), "{stderr}");
    assert!(
        stderr.contains("leaderrun --key KEY -- COMMAND"),
        "{stderr}"
    );

    let sandbox = Sandbox::new();
    for (args, code) in [
        (vec!["--key", "two words"], 2),
        (vec!["--key", "k", "--ttl", "nope"], 2),
        (vec!["--key", "k", "--", "leaderrun-no-such-command"], 127),
        (vec!["--key", "k", "--", "/etc/passwd"], 126),
    ] {
        let out = common::Run::new(&sandbox.path(""))
            .args(["--backend", &sandbox.backend()])
            .args(&args)
            .run();
        assert_eq!(out.code, code, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr
                .lines()
                .any(|l| l.starts_with("leaderrun: error: ")),
            "{args:?}: {}",
            out.stderr
        );
    }
}

// 19. The help and the man page say what is so.
#[test]
fn the_help_and_the_man_page_say_the_real_defaults_and_the_exit_statuses() {
    let help = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("/var/lib/leaderrun for root"), "{help}");
    assert!(help.contains(".local/state/leaderrun"), "{help}");
    assert!(help.contains("LEADERRUN_LOG"), "{help}");
    let man = Command::new(BIN).arg("man").output().unwrap();
    let man = String::from_utf8_lossy(&man.stdout);
    for section in [
        ".SH \"ENVIRONMENT\"",
        ".SH \"EXIT STATUS\"",
        ".SH \"COMMANDS\"",
    ] {
        assert!(man.contains(section), "{section}");
    }
    assert!(man.contains("LEADERRUN_LOG"));
    assert!(man.contains("65"), "every exit status");
    assert!(
        !man.contains("leaderrun\\-status(1)"),
        "no page that does not exist"
    );
}

// 20. Durations in logs are milliseconds; a stop logs the child's exit;
// terms begun and ended count the same terms.
#[test]
fn logs_round_durations_and_show_the_childs_exit_on_a_stop() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("logs")
        .sh("trap 'exit 3' TERM; touch started; while :; do sleep 0.01; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(3));
    let log = leader.stderr();
    assert!(
        log.contains("child exited") && log.contains("code=3"),
        "{log}"
    );
    let kill_in = log
        .lines()
        .find_map(|l| l.split("kill_in=").nth(1))
        .expect("a kill_in field");
    assert!(
        !kill_in.contains("us") && !kill_in.contains("ns"),
        "{kill_in}"
    );
}

#[test]
fn terms_begun_and_ended_count_the_same_terms_also_after_a_refused_claim() {
    let sandbox = Sandbox::new();
    let port = free_port();
    let mut leader = sandbox
        .leaderrun("count")
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args([
            "--claim-cmd",
            "test -e claim-ok",
            "--campaign-every",
            "200ms",
        ])
        .sh("while [ ! -e stop ]; do sleep 0.01; done")
        .spawn();
    // Two refused claims, then one that holds.
    assert!(wait_until(LONG, || leader
        .stderr()
        .matches("claim refused")
        .count()
        >= 2));
    std::fs::write(sandbox.path("claim-ok"), "").unwrap();
    assert!(wait_until(LONG, || leader
        .stderr()
        .contains("claim accepted")));
    let (_, metrics) = common::get(port, "/metrics");
    let sample = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    let begun = sample("leaderrun_terms_started_total");
    let ended = sample("leaderrun_term_ends_total");
    assert_eq!(begun, ended + 1.0, "one term runs: {metrics}");
    std::fs::write(sandbox.path("stop"), "").unwrap();
    assert_eq!(leader.wait(LONG), Some(0));
}

// 21. A test run that is killed left its supervisors and servers running.
#[test]
fn a_killed_test_run_leaves_nothing_behind() {
    if let Ok(pids) = std::env::var("LEADERRUN_TEST_PIDS") {
        // The run that is killed: a server and a supervisor, as any test has.
        let server = RedisServer::start();
        let sandbox = Sandbox::new();
        let replica = sandbox.leaderrun("killed-run").sh("sleep 60").spawn();
        std::fs::write(pids, format!("{} {}", server.pid(), replica.pid())).unwrap();
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let sandbox = Sandbox::new();
    let pids = sandbox.path("pids");
    let mut run = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_killed_test_run_leaves_nothing_behind",
            "--nocapture",
        ])
        .env("LEADERRUN_TEST_PIDS", &pids)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(LONG, || sandbox.read("pids").contains(' ')));
    let left: Vec<nix::unistd::Pid> = sandbox
        .read("pids")
        .split(' ')
        .map(|p| nix::unistd::Pid::from_raw(p.parse().unwrap()))
        .collect();
    run.kill().unwrap();
    run.wait().unwrap();
    for pid in &left {
        let gone = common::wait_dead(*pid, Duration::from_secs(5));
        common::ensure_dead(*pid);
        assert!(gone.is_some(), "{pid} outlived the killed test run");
    }
}
