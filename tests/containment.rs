//! Two terms side by side in one process, through the library: each one's
//! processes are contained on their own, so ending one term kills all of
//! its processes (a `setsid`'d grandchild that ignores SIGTERM included)
//! and none of the other's, and each exit status reaches its own term.
//!
//! One test function, in a file of its own: the host reaps every child of
//! the process, so nothing else in this test binary may have children.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use leaderrun::backend::{BackendOptions, Identity, LeaseConfig};
use leaderrun::error::Exit;
use leaderrun::metrics::Metrics;
use leaderrun::process::{Containment, ContainmentMode, Host, become_subreaper};
use leaderrun::run::serve_signals;
use leaderrun::signals::Signals;
use leaderrun::supervisor::{Health, HostEvent, LeaseSpec, Supervisor, Wait};
use leaderrun::timing::Timing;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::sync::mpsc::unbounded_channel;

const BIN: &str = env!("CARGO_BIN_EXE_leaderrun");

/// Short terms: SIGKILL comes yield_grace + release_timeout = 800 ms
/// after a stop.
const TIMING: Timing = Timing {
    ttl: Duration::from_secs(2),
    renew_every: Duration::from_millis(400),
    campaign_every: Duration::from_millis(100),
    margin: Duration::from_millis(200),
    yield_grace: Duration::from_millis(500),
    release_timeout: Duration::from_millis(300),
};

fn alive(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, Some("Z") | Some("X") | None)
    })
}

fn pid_in(path: &Path) -> Option<Pid> {
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse()
        .ok()
        .map(Pid::from_raw)
}

/// A term whose command leaves a TERM-ignoring grandchild in a session of
/// its own, and writes both pids to `dir`.
fn lease(name: &str, dir: &Path) -> LeaseSpec {
    let script = format!(
        "setsid sh -c 'trap \"\" TERM; echo $$ > {dir}/{name}-grandchild; exec sleep 60' & \
         echo $$ > {dir}/{name}-main; while :; do sleep 0.05; done",
        dir = dir.display()
    );
    LeaseSpec {
        key: name.into(),
        owner: name.into(),
        timing: TIMING,
        token_env: "LEADERRUN_TOKEN".into(),
        yield_signal: Signal::SIGTERM,
        wait: Wait::Forever,
        hold_for: Duration::ZERO,
        fence_floor_cmd: None,
        claim_cmd: None,
        program: "/bin/sh".into(),
        argv: vec!["sh".into(), "-c".into(), script.into()],
        extra_env: Vec::new(),
        hidden_env: Vec::new(),
    }
}

async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn two_terms(mode: ContainmentMode) {
    let dir = tempfile::Builder::new()
        .prefix("leaderrun-containment-")
        .tempdir()
        .unwrap();
    let d = dir.path().to_owned();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let containment = Containment::choose(mode, PathBuf::from(BIN)).unwrap();
        let host = Host::new(containment.clone(), None);
        let signals = Signals::register().unwrap();
        let url = format!("file://{}", d.join("state").display());
        let backend = leaderrun::backend::parse(Some(&url), &BackendOptions::default()).unwrap();
        let supervisor = |name: &str| {
            let store = backend
                .lease(LeaseConfig {
                    key: name.into(),
                    me: Identity::new(name),
                    ttl: TIMING.ttl,
                    call_timeout: TIMING.call_timeout(),
                    hand_over: false,
                })
                .unwrap();
            let (events, receiver) = unbounded_channel();
            let health = Health::new(Metrics::new(name, name, TIMING.longest_sleep()));
            let supervisor =
                Supervisor::new(lease(name, &d), store, host.clone(), receiver, health);
            (supervisor, events)
        };
        let (a, stop_a) = supervisor("a");
        let (b, stop_b) = supervisor("b");
        let a_done = Rc::new(Cell::new(None));
        let b_done = Rc::new(Cell::new(None));
        let run_a = {
            let done = a_done.clone();
            async move { done.set(Some(a.run().await.unwrap())) }
        };
        let run_b = {
            let done = b_done.clone();
            async move { done.set(Some(b.run().await.unwrap())) }
        };
        let script = async {
            let pids = |name: &str| {
                (
                    pid_in(&d.join(format!("{name}-main"))),
                    pid_in(&d.join(format!("{name}-grandchild"))),
                )
            };
            until("both terms to start", || {
                matches!(pids("a"), (Some(_), Some(_))) && matches!(pids("b"), (Some(_), Some(_)))
            })
            .await;
            let (Some(a_main), Some(a_grandchild)) = pids("a") else {
                unreachable!()
            };
            let (Some(b_main), Some(b_grandchild)) = pids("b") else {
                unreachable!()
            };

            // Stop term a only: its command obeys, its grandchild does not
            // and left the group and the session; it is killed all the same.
            stop_a.send(HostEvent::Stop(Signal::SIGTERM)).unwrap();
            until("term a to end", || a_done.get().is_some()).await;
            assert_eq!(a_done.get(), Some(Exit::Child(143)), "a's own status");
            assert!(
                !alive(a_main) && !alive(a_grandchild),
                "{mode:?}: a's processes are gone"
            );
            assert!(
                alive(b_main) && alive(b_grandchild),
                "{mode:?}: b's processes were not touched"
            );
            assert!(b_done.get().is_none(), "b's term goes on");

            stop_b.send(HostEvent::Stop(Signal::SIGTERM)).unwrap();
            until("term b to end", || b_done.get().is_some()).await;
            assert_eq!(b_done.get(), Some(Exit::Child(143)));
            assert!(
                !alive(b_main) && !alive(b_grandchild),
                "{mode:?}: b's processes are gone"
            );
        };
        tokio::select! {
            _ = async { tokio::join!(run_a, run_b, script) } => {}
            never = serve_signals(host.clone(), signals, Vec::new()) => match never {},
        }
        containment.remove();
    });
}

#[test]
fn two_terms_in_one_process_neither_sees_nor_kills_the_others_processes() {
    become_subreaper().unwrap();
    two_terms(ContainmentMode::Keeper);
    // Where this machine lets a process make cgroups (root here).
    if Containment::choose(ContainmentMode::Cgroup, BIN.into()).is_ok_and(|c| {
        c.remove();
        true
    }) {
        two_terms(ContainmentMode::Cgroup);
    }
}
