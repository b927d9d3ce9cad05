//! The term timeline (SPEC §3) on tokio's paused clock: the real driver and
//! term machine, the in-memory backend, and scripted processes. Every case
//! runs in milliseconds and asserts the exact instants.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::time::{Instant, sleep, sleep_until};

use super::driver::{self, Outcome, TermInputs};
use super::term::{EndReason, TermSettings};
use super::{Health, HostEvent};
use crate::backend::memory::MemoryBackend;
use crate::backend::{Attempt, Backend, Identity, LeaseConfig, LeaseStore};
use crate::metrics::Metrics;
use crate::process::{ChildEnv, ProcessUnit, Processes, Scope, Spawn, UnitEvent};
use crate::timing::Timing;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// How a scripted program behaves.
#[derive(Debug, Clone, Copy)]
enum Script {
    /// Exits with `code` this long after it started.
    Exits(Duration, u8),
    /// Runs until killed; the yield signal makes it exit this long after,
    /// or not at all (None).
    Runs { on_yield: Option<Duration> },
    /// Exits at once, leaving a process behind that obeys the yield
    /// signal this long after it.
    LeavesBehind { on_yield: Duration },
}

/// What the processes saw, with the instant (ms from the start).
type Log = Rc<RefCell<Vec<(u64, String)>>>;

#[derive(Clone)]
struct Fake {
    start: Instant,
    log: Log,
    scripts: Rc<RefCell<VecDeque<Script>>>,
}

impl Fake {
    fn new(start: Instant, scripts: &[Script]) -> Fake {
        Fake {
            start,
            log: Rc::default(),
            scripts: Rc::new(RefCell::new(scripts.iter().copied().collect())),
        }
    }

    fn note(&self, what: String) {
        let at = (Instant::now() - self.start).as_millis() as u64;
        self.log.borrow_mut().push((at, what));
    }

    fn log(&self) -> Vec<(u64, String)> {
        self.log.borrow().clone()
    }

    fn saw(&self, what: &str) -> Option<u64> {
        self.log()
            .iter()
            .find(|(_, w)| w == what)
            .map(|(at, _)| *at)
    }
}

impl Processes for Fake {
    type Unit = FakeUnit;

    async fn spawn(&self, what: Spawn<'_>) -> io::Result<FakeUnit> {
        let name = what.argv.last().unwrap().to_string_lossy().into_owned();
        self.note(format!("start {name}"));
        let script = self
            .scripts
            .borrow_mut()
            .pop_front()
            .expect("a script for every start");
        let now = Instant::now();
        let (exit_at, code, leftovers) = match script {
            Script::Exits(after, code) => (Some(now + after), code, None),
            Script::Runs { .. } => (None, 0, None),
            Script::LeavesBehind { on_yield } => (Some(now), 0, Some((None, on_yield))),
        };
        Ok(FakeUnit {
            fake: self.clone(),
            script,
            exit_at,
            code,
            exited: false,
            leftovers,
            empty: false,
        })
    }
}

struct FakeUnit {
    fake: Fake,
    script: Script,
    exit_at: Option<Instant>,
    code: u8,
    exited: bool,
    /// A process left behind: when it exits (once told), and how long after
    /// the yield signal it does.
    leftovers: Option<(Option<Instant>, Duration)>,
    empty: bool,
}

impl ProcessUnit for FakeUnit {
    fn pid(&self) -> Pid {
        Pid::from_raw(4242)
    }

    fn took_terminal(&self) -> bool {
        false
    }

    fn signal(&mut self, signal: Signal, scope: Scope) {
        self.fake
            .note(format!("signal {} {scope:?}", signal.as_str()));
        let now = Instant::now();
        if let (
            Script::Runs {
                on_yield: Some(after),
            },
            false,
        ) = (self.script, self.exited)
        {
            if self.exit_at.is_none() {
                self.exit_at = Some(now + after);
                self.code = 128 + signal as u8;
            }
        }
        if let Some((None, after)) = self.leftovers {
            if scope == Scope::All {
                self.leftovers = Some((Some(now + after), after));
            }
        }
    }

    fn kill(&mut self) {
        self.fake.note("kill".into());
        let now = Instant::now();
        if !self.exited {
            self.exit_at = Some(now);
            self.code = 137;
        }
        if let Some((_, after)) = self.leftovers {
            self.leftovers = Some((Some(now), after));
        }
    }

    async fn next(&mut self) -> UnitEvent {
        if !self.exited {
            match self.exit_at {
                Some(at) => sleep_until(at).await,
                None => std::future::pending().await,
            }
            self.exited = true;
            self.fake.note(format!("exited {}", self.code));
            return UnitEvent::Exited(self.code);
        }
        if !self.empty {
            if let Some((until, _)) = self.leftovers {
                match until {
                    Some(at) => sleep_until(at).await,
                    None => std::future::pending().await,
                }
            }
            self.empty = true;
            self.fake.note("empty".into());
            return UnitEvent::Empty;
        }
        std::future::pending().await
    }
}

/// One replica's term on the in-memory backend, with scripted processes.
struct Rig {
    backend: MemoryBackend,
    store: Arc<dyn LeaseStore>,
    fake: Fake,
    settings: TermSettings,
    claim: Option<&'static str>,
    start: Instant,
}

impl Rig {
    fn new(scripts: &[Script]) -> Rig {
        let start = Instant::now();
        let backend = MemoryBackend::new();
        let store = backend
            .lease(LeaseConfig {
                key: "k".into(),
                me: Identity::new("me"),
                ttl: Timing::DEFAULT.ttl,
                call_timeout: Timing::DEFAULT.call_timeout(),
                hand_over: false,
            })
            .unwrap();
        Rig {
            backend,
            store,
            fake: Fake::new(start, scripts),
            settings: TermSettings {
                timing: Timing::DEFAULT,
                yield_signal: Signal::SIGTERM,
                hold_for: Duration::ZERO,
                claim: false,
                run_ends_with_command: true,
            },
            claim: None,
            start,
        }
    }

    fn claim(mut self) -> Rig {
        self.settings.claim = true;
        self.claim = Some("claim");
        self
    }

    /// Acquires, then runs the term beside `script`, which gets the
    /// channel the host's signals come through.
    async fn run<F: Future<Output = ()>>(
        &self,
        script: impl FnOnce(UnboundedSender<HostEvent>) -> F,
    ) -> Outcome {
        let sent_at = Instant::now();
        let Attempt::Acquired { token } = self.store.acquire(1).await.unwrap() else {
            panic!("not acquired")
        };
        let (events, mut receiver) = unbounded_channel();
        let mut health = Health::new(Metrics::new("k", "me", Duration::from_secs(10)));
        let env = ChildEnv {
            token_env: "LEADERRUN_TOKEN".into(),
            token: None,
            key: "k".into(),
            owner: "me".into(),
            extra: Vec::new(),
            hidden: Vec::new(),
            inherited: Default::default(),
        };
        let argv = ["command".into()];
        let term = driver::run(
            TermInputs {
                store: &self.store,
                procs: &self.fake,
                events: &mut receiver,
                health: &mut health,
                settings: self.settings,
                program: "/bin/command".as_ref(),
                argv: &argv,
                claim_cmd: self.claim,
                env: &env,
            },
            token,
            sent_at,
            sent_at,
        );
        // The channel stays open until the term is over: a closed one means
        // the host is gone.
        let _open = events.clone();
        tokio::select! {
            outcome = term => outcome,
            never = async move {
                script(events).await;
                std::future::pending::<std::convert::Infallible>().await
            } => match never {},
        }
    }

    fn at(&self) -> u64 {
        (Instant::now() - self.start).as_millis() as u64
    }

    fn held(&self) -> bool {
        let observer = self.backend.observer("k", Duration::from_secs(1)).unwrap();
        futures_util::FutureExt::now_or_never(observer.observe())
            .unwrap()
            .unwrap()
            .holder
            .is_some()
    }
}

#[tokio::test(start_paused = true)]
async fn a_renewal_outage_yields_at_d_minus_grace_and_kills_at_d_plus_release_timeout() {
    // Defaults: ttl 6s, margin 500ms, release_timeout 500ms, yield_grace 1s:
    // D = 5s, yield at 4s, SIGKILL at 5.5s, half a second before E = 6s.
    let rig = Rig::new(&[Script::Runs { on_yield: None }]);
    let backend = rig.backend.clone();
    let outcome = rig
        .run(|_events| async move {
            sleep(ms(100)).await;
            backend.set_reachable(false);
        })
        .await;
    assert_eq!(
        rig.fake.saw("signal SIGTERM Group"),
        Some(4000),
        "{:?}",
        rig.fake.log()
    );
    assert_eq!(rig.fake.saw("kill"), Some(5500), "{:?}", rig.fake.log());
    assert_eq!(outcome.end.reason, EndReason::Deadline);
    assert_eq!(outcome.end.code, Some(137));
}

#[tokio::test(start_paused = true)]
async fn an_outage_within_the_renewal_budget_costs_nothing() {
    let rig = Rig::new(&[Script::Exits(ms(8000), 0)]);
    let backend = rig.backend.clone();
    let outcome = rig
        .run(|_events| async move {
            sleep(ms(100)).await;
            backend.set_reachable(false);
            // Renewals fail from 2s and are retried every 250 ms; the yield
            // point would be 4s. Back at 3.6s: the retry at 3.75s renews.
            sleep(ms(3500)).await;
            backend.set_reachable(true);
        })
        .await;
    assert_eq!(
        rig.fake.saw("signal SIGTERM Group"),
        None,
        "{:?}",
        rig.fake.log()
    );
    assert_eq!(outcome.end.reason, EndReason::ChildExited);
    assert_eq!(outcome.end.code, Some(0));
    assert_eq!(rig.at(), 8000);
}

#[tokio::test(start_paused = true)]
async fn a_supervisor_paused_past_its_deadlines_kills_first_on_waking() {
    let rig = Rig::new(&[Script::Runs { on_yield: None }]);
    let outcome = rig
        .run(|_events| async move {
            // The driver is not polled while the clock jumps: a SIGSTOP of
            // ten seconds, past the yield point, the kill point and the
            // lease's expiry, with renewals due meanwhile.
            tokio::time::advance(ms(10_000)).await;
        })
        .await;
    let log = rig.fake.log();
    let after_start: Vec<&str> = log.iter().skip(1).map(|(_, w)| w.as_str()).collect();
    assert_eq!(after_start.first(), Some(&"kill"), "{log:?}");
    assert_eq!(rig.fake.saw("kill"), Some(10_000));
    assert_eq!(
        rig.fake.saw("signal SIGTERM Group"),
        None,
        "no yield before the kill"
    );
    assert_eq!(outcome.end.reason, EndReason::Deadline);
}

#[tokio::test(start_paused = true)]
async fn a_refused_claim_ends_the_term_without_the_command_and_releases() {
    let rig = Rig::new(&[Script::Exits(ms(50), 1)]).claim();
    let outcome = rig.run(|_events| async {}).await;
    assert_eq!(rig.fake.saw("start claim"), Some(0));
    assert!(!rig.fake.log().iter().any(|(_, w)| w == "start command"));
    assert_eq!(outcome.end.reason, EndReason::ClaimRefused);
    assert_eq!(outcome.end.code, None);
    assert!(!rig.held(), "released");
}

#[tokio::test(start_paused = true)]
async fn a_claim_that_hangs_is_killed_at_the_yield_point_of_the_term_as_acquired() {
    // Renewals succeed all along, but the claim must settle by 4s.
    let rig = Rig::new(&[Script::Runs { on_yield: None }]).claim();
    let outcome = rig.run(|_events| async {}).await;
    assert_eq!(rig.fake.saw("kill"), Some(4000), "{:?}", rig.fake.log());
    assert_eq!(
        rig.fake.saw("signal SIGTERM Group"),
        None,
        "no grace for a claim"
    );
    assert_eq!(outcome.end.reason, EndReason::ClaimRefused);
    assert!(!rig.held());
}

#[tokio::test(start_paused = true)]
async fn an_accepted_claim_starts_the_command_once_the_claim_is_gone() {
    let rig = Rig::new(&[Script::Exits(ms(30), 0), Script::Exits(ms(100), 7)]).claim();
    let outcome = rig.run(|_events| async {}).await;
    assert_eq!(rig.fake.saw("start command"), Some(30));
    assert_eq!(outcome.end.reason, EndReason::ChildExited);
    assert_eq!(outcome.end.code, Some(7));
}

#[tokio::test(start_paused = true)]
async fn hold_for_keeps_the_lease_after_a_short_job_then_releases() {
    let mut rig = Rig::new(&[Script::Exits(ms(500), 0)]);
    rig.settings.hold_for = ms(3000);
    let outcome = rig.run(|_events| async {}).await;
    assert_eq!(rig.at(), 3000, "released at the end of --hold-for");
    assert_eq!(outcome.end.reason, EndReason::ChildExited);
    assert!(!rig.held());
}

#[tokio::test(start_paused = true)]
async fn a_stop_during_the_claim_kills_it_at_once() {
    let rig = Rig::new(&[Script::Runs {
        on_yield: Some(ms(100)),
    }])
    .claim();
    let outcome = rig
        .run(|events| async move {
            sleep(ms(500)).await;
            events.send(HostEvent::Stop(Signal::SIGTERM)).unwrap();
        })
        .await;
    assert_eq!(rig.fake.saw("kill"), Some(500), "{:?}", rig.fake.log());
    assert_eq!(outcome.end.reason, EndReason::Stopped);
    assert!(outcome.end.stopped);
    assert_eq!(outcome.end.code, None, "the command never ran");
}

#[tokio::test(start_paused = true)]
async fn a_stop_yields_then_kills_after_the_grace_and_a_second_stop_kills_at_once() {
    let rig = Rig::new(&[Script::Runs { on_yield: None }]);
    let outcome = rig
        .run(|events| async move {
            sleep(ms(1000)).await;
            events.send(HostEvent::Stop(Signal::SIGTERM)).unwrap();
        })
        .await;
    assert_eq!(rig.fake.saw("signal SIGTERM Group"), Some(1000));
    // yield_grace + release_timeout later.
    assert_eq!(rig.fake.saw("kill"), Some(2500));
    assert_eq!(outcome.end.code, Some(137));

    let rig = Rig::new(&[Script::Runs { on_yield: None }]);
    rig.run(|events| async move {
        sleep(ms(1000)).await;
        events.send(HostEvent::Stop(Signal::SIGTERM)).unwrap();
        sleep(ms(200)).await;
        events.send(HostEvent::Stop(Signal::SIGINT)).unwrap();
    })
    .await;
    assert_eq!(rig.fake.saw("kill"), Some(1200), "{:?}", rig.fake.log());
}

#[tokio::test(start_paused = true)]
async fn a_lease_lost_while_ending_is_not_released_and_the_kill_stays_on_time() {
    let rig = Rig::new(&[Script::Runs { on_yield: None }]);
    let backend = rig.backend.clone();
    let outcome = rig
        .run(|events| async move {
            sleep(ms(1000)).await;
            events.send(HostEvent::Stop(Signal::SIGTERM)).unwrap();
            // Another replica takes the lease while this term is ending;
            // the next renewal (at 2s) hears of it.
            sleep(ms(500)).await;
            backend.steal("k", "thief");
        })
        .await;
    assert_eq!(rig.fake.saw("kill"), Some(2500), "{:?}", rig.fake.log());
    assert_eq!(outcome.end.reason, EndReason::Stopped);
    assert!(outcome.end.lost);
    assert!(rig.held(), "the thief's lease was not released");
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_yields_at_once_and_kills_within_the_grace() {
    let rig = Rig::new(&[Script::Runs { on_yield: None }]);
    let backend = rig.backend.clone();
    let outcome = rig
        .run(|_events| async move {
            sleep(ms(1500)).await;
            backend.steal("k", "thief");
        })
        .await;
    // Heard at the renewal at 2s: yield then, kill 1.5s later.
    assert_eq!(rig.fake.saw("signal SIGTERM Group"), Some(2000));
    assert_eq!(rig.fake.saw("kill"), Some(3500));
    assert_eq!(outcome.end.reason, EndReason::Lost);
}

#[tokio::test(start_paused = true)]
async fn leftovers_of_a_command_get_the_yield_signal_then_the_term_ends() {
    let rig = Rig::new(&[Script::LeavesBehind { on_yield: ms(300) }]);
    let outcome = rig.run(|_events| async {}).await;
    // The command exits at once; after the leftover grace, what it left is
    // told to stop, and goes 300 ms later.
    assert_eq!(
        rig.fake.saw("signal SIGTERM All"),
        Some(20),
        "{:?}",
        rig.fake.log()
    );
    assert_eq!(rig.fake.saw("empty"), Some(320));
    assert_eq!(outcome.end.reason, EndReason::ChildExited);
    assert_eq!(outcome.end.code, Some(0));
}
