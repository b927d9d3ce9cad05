//! The async shell around a term: one `select!` that turns timers, the
//! host's signals, the unit's exits and the backend's replies into events
//! for the term machine, and carries out the actions it returns.
//!
//! Generic over `Processes`, so the timeline is tested on a paused clock
//! with the in-memory backend and scripted processes (the tests below), and
//! run for real with the host.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use super::HostEvent;
use super::health::Health;
use super::term::{Action, EndReason, Event, Term, TermEnd, TermSettings};
use crate::backend::{LeaseStore, RenewError, StoreError};
use crate::error::CommandError;
use crate::process::{ChildEnv, ProcessUnit, Processes, Spawn, reclaim_terminal, shell};

/// What a term runs, and with what.
pub struct TermInputs<'a, P: Processes> {
    pub store: &'a Arc<dyn LeaseStore>,
    pub procs: &'a P,
    pub events: &'a mut UnboundedReceiver<HostEvent>,
    pub health: &'a mut Health,
    pub settings: TermSettings,
    pub program: &'a Path,
    pub argv: &'a [OsString],
    pub claim_cmd: Option<&'a str>,
    /// The children's environment, without the token (set here).
    pub env: &'a ChildEnv,
}

/// How a term went: its end, and a refusal of the backend's, if any (the
/// replica stops after such a term).
pub struct Outcome {
    pub end: TermEnd,
    pub refused: Option<StoreError>,
}

type Renewal = Pin<Box<dyn Future<Output = (Instant, Result<(), RenewError>)>>>;

/// Runs one term from its acquisition (sent at `sent_at`) to its end.
/// `woke_at` is when the wait that led to the acquisition ended (for the
/// handover figure).
pub async fn run<P: Processes>(
    inputs: TermInputs<'_, P>,
    token: u64,
    sent_at: Instant,
    woke_at: Instant,
) -> Outcome {
    let TermInputs {
        store,
        procs,
        events,
        health,
        settings,
        program,
        argv,
        claim_cmd,
        env,
    } = inputs;
    let env = ChildEnv {
        token: Some(token),
        ..env.clone()
    };
    let metrics = health.metrics_handle();
    metrics.term_began(token);
    procs.term(Some(token));
    let (mut term, first) = Term::begin(token, sent_at, settings);
    let mut pending: VecDeque<Action> = first.into();
    let mut unit: Option<P::Unit> = None;
    let mut renewal: Option<Renewal> = None;
    let mut refused = None;
    loop {
        while let Some(action) = pending.pop_front() {
            match action {
                Action::StartClaim => {
                    let (path, argv) = shell(claim_cmd.unwrap_or_default());
                    let started = procs
                        .spawn(Spawn {
                            program: &path,
                            argv: &argv,
                            env: &env,
                            stdout: None,
                            terminal: false,
                        })
                        .await;
                    match started {
                        Ok(claim) => {
                            store.leading();
                            debug!(token, pid = claim.pid().as_raw(), "claim command started");
                            unit = Some(claim);
                        }
                        Err(error) => {
                            warn!(token, error = %error, "cannot start the claim command");
                            pending.extend(term.on(Event::SpawnFailed(127), Instant::now()));
                        }
                    }
                }
                Action::StartCommand => {
                    // The claim's unit, if any, is empty: let it go.
                    unit = None;
                    let started = procs
                        .spawn(Spawn {
                            program,
                            argv,
                            env: &env,
                            stdout: None,
                            terminal: true,
                        })
                        .await;
                    match started {
                        Ok(command) => {
                            if settings.claim {
                                debug!(token, pid = command.pid().as_raw(), "child started");
                            } else {
                                // Leading now: the place in line goes to
                                // the next follower.
                                store.leading();
                                debug!(token, pid = command.pid().as_raw(), "child started");
                            }
                            metrics.command_started(woke_at.elapsed());
                            unit = Some(command);
                        }
                        Err(error) => {
                            let shown = program.display().to_string();
                            let error = CommandError::from_spawn(&error, &shown);
                            warn!(token, error = %error, "cannot start the command");
                            pending.extend(
                                term.on(Event::SpawnFailed(error.exit_code()), Instant::now()),
                            );
                        }
                    }
                }
                Action::Signal(signal, scope) => {
                    if let Some(unit) = unit.as_mut() {
                        unit.signal(signal, scope);
                    }
                }
                Action::Kill => {
                    if let Some(unit) = unit.as_mut() {
                        unit.kill();
                    }
                }
                Action::Renew => {
                    let store = store.clone();
                    let sent_at = Instant::now();
                    renewal = Some(Box::pin(async move { (sent_at, store.renew(token).await) }));
                }
                Action::Release { last } => {
                    release(store.as_ref(), token, last).await;
                    if last {
                        procs.retire();
                    }
                }
                Action::Finish(end) => {
                    if end.stopped
                        || matches!(end.reason, EndReason::ChildExited | EndReason::Stopped)
                    {
                        // The run is over: the next leader may be starting
                        // its command on this host now, and what is left to
                        // do here must not compete with it.
                        crate::process::lower_priority();
                    }
                    // Released, or lost: nothing for the guard to release.
                    procs.term(None);
                    if unit.as_ref().is_some_and(|u| u.took_terminal()) {
                        reclaim_terminal();
                    }
                    // After the release: telling the guard (when the unit
                    // goes) wakes its process, and the next leader should
                    // not wait for that.
                    drop(unit);
                    metrics.term_ended(end.reason.as_str());
                    return Outcome { end, refused };
                }
            }
        }
        metrics.beat();
        let wake = term.next_wakeup();
        let event = tokio::select! {
            biased;
            () = sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => None,
            event = events.recv() => match event {
                Some(HostEvent::Stop(signal)) => Some(Event::Stop(signal)),
                Some(HostEvent::Forward(signal)) => {
                    debug!(token, signal = signal.as_str(), "signal forwarded");
                    Some(Event::Forward(signal))
                }
                Some(HostEvent::Resign) => Some(Event::Resign),
                // The host is gone: the process is ending.
                None => Some(Event::Stop(nix::sys::signal::Signal::SIGTERM)),
            },
            event = async { unit.as_mut().expect("guarded").next().await }, if unit.is_some() => {
                Some(match event {
                    crate::process::UnitEvent::Exited(code) => Event::Exited(code),
                    crate::process::UnitEvent::Empty => Event::Empty,
                })
            }
            (sent_at, result) = async { renewal.as_mut().expect("guarded").await }, if renewal.is_some() => {
                renewal = None;
                Some(match result {
                    Ok(()) => {
                        health.reachable();
                        Event::Renewed(sent_at)
                    }
                    Err(RenewError::Lost(holder)) => {
                        health.reachable();
                        Event::Lost(holder)
                    }
                    Err(RenewError::Store(StoreError::Unreachable(error))) => {
                        metrics.renewal_failed();
                        health.unreachable(&error);
                        Event::RenewFailed(error.to_string())
                    }
                    Err(RenewError::Store(error)) => {
                        let text = error.to_string();
                        refused = Some(error);
                        Event::Refused(text)
                    }
                })
            }
        };
        let now = Instant::now();
        pending.extend(match event {
            Some(event) => term.on(event, now),
            None => term.tick(now),
        });
    }
}

/// Gives the lease up; a failure only means it lapses at its expiry.
async fn release(store: &dyn LeaseStore, token: u64, last: bool) {
    // Called again before the release (it is idempotent): the place in line
    // must be given up before the release can wake anyone.
    store.leading();
    let released = if last {
        store.release_last(token).await
    } else {
        store.release(token).await
    };
    match released {
        Ok(true) => info!(token, "lease released"),
        Ok(false) => info!(token, "lease already lapsed; nothing to release"),
        Err(error) => {
            warn!(token, error = %error, "release failed; the lease lapses at its expiry")
        }
    }
}
