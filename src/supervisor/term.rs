//! One term as a state machine with no I/O inside (SPEC §3): events and the
//! current instant go in, actions come out. The driver (`driver.rs`) turns
//! timers, signals, process exits and the backend's replies into events, and
//! carries the actions out.
//!
//! Every way of acting on time goes through `tick`, and every event first
//! ticks: a supervisor that was paused past its deadlines acts on them (the
//! kill first) before it looks at anything that happened meanwhile.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::backend::Holder;
use crate::process::Scope;
use crate::timing::{Deadlines, Timing, show};

/// How long after the command exited its unit may take to report that
/// nothing is left, before what is left is treated as leftovers (and told
/// to stop).
pub const LEFTOVER_GRACE: Duration = Duration::from_millis(20);

/// Why a term ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// Renewals failed until the yield point.
    Deadline,
    /// leaderrun received SIGTERM, SIGINT or SIGQUIT.
    Stopped,
    /// The backend answered that this replica no longer holds the lease.
    Lost,
    /// The command exited by itself.
    ChildExited,
    /// The claim command failed or did not finish before the yield point.
    ClaimRefused,
    /// The lease was handed over on purpose: a shard over this replica's
    /// share (shard mode).
    Resigned,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Deadline => "deadline",
            EndReason::Stopped => "stopped",
            EndReason::Lost => "lost",
            EndReason::ChildExited => "child exited",
            EndReason::ClaimRefused => "claim refused",
            EndReason::Resigned => "handed over",
        }
    }
}

/// Where a term is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The claim command runs; `accepted` once it exited 0 (the command
    /// starts when nothing of the claim is left).
    Claiming { accepted: bool },
    /// The command runs.
    Running,
    /// The command exited at `since`; whether it left anything behind is
    /// not known yet.
    Exited { since: Instant },
    /// The term is ending: the yield signal went out (unless `killed` came
    /// first); SIGKILL at `kill_at` if anything is left.
    Ending {
        reason: EndReason,
        kill_at: Instant,
        killed: bool,
    },
    /// The command is done and nothing of it is left; the lease is kept
    /// (and renewed) for `--hold-for`.
    Holding,
    /// Over.
    Done(EndReason),
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The program of the current unit (the claim, or the command) exited.
    Exited(u8),
    /// Nothing of the current unit is left.
    Empty,
    /// The current program could not be started; the status it gets.
    SpawnFailed(u8),
    /// A renewal sent at this instant succeeded.
    Renewed(Instant),
    /// A renewal could not reach the backend.
    RenewFailed(String),
    /// The backend answered that this replica no longer holds the lease.
    Lost(Option<Holder>),
    /// The backend refused for good: the term ends as if lost.
    Refused(String),
    /// SIGTERM, SIGINT or SIGQUIT.
    Stop(Signal),
    /// A signal to pass on to the program's group.
    Forward(Signal),
    /// Hand the lease over: end the term as a stop does (the yield signal,
    /// the kill after the grace, the release), but the replica goes on.
    Resign,
}

/// What to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start the claim command (as the term's first unit).
    StartClaim,
    /// Start the command (after the claim's unit, if any, is gone).
    StartCommand,
    Signal(Signal, Scope),
    Kill,
    /// Send a renewal now.
    Renew,
    /// Give the lease up (the term is over and the lease was not lost);
    /// `last`: the run ends with this term.
    Release {
        last: bool,
    },
    /// The term is over.
    Finish(TermEnd),
}

/// How a term ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermEnd {
    pub reason: EndReason,
    /// The command's status, if it ran.
    pub code: Option<u8>,
    /// A stop signal came during the term: leaderrun exits after it.
    pub stopped: bool,
    /// The lease was lost (or refused): it was not released.
    pub lost: bool,
}

/// The settings of a term.
#[derive(Debug, Clone, Copy)]
pub struct TermSettings {
    pub timing: Timing,
    pub yield_signal: Signal,
    pub hold_for: Duration,
    pub claim: bool,
    /// A command that exits, or a stop, ends the run (not in shard mode).
    pub run_ends_with_command: bool,
}

#[derive(Debug)]
pub struct Term {
    token: u64,
    settings: TermSettings,
    phase: Phase,
    deadlines: Deadlines,
    /// The claim must settle before the yield point of the term as acquired:
    /// renewals do not give it more time.
    claim_deadline: Instant,
    hold_until: Instant,
    renew_due: Instant,
    renewing: bool,
    renewal_failing: bool,
    /// The current unit's program has exited.
    program_exited: bool,
    command_ran: bool,
    code: Option<u8>,
    lost: bool,
    stopping: bool,
}

impl Term {
    /// A term whose acquisition was sent at `sent_at`; returns the first
    /// action (start the claim, or the command).
    pub fn begin(token: u64, sent_at: Instant, settings: TermSettings) -> (Term, Vec<Action>) {
        let timing = settings.timing;
        let deadlines = timing.deadlines(sent_at);
        info!(token, "lease acquired");
        let term = Term {
            token,
            settings,
            phase: if settings.claim {
                Phase::Claiming { accepted: false }
            } else {
                Phase::Running
            },
            deadlines,
            claim_deadline: deadlines.yield_at,
            hold_until: sent_at + settings.hold_for,
            renew_due: sent_at + timing.renew_every,
            renewing: false,
            renewal_failing: false,
            program_exited: false,
            command_ran: !settings.claim,
            code: None,
            lost: false,
            stopping: false,
        };
        let first = if settings.claim {
            Action::StartClaim
        } else {
            Action::StartCommand
        };
        (term, vec![first])
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn token(&self) -> u64 {
        self.token
    }

    pub fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    /// When `tick` next has something to do.
    pub fn next_wakeup(&self) -> Option<Instant> {
        let mut at: Option<Instant> = None;
        let mut consider = |instant: Instant| {
            at = Some(at.map_or(instant, |a| a.min(instant)));
        };
        if self.processes_alive() && !self.killed() {
            consider(self.kill_at());
        }
        match self.phase {
            Phase::Claiming { .. } => {
                consider(self.claim_deadline);
                consider(self.deadlines.yield_at);
            }
            Phase::Running => consider(self.deadlines.yield_at),
            Phase::Exited { since } => {
                consider(since + LEFTOVER_GRACE);
                consider(self.deadlines.yield_at);
            }
            Phase::Holding => consider(self.hold_ends()),
            Phase::Ending { .. } | Phase::Done(_) => {}
        }
        if self.renewal_wanted() {
            consider(self.renew_due);
        }
        at
    }

    /// Acts on every deadline that has passed at `now`, the kill first.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        self.tick_into(now, &mut actions);
        actions
    }

    /// Takes an event at `now`, after acting on the deadlines that passed.
    pub fn on(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        self.tick_into(now, &mut actions);
        self.handle(event, now, &mut actions);
        actions
    }

    fn tick_into(&mut self, now: Instant, actions: &mut Vec<Action>) {
        if self.processes_alive() && !self.killed() && now >= self.kill_at() {
            if !matches!(self.phase, Phase::Ending { .. }) {
                // The kill point passed before the yield point was acted on:
                // a supervisor that was paused past both. Kill first, then
                // say why.
                self.phase = Phase::Ending {
                    reason: EndReason::Deadline,
                    kill_at: self.deadlines.kill_at,
                    killed: false,
                };
                info!(
                    token = self.token,
                    reason = EndReason::Deadline.as_str(),
                    "term ending"
                );
            }
            self.kill(actions);
        }
        match self.phase {
            Phase::Claiming { .. } if now >= self.claim_deadline.min(self.deadlines.yield_at) => {
                self.begin_ending(
                    EndReason::ClaimRefused,
                    self.deadlines.kill_at,
                    now,
                    actions,
                );
            }
            Phase::Running | Phase::Exited { .. } if now >= self.deadlines.yield_at => {
                self.begin_ending(EndReason::Deadline, self.deadlines.kill_at, now, actions);
            }
            Phase::Exited { since } if now >= since + LEFTOVER_GRACE => {
                // The command is gone but something it started is not: the
                // term is not over until that is gone too.
                let kill_at = self.settings.timing.early_kill_at(now, &self.deadlines);
                self.begin_ending(EndReason::ChildExited, kill_at, now, actions);
            }
            Phase::Holding if now >= self.hold_ends() => {
                self.finish(EndReason::ChildExited, actions)
            }
            _ => {}
        }
        if self.renewal_wanted() && now >= self.renew_due {
            self.renewing = true;
            actions.push(Action::Renew);
        }
    }

    fn handle(&mut self, event: Event, now: Instant, actions: &mut Vec<Action>) {
        let token = self.token;
        match event {
            Event::Exited(code) => self.exited(code, now, actions),
            Event::Empty => self.empty(now, actions),
            Event::SpawnFailed(code) => {
                self.program_exited = true;
                match self.phase {
                    Phase::Claiming { .. } => self.finish(EndReason::ClaimRefused, actions),
                    _ => {
                        self.code = Some(code);
                        self.finish(EndReason::ChildExited, actions);
                    }
                }
            }
            Event::Renewed(sent_at) => {
                self.renewing = false;
                // A late reply to an older renewal never moves the deadlines
                // back.
                let renewed = self.settings.timing.deadlines(sent_at);
                if renewed.expiry > self.deadlines.expiry {
                    self.deadlines = renewed;
                }
                self.renew_due = sent_at + self.settings.timing.renew_every;
                if self.renewal_failing {
                    self.renewal_failing = false;
                    info!(token, "renewal recovered");
                }
            }
            Event::RenewFailed(error) => {
                self.renewing = false;
                if !self.renewal_failing {
                    self.renewal_failing = true;
                    let left = self.deadlines.yield_at.saturating_duration_since(now);
                    warn!(token, error = %error, until_yield = %show(left), "renewal failed; retrying");
                }
                self.renew_due = now + self.settings.timing.renew_retry_every();
            }
            Event::Lost(holder) => {
                match &holder {
                    Some(h) => {
                        warn!(token, holder = %h.owner, holder_token = h.token, "lease lost")
                    }
                    None => warn!(token, "lease lost"),
                }
                self.lost(now, actions);
            }
            Event::Refused(error) => {
                warn!(token, error = %error, "the backend refused the renewal; ending the term");
                self.lost(now, actions);
            }
            Event::Stop(signal) => self.stop(signal, now, actions),
            Event::Resign => self.resign(now, actions),
            Event::Forward(signal) => {
                if self.processes_alive() && !self.program_exited {
                    actions.push(Action::Signal(signal, Scope::Group));
                }
            }
        }
    }

    fn exited(&mut self, code: u8, now: Instant, actions: &mut Vec<Action>) {
        self.program_exited = true;
        let token = self.token;
        match self.phase {
            Phase::Claiming { accepted: false } if code == 0 => {
                info!(token, "claim accepted");
                self.phase = Phase::Claiming { accepted: true };
                // A hook's stray processes do not outlive it; the command
                // starts when the claim's unit is empty.
                actions.push(Action::Kill);
            }
            Phase::Claiming { .. } => {
                info!(
                    token,
                    reason = EndReason::ClaimRefused.as_str(),
                    code,
                    "term ending"
                );
                self.phase = Phase::Ending {
                    reason: EndReason::ClaimRefused,
                    kill_at: now,
                    killed: false,
                };
                self.kill(actions);
            }
            Phase::Running => {
                self.code = Some(code);
                info!(token, code, "child exited");
                self.phase = Phase::Exited { since: now };
            }
            Phase::Ending { killed, .. } => {
                if self.command_ran {
                    self.code = Some(code);
                    info!(token, code, "child exited");
                }
                if !killed {
                    // Descendants that left the program's group never got
                    // the yield signal: give them the same grace, within the
                    // same kill point.
                    actions.push(Action::Signal(self.settings.yield_signal, Scope::All));
                }
            }
            Phase::Exited { .. } | Phase::Holding | Phase::Done(_) => {}
        }
    }

    fn empty(&mut self, now: Instant, actions: &mut Vec<Action>) {
        match self.phase {
            Phase::Claiming { accepted: true } => {
                self.phase = Phase::Running;
                self.program_exited = false;
                self.command_ran = true;
                actions.push(Action::StartCommand);
            }
            Phase::Exited { .. } => self.hold_or_finish(EndReason::ChildExited, now, actions),
            Phase::Ending { reason, .. } => self.hold_or_finish(reason, now, actions),
            // A program that exited without a word (its keeper killed).
            Phase::Claiming { accepted: false } => self.finish(EndReason::ClaimRefused, actions),
            Phase::Running => {
                self.code.get_or_insert(128 + Signal::SIGKILL as u8);
                self.hold_or_finish(EndReason::ChildExited, now, actions);
            }
            Phase::Holding | Phase::Done(_) => {}
        }
    }

    fn lost(&mut self, now: Instant, actions: &mut Vec<Action>) {
        self.lost = true;
        self.renewing = false;
        match self.phase {
            Phase::Claiming { .. } | Phase::Running | Phase::Exited { .. } => {
                let kill_at = self.settings.timing.early_kill_at(now, &self.deadlines);
                self.begin_ending(EndReason::Lost, kill_at, now, actions);
            }
            Phase::Ending {
                reason,
                kill_at,
                killed,
            } => {
                // Someone else may lead now: never give the child more time.
                let early = self.settings.timing.early_kill_at(now, &self.deadlines);
                self.phase = Phase::Ending {
                    reason,
                    kill_at: kill_at.min(early),
                    killed,
                };
            }
            Phase::Holding => self.finish(EndReason::ChildExited, actions),
            Phase::Done(_) => {}
        }
    }

    fn stop(&mut self, signal: Signal, now: Instant, actions: &mut Vec<Action>) {
        let token = self.token;
        if self.stopping {
            info!(
                token,
                signal = signal.as_str(),
                "second stop signal: killing the child now"
            );
            match self.phase {
                Phase::Holding => self.finish(EndReason::ChildExited, actions),
                _ if self.processes_alive() && !self.killed() => {
                    if let Phase::Ending { .. } = self.phase {
                    } else {
                        self.phase = Phase::Ending {
                            reason: EndReason::Stopped,
                            kill_at: now,
                            killed: false,
                        };
                    }
                    self.kill(actions);
                }
                _ => {}
            }
            return;
        }
        self.stopping = true;
        info!(token, signal = signal.as_str(), "stop requested");
        let kill_at = self.settings.timing.early_kill_at(now, &self.deadlines);
        match self.phase {
            Phase::Claiming { .. } | Phase::Running => {
                self.begin_ending(EndReason::Stopped, kill_at, now, actions);
            }
            // The command exited by itself; only what it left is stopped.
            Phase::Exited { .. } => {
                self.begin_ending(EndReason::ChildExited, kill_at, now, actions)
            }
            Phase::Holding => self.finish(EndReason::ChildExited, actions),
            Phase::Ending { .. } | Phase::Done(_) => {}
        }
    }

    fn resign(&mut self, now: Instant, actions: &mut Vec<Action>) {
        if self.stopping {
            return;
        }
        let kill_at = self.settings.timing.early_kill_at(now, &self.deadlines);
        match self.phase {
            Phase::Claiming { .. } | Phase::Running => {
                self.begin_ending(EndReason::Resigned, kill_at, now, actions);
            }
            Phase::Holding => self.finish(EndReason::Resigned, actions),
            // Ending already, or the command exited (its own end comes).
            Phase::Exited { .. } | Phase::Ending { .. } | Phase::Done(_) => {}
        }
    }

    /// Starts the end of a term: the yield signal goes out now, SIGKILL at
    /// `kill_at` (or the term's kill point, if sooner). A claim that has not
    /// settled is killed at once: no grace.
    fn begin_ending(
        &mut self,
        reason: EndReason,
        kill_at: Instant,
        now: Instant,
        actions: &mut Vec<Action>,
    ) {
        let token = self.token;
        if let Phase::Claiming { .. } = self.phase {
            info!(token, reason = reason.as_str(), "term ending");
            self.phase = Phase::Ending {
                reason,
                kill_at: now,
                killed: false,
            };
            self.kill(actions);
            return;
        }
        self.phase = Phase::Ending {
            reason,
            kill_at,
            killed: false,
        };
        let grace = self.kill_at().saturating_duration_since(now);
        info!(token, reason = reason.as_str(), kill_in = %show(grace), "term ending");
        let signal = self.settings.yield_signal;
        // With the program gone, only its leftovers remain: reach them
        // wherever they went.
        let scope = if self.program_exited {
            Scope::All
        } else {
            Scope::Group
        };
        actions.push(Action::Signal(signal, scope));
        info!(token, signal = signal.as_str(), "child signalled");
    }

    fn kill(&mut self, actions: &mut Vec<Action>) {
        if let Phase::Ending {
            reason, kill_at, ..
        } = self.phase
        {
            self.phase = Phase::Ending {
                reason,
                kill_at,
                killed: true,
            };
        }
        actions.push(Action::Kill);
        if !matches!(self.phase, Phase::Claiming { accepted: true }) {
            info!(token = self.token, "child killed");
        }
    }

    fn hold_or_finish(&mut self, reason: EndReason, now: Instant, actions: &mut Vec<Action>) {
        let hold = reason == EndReason::ChildExited
            && !self.lost
            && !self.stopping
            && now < self.hold_ends();
        if hold {
            self.phase = Phase::Holding;
        } else {
            self.finish(reason, actions);
        }
    }

    fn finish(&mut self, reason: EndReason, actions: &mut Vec<Action>) {
        self.phase = Phase::Done(reason);
        if !self.lost {
            let last = self.settings.run_ends_with_command
                && (self.stopping || matches!(reason, EndReason::ChildExited | EndReason::Stopped));
            actions.push(Action::Release { last });
        }
        actions.push(Action::Finish(TermEnd {
            reason,
            code: self
                .command_ran
                .then(|| self.code.unwrap_or(crate::error::Exit::INTERNAL)),
            stopped: self.stopping,
            lost: self.lost,
        }));
    }

    /// Whether anything started in this term may still run.
    fn processes_alive(&self) -> bool {
        matches!(
            self.phase,
            Phase::Claiming { .. } | Phase::Running | Phase::Exited { .. } | Phase::Ending { .. }
        )
    }

    fn killed(&self) -> bool {
        matches!(self.phase, Phase::Ending { killed: true, .. })
    }

    /// SIGKILL comes at the earlier of the ending's own kill time and the
    /// term's kill point, which renewals move and nothing else does.
    fn kill_at(&self) -> Instant {
        match self.phase {
            Phase::Ending { kill_at, .. } => kill_at.min(self.deadlines.kill_at),
            _ => self.deadlines.kill_at,
        }
    }

    /// After the command exited, --hold-for keeps the lease (renewed) until
    /// `hold_until`, but never past the point where a failing renewal would
    /// have ended the term anyway.
    fn hold_ends(&self) -> Instant {
        self.hold_until.min(self.deadlines.yield_at)
    }

    fn renewal_wanted(&self) -> bool {
        !self.lost && !self.renewing && !matches!(self.phase, Phase::Done(_))
    }
}
