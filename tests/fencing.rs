//! Fencing end to end (SPEC §5): the claim and fence-floor hooks, the seed's
//! run replayed by `examples/publisher/run.sh` on both backends, and a stale
//! leader whose writes the store refuses.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::redis_server::RedisServer;
use common::{Sandbox, alive, ensure_dead, wait_until};
use nix::sys::signal::Signal;

const LONG: Duration = Duration::from_secs(30);

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/publisher")
        .join(name)
}

/// Runs `examples/publisher/run.sh <backend>` with the test timing, and
/// without leaderrun on PATH: the script finds the checkout's own build.
/// Returns what it printed.
fn seed_run(backend: &str) -> String {
    let out = Command::new(example("run.sh"))
        .arg(backend)
        .envs(common::fast_env())
        .env("LEADERRUN_CAMPAIGN_EVERY", "20ms")
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env_remove("LEADERRUN")
        .env_remove("LEADERRUN_BACKEND")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The number in `line` right after `before`.
fn number_after(text: &str, before: &str) -> u64 {
    let at = text
        .find(before)
        .unwrap_or_else(|| panic!("{before:?} not in:\n{text}"))
        + before.len();
    text[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn check_seed_run(out: &str) {
    // 1. A deploy-style stop hands over to token 2, well within the seed's
    //    half second.
    assert!(out.contains("pod-b took over with token 2"), "{out}");
    assert!(
        number_after(out, "pod-b's first write came ") < 500,
        "{out}"
    );
    // 2. With the floor, the first term after the loss draws 51 at once.
    assert_eq!(number_after(out, "the first term drew token "), 51, "{out}");
    // 3. Without it, the claims are refused until the counter passes 50.
    assert_eq!(
        number_after(out, "refused up to token 50; token "),
        51,
        "{out}"
    );
}

#[test]
fn the_seed_run_on_the_file_backend() {
    check_seed_run(&seed_run("file"));
}

#[test]
fn the_seed_run_on_redis() {
    let out = seed_run("redis");
    assert!(out.contains("== redis backend\n"), "{out}");
    check_seed_run(&out);
}

#[test]
fn a_failing_claim_ends_the_term_without_the_child_and_the_next_term_follows() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("claim")
        .args(["--campaign-every", "50ms", "--claim-cmd"])
        .arg("echo $LEADERRUN_TOKEN >> claims; [ -e refused-once ] || { touch refused-once; exit 1; }")
        .sh("echo $LEADERRUN_TOKEN >> ran")
        .run();
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        sandbox.lines("claims"),
        ["1", "2"],
        "the claim saw each term's token"
    );
    assert_eq!(
        sandbox.lines("ran"),
        ["2"],
        "the command ran only after an accepted claim"
    );
    assert!(
        out.stderr.contains("reason=\"claim refused\" code=1"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("claim accepted"), "{}", out.stderr);
}

#[test]
fn a_claim_that_hangs_is_refused_at_the_yield_point() {
    let sandbox = Sandbox::new();
    let start = Instant::now();
    let out = sandbox
        .leaderrun("hang")
        .args(["--campaign-every", "50ms", "--claim-cmd"])
        .arg("[ -e hung-once ] && exit 0; touch hung-once; echo $$ > claim.pid; exec sleep 300")
        .sh("echo $LEADERRUN_TOKEN > ran")
        .run();
    let claim = sandbox.wait_pid("claim.pid");
    let dead = !alive(claim);
    ensure_dead(claim);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(dead, "the hung claim command survived");
    // The yield point is 1 s into the term with the test timing.
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(sandbox.read("ran").trim(), "2");
    assert!(out.stderr.contains("claim refused"), "{}", out.stderr);
}

#[test]
fn a_claim_refused_under_no_wait_gives_up_with_75() {
    let sandbox = Sandbox::new();
    let out = sandbox
        .leaderrun("claim-once")
        .args(["--no-wait", "--claim-cmd", "exit 1"])
        .sh("touch ran")
        .run();
    assert_eq!(out.code, 75, "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());
}

#[test]
fn a_floor_command_that_prints_garbage_or_fails_starts_nothing_and_says_why() {
    let sandbox = Sandbox::new();
    for (floor, says) in [
        (
            "echo fifty",
            r#"it printed \"fifty\", which is not a non-negative integer"#,
        ),
        (
            "echo 12; exit 3",
            r#"it exited with status 3 and printed \"12\""#,
        ),
    ] {
        let out = sandbox
            .leaderrun("floor")
            .args(["--no-wait", "--fence-floor-cmd", floor])
            .sh("touch ran")
            .run();
        assert_eq!(out.code, 75, "{}", out.stderr);
        assert!(out.stderr.contains(says), "{floor}: {}", out.stderr);
    }
    assert!(!sandbox.path("ran").exists());

    // Waiting replicas keep trying, and start once the floor is readable.
    let mut replica = sandbox
        .leaderrun("floor")
        .args(["--campaign-every", "50ms", "--fence-floor-cmd", "cat floor"])
        .sh("echo $LEADERRUN_TOKEN > ran")
        .spawn();
    assert!(replica.wait_log("fence floor command failed", LONG));
    std::fs::write(sandbox.path("floor"), "41\n").unwrap();
    assert_eq!(replica.wait(LONG), Some(0), "{}", replica.stderr());
    assert_eq!(sandbox.read("ran").trim(), "42");
}

#[test]
fn require_fence_advance_is_met_by_both_backends() {
    let sandbox = Sandbox::new();
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    for backend in [sandbox.backend(), server.url().to_owned()] {
        let out = sandbox
            .leaderrun_on(&backend, "cap")
            .arg("--require-fence-advance")
            .sh("echo ok")
            .run();
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (0, "ok\n"),
            "{backend}: {}",
            out.stderr
        );
    }
}

/// The store's accepted writes, in order: (token, body).
fn published(db: &Path) -> Vec<(u64, String)> {
    let out = Command::new("sqlite3")
        .args(["-batch", "-separator", "|", "-cmd", ".timeout 10000"])
        .arg(db)
        .arg("SELECT token, body FROM published ORDER BY seq")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let (token, body) = l.split_once('|').unwrap();
            (token.parse().unwrap(), body.to_owned())
        })
        .collect()
}

fn stale_leader(backend: &str, sandbox: &Sandbox) {
    let db = sandbox.path("digests.db");
    let init = Command::new(example("store.sh"))
        .arg("init")
        .env("DIGESTS_DB", &db)
        .status()
        .unwrap();
    assert!(init.success());
    let replica = |owner: &str| {
        sandbox
            .leaderrun_on(backend, "stale")
            .args(["--owner", owner, "--claim-cmd"])
            .arg(example("store.sh").display().to_string() + " claim")
            .env("DIGESTS_DB", &db)
            .env("PUBLISH_EVERY", "0.05")
            .command([example("publish.sh")])
            .spawn()
    };
    let stuck = replica("pod-a");
    assert!(
        wait_until(LONG, || published(&db).len() >= 3),
        "pod-a never published"
    );
    let _successor = replica("pod-b");
    // Paused past its lease: pod-a's supervisor cannot stop its publisher,
    // which goes on writing with token 1 every 50 ms.
    stuck.signal(Signal::SIGSTOP);
    assert!(
        wait_until(LONG, || published(&db).iter().any(|(t, _)| *t == 2)),
        "pod-b never published"
    );
    std::thread::sleep(Duration::from_millis(500));
    stuck.signal(Signal::SIGCONT);

    let writes = published(&db);
    let first_of_b = writes.iter().position(|(t, _)| *t == 2).unwrap();
    assert!(
        writes[first_of_b..].iter().all(|(t, _)| *t == 2),
        "a write with token 1 was accepted after token 2 claimed: {writes:?}"
    );
    assert!(
        writes.windows(2).all(|w| w[0].0 <= w[1].0),
        "accepted tokens went down: {writes:?}"
    );
    assert!(
        writes[..first_of_b]
            .iter()
            .all(|(t, body)| *t == 1 && body.starts_with("pod-a #"))
    );
}

#[test]
fn a_stale_leaders_writes_are_refused_once_its_successor_claimed() {
    let sandbox = Sandbox::new();
    stale_leader(&sandbox.backend(), &sandbox);
}

#[test]
fn a_stale_leaders_writes_are_refused_once_its_successor_claimed_on_redis() {
    let server = RedisServer::start();
    server.wait_uptime(None, 2);
    let sandbox = Sandbox::new();
    stale_leader(server.url(), &sandbox);
}
