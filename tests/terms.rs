//! The term timeline on the file backend (SPEC §3, §6): exclusion, handover,
//! stopping, crashes, pauses, and the waiting modes.

mod common;

use std::time::{Duration, Instant};

use common::{Sandbox, alive, ensure_dead, wait_dead, wait_until};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

const LONG: Duration = Duration::from_secs(15);

#[test]
fn replicas_never_overlap_and_hand_over_promptly() {
    let sandbox = Sandbox::new();
    // Each child claims a directory that only one process can create; a
    // second one running at the same time records an overlap.
    let job = "mkdir running 2>/dev/null || echo overlap >> overlaps; \
               echo $LEADERRUN_TOKEN >> tokens; sleep 0.3; rmdir running; \
               date +%s%N >> ends";
    let mut replicas: Vec<_> = (0..3)
        .map(|_| {
            sandbox
                .leaderrun("exclusive")
                .args(["--campaign-every", "5s"])
                .sh(job)
                .spawn()
        })
        .collect();
    for replica in &mut replicas {
        assert_eq!(replica.wait(LONG), Some(0), "{}", replica.stderr());
    }
    assert_eq!(sandbox.read("overlaps"), "", "two children ran at once");
    let tokens = sandbox.lines("tokens");
    assert_eq!(tokens, ["1", "2", "3"], "one term each, tokens in order");
    // Three 0.3 s jobs back to back; with a 5 s campaign period, only
    // release notices can make this fast.
    let ends: Vec<u128> = sandbox
        .lines("ends")
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let span = Duration::from_nanos((ends[2] - ends[0]) as u64);
    assert!(
        span < Duration::from_secs(2),
        "handovers waited for polling: {span:?}"
    );
}

#[test]
fn a_release_wakes_a_waiting_follower_at_once() {
    let sandbox = Sandbox::new();
    let (gap, _) = sandbox.graceful_handover(&sandbox.backend(), "wake");
    assert!(
        gap < Duration::from_secs(2),
        "follower waited {gap:?} with a 10 s campaign period"
    );
}

#[test]
fn a_graceful_stop_yields_then_kills_a_child_that_ignores_it() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("stop")
        .sh("trap 'echo term >> signals' TERM; echo $$ > child.pid; while :; do sleep 0.02; done")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    leader.signal(Signal::SIGTERM);
    assert!(
        wait_until(LONG, || sandbox.read("signals").contains("term")),
        "the child got no yield signal"
    );
    // This child traps TERM and carries on: it dies only at the kill point,
    // yield_grace + release_timeout = 800 ms after the stop.
    let stopped = Instant::now();
    assert!(alive(child));
    let code = leader.wait(LONG).expect("leaderrun exits");
    let took = stopped.elapsed();
    assert_eq!(code, 137, "exit status of a child killed by SIGKILL");
    assert!(!alive(child));
    assert!(
        took >= Duration::from_millis(650),
        "killed after only {took:?}"
    );
    assert!(took < Duration::from_secs(5), "killed after {took:?}");
    let log = leader.stderr();
    assert!(
        log.contains("term ending") && log.contains("reason=stopped"),
        "{log}"
    );
    assert!(
        log.contains("child signalled")
            && log.contains("child killed")
            && log.contains("lease released"),
        "{log}"
    );
}

#[test]
fn a_child_that_obeys_the_yield_signal_passes_its_status_on() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("obey")
        .args(["--yield-signal", "USR1"])
        .sh("trap 'exit 9' USR1; echo $$ > child.pid; while :; do sleep 0.02; done")
        .spawn();
    sandbox.wait_pid("child.pid");
    leader.signal(Signal::SIGINT);
    assert_eq!(leader.wait(LONG), Some(9), "{}", leader.stderr());
}

#[test]
fn a_second_stop_signal_kills_at_once() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("twice")
        .args(["--yield-grace", "5s", "--ttl", "20s"])
        .sh("trap '' TERM; echo $$ > child.pid; while :; do sleep 0.02; done")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    leader.signal(Signal::SIGTERM);
    assert!(leader.wait_log("child signalled", LONG));
    let second = Instant::now();
    leader.signal(Signal::SIGQUIT);
    assert_eq!(leader.wait(LONG), Some(137));
    assert!(
        second.elapsed() < Duration::from_secs(3),
        "took {:?} with a 5 s grace",
        second.elapsed()
    );
    assert!(!alive(child));
}

#[test]
fn stopped_while_following_exits_zero() {
    let sandbox = Sandbox::new();
    let _leader = sandbox
        .leaderrun("follow")
        .sh("touch started; sleep 30")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    let mut follower = sandbox.leaderrun("follow").sh("touch follower-ran").spawn();
    assert!(follower.wait_log("campaign started", LONG));
    follower.signal(Signal::SIGTERM);
    assert_eq!(follower.wait(LONG), Some(0));
    assert!(!sandbox.path("follower-ran").exists());
}

#[test]
fn killing_leaderrun_kills_the_child_and_grandchild_and_frees_the_lease_at_once() {
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun("crash")
        .args(["--ttl", "30s"])
        .sh("sleep 300 & echo $! > grandchild.pid; echo $$ > child.pid; wait")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    let grandchild = sandbox.wait_pid("grandchild.pid");
    let mut follower = sandbox
        .leaderrun("crash")
        .args(["--ttl", "30s", "--campaign-every", "10s"])
        .sh("echo $LEADERRUN_TOKEN > follower-token; date +%s%N > follower-started")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));
    std::thread::sleep(Duration::from_millis(200));

    let killed_at = Instant::now();
    leader.signal(Signal::SIGKILL);
    let child_gone = wait_dead(child, Duration::from_secs(5));
    let grandchild_gone = wait_dead(grandchild, Duration::from_secs(5));
    ensure_dead(child);
    ensure_dead(grandchild);
    assert!(child_gone.is_some(), "the child outlived leaderrun");
    assert!(
        grandchild_gone.is_some(),
        "the grandchild outlived leaderrun"
    );
    // SPEC §4: within 100 ms; a loaded 2-core CI box gets some slack.
    assert!(
        grandchild_gone.unwrap() < Duration::from_secs(1),
        "{grandchild_gone:?}"
    );

    assert_eq!(follower.wait(LONG), Some(0), "{}", follower.stderr());
    let takeover = killed_at.elapsed();
    assert_eq!(sandbox.read("follower-token").trim(), "2");
    // A dead holder frees the lease at once: far below the 30 s ttl and the
    // 10 s campaign period.
    assert!(
        takeover < Duration::from_secs(3),
        "takeover took {takeover:?}"
    );
}

/// `leaderrun --key k -- sh -c 'setsid … & sleep 30'`, then `kill -9` of
/// leaderrun: the grandchild in a session of its own, which ignores
/// SIGTERM, is dead within a second, and so is everything else of the term.
fn kill_9_leaves_nothing_behind(containment: &str) {
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun("setsid-crash")
        .args(["--containment", containment])
        .sh("setsid sh -c 'trap \"\" TERM; echo $$ > escapee.pid; exec sleep 77' & echo $$ > child.pid; sleep 30")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    let escapee = sandbox.wait_pid("escapee.pid");
    assert!(alive(escapee));
    leader.signal(Signal::SIGKILL);
    let escapee_gone = wait_dead(escapee, Duration::from_secs(5));
    let child_gone = wait_dead(child, Duration::from_secs(5));
    ensure_dead(escapee);
    ensure_dead(child);
    assert!(
        child_gone.is_some(),
        "{containment}: the child outlived leaderrun"
    );
    assert!(
        escapee_gone.is_some_and(|d| d < Duration::from_secs(1)),
        "{containment}: the setsid'd grandchild outlived leaderrun ({escapee_gone:?})"
    );
}

#[test]
fn kill_9_of_leaderrun_kills_a_setsid_grandchild_that_ignores_term_with_a_keeper() {
    kill_9_leaves_nothing_behind("keeper");
}

#[test]
fn kill_9_of_leaderrun_kills_a_setsid_grandchild_that_ignores_term_with_cgroups() {
    if !common::cgroups_writable() {
        eprintln!("no writable cgroup2 here: the keeper test covers this machine");
        return;
    }
    kill_9_leaves_nothing_behind("cgroup");
}

/// The cgroup a process is in, as a path under the cgroup2 mount.
fn cgroup_of(pid: Pid) -> std::path::PathBuf {
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let relative = own
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .unwrap();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mount = mountinfo
        .lines()
        .find(|line| {
            line.split(" - ")
                .nth(1)
                .is_some_and(|fs| fs.starts_with("cgroup2 "))
        })
        .and_then(|line| line.split(' ').nth(4))
        .unwrap();
    std::path::Path::new(mount).join(relative.trim_start_matches('/'))
}

/// The guard process of the leaderrun `pid`.
fn guard_of(pid: Pid) -> Pid {
    let found = std::fs::read_dir("/proc").unwrap().find_map(|entry| {
        let stat = std::fs::read_to_string(entry.ok()?.path().join("stat")).ok()?;
        let (head, rest) = stat.rsplit_once(')')?;
        let (own, comm) = head.split_once(" (")?;
        let parent: i32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (comm == "leaderrun-guard" && parent == pid.as_raw()).then(|| own.parse().ok())?
    });
    Pid::from_raw(found.expect("leaderrun runs a guard"))
}

/// `kill -9` of leaderrun and its guard together leaves the term's empty
/// cgroup behind; the next leaderrun in that cgroup removes it, a second
/// after it starts. Not a leftover that still holds a process (nothing is
/// killed), nor the cgroup of a leaderrun that lives.
#[test]
fn the_next_leaderrun_removes_the_empty_cgroup_a_killed_leaderrun_and_guard_left() {
    if !common::cgroups_writable() {
        eprintln!("no writable cgroup2 here: no cgroup is ever left");
        return;
    }
    let sandbox = Sandbox::new();
    let leader = sandbox
        .leaderrun("stale-cgroup")
        .args(["--containment", "cgroup"])
        .sh("echo $$ > child.pid; exec sleep 30")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    let left = cgroup_of(child);
    let parent = left.parent().unwrap().to_owned();
    let guard = guard_of(leader.pid());
    nix::sys::signal::kill(guard, Signal::SIGKILL).unwrap();
    leader.signal(Signal::SIGKILL);
    let child_gone = wait_dead(child, Duration::from_secs(5));
    ensure_dead(child);
    assert!(child_gone.is_some(), "the child outlived leaderrun");
    assert!(wait_dead(guard, Duration::from_secs(5)).is_some());
    assert!(
        left.is_dir(),
        "nobody was left to remove {}",
        left.display()
    );

    // A leftover with a process in it, and the empty cgroup of a live one.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let mut sleeper = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let busy = parent.join(format!("leaderrun-{dead}-u7"));
    let live = parent.join(format!("leaderrun-{}-u1", sleeper.id()));
    std::fs::create_dir(&busy).unwrap();
    std::fs::create_dir(&live).unwrap();
    std::fs::write(busy.join("cgroup.procs"), sleeper.id().to_string()).unwrap();

    let mut next = sandbox
        .leaderrun("stale-cgroup-next")
        .args(["--containment", "cgroup"])
        .sh("sleep 5")
        .spawn();
    let removed = wait_until(Duration::from_secs(4), || !left.exists());
    let busy_kept = busy.is_dir();
    let live_kept = live.is_dir();
    let sleeper_ran = sleeper.try_wait().unwrap().is_none();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let _ = std::fs::remove_dir(&live);
    wait_until(Duration::from_secs(5), || {
        std::fs::remove_dir(&busy).is_ok()
    });
    next.signal(Signal::SIGTERM);
    let _ = next.wait(LONG);
    let _ = std::fs::remove_dir(&left);
    assert!(removed, "{} was left", left.display());
    assert!(busy_kept, "a leftover with a process in it was removed");
    assert!(sleeper_ran, "a process in a leftover was killed");
    assert!(live_kept, "the cgroup of a live leaderrun was removed");
}

#[test]
fn the_guard_hands_the_lease_over_when_only_the_supervisor_dies() {
    let sandbox = Sandbox::new();
    let took = common::takeover_after_the_supervisor_dies(
        &sandbox,
        &sandbox.backend(),
        &["--ttl", "30s", "--renew-every", "2s"],
    );
    // Within milliseconds (the bench measures it); far below the ttl.
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn the_guard_hands_the_lease_over_after_the_keeper_killed_the_term() {
    let sandbox = Sandbox::new();
    let took = common::takeover_after_the_supervisor_dies(
        &sandbox,
        &sandbox.backend(),
        &[
            "--ttl",
            "30s",
            "--renew-every",
            "2s",
            "--containment",
            "keeper",
        ],
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn tokens_keep_growing_after_every_process_is_killed() {
    let sandbox = Sandbox::new();
    for expected in 1..=3 {
        let mut leader = sandbox
            .leaderrun("k9")
            .sh("echo $LEADERRUN_TOKEN > token; sleep 300")
            .spawn();
        assert!(wait_until(LONG, || !sandbox.read("token").is_empty()));
        assert_eq!(sandbox.read("token").trim(), expected.to_string());
        leader.signal(Signal::SIGKILL);
        leader.wait(LONG);
        std::fs::remove_file(sandbox.path("token")).unwrap();
    }
}

#[test]
fn a_paused_supervisor_loses_the_lease_and_kills_its_child_on_waking() {
    let sandbox = Sandbox::new();
    let mut stuck = sandbox
        .leaderrun("pause")
        .sh("echo $$ > a.pid; exec sleep 300")
        .spawn();
    let a_child = sandbox.wait_pid("a.pid");
    let mut follower = sandbox
        .leaderrun("pause")
        .sh("echo $LEADERRUN_TOKEN > b-token; while [ ! -e b-stop ]; do sleep 0.02; done")
        .spawn();
    assert!(follower.wait_log("campaign started", LONG));

    let paused_at = Instant::now();
    stuck.signal(Signal::SIGSTOP);
    // Alive but stuck: the follower takes over once the ttl (2 s) has passed,
    // not before.
    assert!(wait_until(LONG, || !sandbox.read("b-token").is_empty()));
    let took = paused_at.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "took over a live lease after {took:?}"
    );
    assert_eq!(sandbox.read("b-token").trim(), "2");
    assert!(
        alive(a_child),
        "SIGSTOP stops leaderrun only; its child runs on"
    );

    let woke = Instant::now();
    stuck.signal(Signal::SIGCONT);
    let gone = wait_dead(a_child, Duration::from_secs(5));
    ensure_dead(a_child);
    assert!(gone.is_some(), "the stale child survived the wake-up");
    assert!(
        woke.elapsed() < Duration::from_secs(1),
        "killed {:?} after waking",
        woke.elapsed()
    );
    // Back to campaigning, whether the renewal's "lost" or the release's
    // "already lapsed" came first.
    assert!(
        wait_until(LONG, || stuck.stderr().matches("campaign started").count()
            == 2),
        "{}",
        stuck.stderr()
    );
    let log = stuck.stderr();
    assert!(
        log.contains("reason=deadline") && log.contains("child killed"),
        "{log}"
    );
    assert!(
        !log.contains("lease released"),
        "released a lease it no longer held: {log}"
    );

    // The stale replica campaigns again and leads the next term.
    assert!(stuck.running());
    std::fs::remove_file(sandbox.path("a.pid")).unwrap();
    std::fs::write(sandbox.path("b-stop"), "").unwrap();
    assert_eq!(follower.wait(LONG), Some(0));
    let next = sandbox.wait_pid("a.pid");
    assert_ne!(next, a_child, "the command runs again in the next term");
    assert!(stuck.wait_log("token=3", LONG));
}

#[test]
fn forwarded_signals_do_not_end_the_term() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("hup")
        .sh("trap 'echo hup >> got' HUP; trap 'echo usr2 >> got' USR2; echo $$ > child.pid; while [ ! -e stop ]; do sleep 0.02; done; exit 5")
        .spawn();
    let child = sandbox.wait_pid("child.pid");
    leader.signal(Signal::SIGHUP);
    assert!(wait_until(LONG, || sandbox.read("got").contains("hup")));
    leader.signal(Signal::SIGUSR2);
    assert!(wait_until(LONG, || sandbox.read("got").contains("usr2")));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        alive(child) && leader.running(),
        "a forwarded signal ended the term"
    );
    std::fs::write(sandbox.path("stop"), "").unwrap();
    assert_eq!(leader.wait(LONG), Some(5));
}

#[test]
fn a_setsid_grandchild_does_not_outlive_the_term() {
    let sandbox = Sandbox::new();
    // The child starts a process in a new session (outside its group) that
    // ignores the yield signal, then exits.
    let out = sandbox
        .leaderrun("escape")
        .sh(
            "setsid sh -c 'trap \"\" TERM; echo $$ > escapee.pid; while :; do sleep 0.02; done' & \
             while [ ! -s escapee.pid ]; do sleep 0.01; done; exit 4",
        )
        .run();
    let escapee = sandbox.wait_pid("escapee.pid");
    let dead = !alive(escapee);
    ensure_dead(escapee);
    assert_eq!(out.code, 4, "{}", out.stderr);
    assert!(dead, "the setsid'd grandchild outlived the term");
    assert!(out.stderr.contains("child killed"), "{}", out.stderr);
}

#[test]
fn a_double_forked_daemon_is_killed_when_the_term_is_stopped() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("daemon")
        .sh("(setsid sh -c 'echo $$ > daemon.pid; exec sleep 300' &); echo $$ > child.pid; exec sleep 300")
        .spawn();
    let daemon = sandbox.wait_pid("daemon.pid");
    sandbox.wait_pid("child.pid");
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(143));
    let dead = !alive(daemon);
    ensure_dead(daemon);
    assert!(dead, "the daemon survived the term");
}

#[test]
fn no_wait_gives_up_with_75_when_the_lease_is_held() {
    let sandbox = Sandbox::new();
    let _leader = sandbox
        .leaderrun("nowait")
        .sh("touch started; sleep 30")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    let out = sandbox
        .leaderrun("nowait")
        .arg("--no-wait")
        .sh("touch second-ran")
        .run();
    assert_eq!(out.code, 75, "{}", out.stderr);
    assert!(!sandbox.path("second-ran").exists());
}

#[test]
fn wait_gives_up_with_75_after_its_duration() {
    let sandbox = Sandbox::new();
    let _leader = sandbox
        .leaderrun("wait")
        .sh("touch started; sleep 30")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    let start = Instant::now();
    let out = sandbox
        .leaderrun("wait")
        .args(["--wait", "700ms"])
        .sh("touch second-ran")
        .run();
    assert_eq!(out.code, 75, "{}", out.stderr);
    assert!(start.elapsed() >= Duration::from_millis(700));
    assert!(!sandbox.path("second-ran").exists());
}

/// Holds the lease file's mutex byte from another process, the way a
/// replica stopped in the middle of a read-modify-write would: the backend
/// cannot be asked, which is not the same as "held elsewhere".
fn block_the_backend(sandbox: &Sandbox, key: &str) -> std::process::Child {
    let out = sandbox.leaderrun(key).sh("true").run();
    assert_eq!(out.code, 0);
    sandbox.hold_the_mutex()
}

#[test]
fn an_outage_shorter_than_the_renewal_budget_costs_nothing() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("short-outage")
        .sh("trap 'echo yielded >> events' TERM; touch started; while [ ! -e stop ]; do sleep 0.02; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("started").exists()));
    // The budget is 600 ms with the test timing; 300 ms of outage is bridged
    // by a renewal that waits, or by its retry.
    let mut blocker = sandbox.hold_the_mutex();
    std::thread::sleep(Duration::from_millis(300));
    blocker.kill().unwrap();
    blocker.wait().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(sandbox.read("events"), "", "{}", leader.stderr());
    assert!(
        !leader.stderr().contains("term ending"),
        "{}",
        leader.stderr()
    );
    std::fs::write(sandbox.path("stop"), "").unwrap();
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn a_longer_outage_ends_the_term_at_the_deadline_and_leads_again_after() {
    let sandbox = Sandbox::new();
    let mut leader = sandbox
        .leaderrun("long-outage")
        .sh("trap 'date +%s%N > yielded; exit 0' TERM; echo $LEADERRUN_TOKEN >> tokens; while :; do sleep 0.02; done")
        .spawn();
    assert!(wait_until(LONG, || sandbox.lines("tokens").len() == 1));
    let blocked_at = Instant::now();
    let mut blocker = sandbox.hold_the_mutex();
    // The last successful renewal was sent at most 400 ms before the block,
    // and the yield point is 1 s after it (ttl 2s − margin − release − grace).
    assert!(wait_until(LONG, || sandbox.path("yielded").exists()));
    let yielded = blocked_at.elapsed();
    assert!(
        yielded >= Duration::from_millis(500),
        "yielded after {yielded:?}"
    );
    assert!(
        yielded < Duration::from_millis(2500),
        "yielded after {yielded:?}"
    );
    std::thread::sleep(Duration::from_millis(1000));
    blocker.kill().unwrap();
    blocker.wait().unwrap();
    // Once the backend answers again, the next term starts.
    assert!(
        wait_until(LONG, || sandbox.lines("tokens").len() == 2),
        "{}",
        leader.stderr()
    );
    assert_eq!(sandbox.lines("tokens"), ["1", "2"]);
    let log = leader.stderr();
    assert!(log.contains("renewal failed"), "{log}");
    assert!(log.contains("reason=deadline"), "{log}");
    leader.signal(Signal::SIGTERM);
    assert_eq!(leader.wait(LONG), Some(0));
}

#[test]
fn no_wait_gives_up_with_69_when_the_backend_cannot_be_asked() {
    let sandbox = Sandbox::new();
    let mut blocker = block_the_backend(&sandbox, "blocked");
    let out = sandbox
        .leaderrun("blocked")
        .arg("--no-wait")
        .sh("touch ran")
        .run();
    blocker.kill().unwrap();
    blocker.wait().unwrap();
    assert_eq!(out.code, 69, "{}", out.stderr);
    assert!(out.stderr.contains("backend unreachable"), "{}", out.stderr);
    assert!(!sandbox.path("ran").exists());
}

#[test]
fn an_unreachable_backend_is_retried_until_it_answers() {
    let sandbox = Sandbox::new();
    let mut blocker = block_the_backend(&sandbox, "retry");
    let mut replica = sandbox
        .leaderrun("retry")
        .sh("echo $LEADERRUN_TOKEN > token")
        .spawn();
    assert!(replica.wait_log("backend unreachable", LONG));
    blocker.kill().unwrap();
    blocker.wait().unwrap();
    assert_eq!(replica.wait(LONG), Some(0), "{}", replica.stderr());
    assert_eq!(sandbox.read("token").trim(), "2");
    assert!(
        replica.stderr().contains("backend reachable again"),
        "{}",
        replica.stderr()
    );
}

#[test]
fn hold_for_keeps_the_lease_after_a_short_job() {
    let sandbox = Sandbox::new();
    let start = Instant::now();
    let mut early = sandbox
        .leaderrun("cron")
        .args(["--hold-for", "1500ms"])
        .sh("touch ran-1")
        .spawn();
    assert!(wait_until(LONG, || sandbox.path("ran-1").exists()));
    // A replica whose cron fired a little later finds the lease still held.
    let late = sandbox
        .leaderrun("cron")
        .arg("--no-wait")
        .sh("touch ran-2")
        .run();
    assert_eq!(late.code, 75, "{}", late.stderr);
    assert_eq!(early.wait(LONG), Some(0));
    assert!(
        start.elapsed() >= Duration::from_millis(1500),
        "released after {:?}",
        start.elapsed()
    );
    assert!(!sandbox.path("ran-2").exists());
    let after = sandbox
        .leaderrun("cron")
        .arg("--no-wait")
        .sh("touch ran-3")
        .run();
    assert_eq!(after.code, 0, "{}", after.stderr);
}

#[test]
fn a_stop_during_hold_for_releases_at_once() {
    let sandbox = Sandbox::new();
    let mut replica = sandbox
        .leaderrun("hold-stop")
        .args(["--hold-for", "30s"])
        .sh("exit 3")
        .spawn();
    assert!(replica.wait_log("child exited", LONG));
    replica.signal(Signal::SIGTERM);
    assert_eq!(replica.wait(LONG), Some(3));
    assert!(replica.stderr().contains("lease released"));
}
