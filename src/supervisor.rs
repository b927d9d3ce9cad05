//! The supervisor: one task that owns a replica's whole life. It campaigns
//! for the lease, runs the command while it leads, renews, and ends each term
//! on the timeline of SPEC §3.
//!
//! Everything that can change a term arrives in one `select!`: the kill and
//! yield deadlines (polled first, so a supervisor that was paused acts on
//! the deadlines that passed before anything else), signals, the renewal's
//! reply, the renewal tick and the hold timer. There are no shared flags and
//! no other tasks; backend calls run as futures owned by this loop.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt as _;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use crate::backend::{Attempt, Backend, RenewError, Unreachable};
use crate::error::Exit;
use crate::metrics::Metrics;
use crate::process::{self, Child, ChildEnv, Guard, Program};
use crate::signals::{SignalEvent, Signals};
use crate::spec::{Spec, Wait};
use crate::timeline::{Deadlines, show};

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
}

impl EndReason {
    fn as_str(self) -> &'static str {
        match self {
            EndReason::Deadline => "deadline",
            EndReason::Stopped => "stopped",
            EndReason::Lost => "lost",
            EndReason::ChildExited => "child exited",
            EndReason::ClaimRefused => "claim refused",
        }
    }
}

pub struct Supervisor {
    spec: Spec,
    program: PathBuf,
    backend: Backend,
    signals: Signals,
    guard: Option<Guard>,
    /// A stop signal has been received: exit after the current term.
    stopping: bool,
    health: Health,
    metrics: Arc<Metrics>,
    /// When the wait that led to the current attempt ended (for the
    /// handover figure).
    woke_at: Instant,
}

enum Campaign {
    Acquired { token: u64, sent_at: Instant },
    GaveUp(Exit),
    Stopped,
}

/// The state of a term's processes and of its ending.
struct Term {
    token: u64,
    child: Child,
    deadlines: Deadlines,
    /// Why the term is ending, once it is.
    reason: Option<EndReason>,
    /// When what is left of the child gets SIGKILL, once the term is ending
    /// early; the term's own kill point applies in any case.
    early_kill_at: Option<Instant>,
    /// The claim command is running (`child` is it, not the command yet).
    claiming: bool,
    /// The command itself was started in this term.
    command_ran: bool,
    /// The current child's exit code, once it has been reaped.
    status: Option<u8>,
    /// Descendants still alive after the command itself exited.
    leftovers: bool,
    killed: bool,
    lost: bool,
}

impl Term {
    /// Whether anything started in this term may still run.
    fn alive(&self) -> bool {
        self.status.is_none() || self.leftovers
    }

    fn kill_at(&self) -> Instant {
        self.early_kill_at
            .map_or(self.deadlines.kill_at, |at| at.min(self.deadlines.kill_at))
    }
}

type Renewal = Pin<Box<dyn Future<Output = (Instant, Result<(), RenewError>)>>>;

/// How a term ended: why, and the command's exit code if it ran.
struct TermEnd {
    reason: EndReason,
    code: Option<u8>,
}

/// Why a follower's wait ended.
enum Wake {
    Attempt,
    Stopped,
    GaveUp,
}

/// Why an acquisition attempt did not reach an answer.
enum AttemptError {
    Unreachable(Unreachable),
    /// The fence-floor command failed or printed something unusable.
    Floor(String),
    Stopped,
}

impl From<Unreachable> for AttemptError {
    fn from(error: Unreachable) -> Self {
        AttemptError::Unreachable(error)
    }
}

impl Supervisor {
    pub fn new(
        spec: Spec,
        program: PathBuf,
        backend: Backend,
        signals: Signals,
        guard: Option<Guard>,
        metrics: Arc<Metrics>,
    ) -> Supervisor {
        Supervisor {
            spec,
            program,
            backend,
            signals,
            guard,
            stopping: false,
            health: Health::new(metrics.clone()),
            metrics,
            woke_at: Instant::now(),
        }
    }

    pub async fn run(mut self) -> Exit {
        let exit = self.lifetime().await;
        // The shutdown notice: a replica that exits gracefully leaves the
        // candidate list at once (one that dies expires after ttl).
        if let Err(error) = self.backend.withdraw().await {
            debug!(error = %error, "cannot remove the candidate record; it expires after ttl");
        }
        exit
    }

    async fn lifetime(&mut self) -> Exit {
        info!(backend = %self.spec.backend, "campaign started");
        let mut not_before = None;
        loop {
            let (token, sent_at) = match self.campaign(not_before.take()).await {
                Campaign::Acquired { token, sent_at } => (token, sent_at),
                Campaign::GaveUp(exit) => return exit,
                Campaign::Stopped => return Exit::Stopped,
            };
            let end = self.lead(token, sent_at).await;
            let once = self.spec.wait == Wait::Once;
            match (end.reason, end.code) {
                (_, None) if self.stopping => return Exit::Stopped,
                (_, Some(code)) if self.stopping => return Exit::Child(code),
                (EndReason::ChildExited | EndReason::Stopped, code) => {
                    return code.map_or(Exit::Stopped, Exit::Child);
                }
                (_, Some(code)) if once => return Exit::Child(code),
                (_, None) if once => return Exit::HeldElsewhere,
                (EndReason::ClaimRefused, _) => {
                    // A refused claim means this token is stale (or the store
                    // is unwell): try the next one a campaign period later,
                    // not in a tight loop.
                    not_before = Some(Instant::now() + self.spec.timing.campaign_every);
                }
                (EndReason::Deadline | EndReason::Lost, _) => {}
            }
            info!("campaign started");
        }
    }

    /// Attempts until the lease is ours, the wait runs out, or a stop signal.
    /// The first attempt waits for `not_before`, if given.
    async fn campaign(&mut self, not_before: Option<Instant>) -> Campaign {
        let timing = self.spec.timing;
        let give_up_at = match self.spec.wait {
            Wait::For(wait) => Some(Instant::now() + wait),
            Wait::Once | Wait::Forever => None,
        };
        let mut answered = false;
        let mut failures = 0;
        let mut held_off = None;
        self.woke_at = Instant::now();
        // Release notices cannot cut the first wait short: the one to expect
        // then is this replica's own.
        let mut next: Option<(Instant, bool)> = not_before.map(|at| (at, false));
        loop {
            if let Some((at, notices)) = next {
                match self.wait(at, give_up_at, notices).await {
                    Wake::Attempt => self.woke_at = Instant::now(),
                    Wake::Stopped => return Campaign::Stopped,
                    Wake::GaveUp => {
                        info!(wait = %show(self.spec.wait_duration()), "giving up (--wait)");
                        let exit = if answered {
                            Exit::HeldElsewhere
                        } else {
                            Exit::Unreachable
                        };
                        return Campaign::GaveUp(exit);
                    }
                }
            }
            let wake_at = match self.attempt().await {
                Ok((Attempt::Acquired { token }, sent_at)) => {
                    self.health.reachable();
                    return Campaign::Acquired { token, sent_at };
                }
                Ok((Attempt::Held(holder), _)) => {
                    self.health.reachable();
                    answered = true;
                    failures = 0;
                    if self.spec.wait == Wait::Once {
                        info!(holder = %holder.owner, holder_token = holder.token, "lease held elsewhere; giving up (--no-wait)");
                        return Campaign::GaveUp(Exit::HeldElsewhere);
                    }
                    debug!(holder = %holder.owner, holder_token = holder.token, "lease held elsewhere");
                    // Wake at the holder's known expiry if that comes first.
                    let wait = holder.expires_in.map_or(timing.campaign_every, |left| {
                        (left + Duration::from_millis(1)).min(timing.campaign_every)
                    });
                    Instant::now() + wait
                }
                Ok((Attempt::HeldOff { retry_in, why }, _)) => {
                    self.health.reachable();
                    answered = true;
                    failures = 0;
                    if self.spec.wait == Wait::Once {
                        info!(why, "lease held off; giving up (--no-wait)");
                        return Campaign::GaveUp(Exit::HeldElsewhere);
                    }
                    if held_off != Some(why) {
                        held_off = Some(why);
                        info!(why, retry_in = %show(retry_in), "lease held off");
                    }
                    Instant::now() + retry_in.max(Duration::from_millis(1))
                }
                Err(AttemptError::Unreachable(error)) => {
                    self.health.unreachable(&error);
                    if self.spec.wait == Wait::Once {
                        return Campaign::GaveUp(Exit::Unreachable);
                    }
                    failures += 1;
                    Instant::now() + backoff(timing.campaign_every, failures)
                }
                Err(AttemptError::Floor(why)) => {
                    warn!(why = %why, "fence floor command failed; skipping this attempt");
                    if self.spec.wait == Wait::Once {
                        return Campaign::GaveUp(Exit::HeldElsewhere);
                    }
                    Instant::now() + timing.campaign_every
                }
                Err(AttemptError::Stopped) => return Campaign::Stopped,
            };
            next = Some((wake_at, true));
        }
    }

    /// Waits while following until `at`, a release notice (when `notices`),
    /// the --wait deadline, or a stop signal.
    async fn wait(&mut self, at: Instant, give_up_at: Option<Instant>, notices: bool) -> Wake {
        loop {
            self.metrics.beat();
            tokio::select! {
                biased;
                event = self.signals.next() => match event {
                    SignalEvent::Stop(signal) => {
                        info!(signal = signal.as_str(), "stopped while following");
                        return Wake::Stopped;
                    }
                    // Orphans re-parented to leaderrun (as PID 1) are reaped here too.
                    SignalEvent::ChildChanged => drop(process::reap()),
                    SignalEvent::Forward(_) => {}
                },
                _ = sleep_until(give_up_at.unwrap_or(at)), if give_up_at.is_some_and(|g| g <= at) => return Wake::GaveUp,
                () = self.backend.notice(), if notices => return Wake::Attempt,
                _ = sleep_until(at) => return Wake::Attempt,
            }
        }
    }

    /// One acquisition attempt. With --fence-floor-cmd, and only while the
    /// lease is free, the floor command runs first and the counter is moved
    /// up to what it printed.
    async fn attempt(&mut self) -> Result<(Attempt, Instant), AttemptError> {
        if let Some(script) = self.spec.fence_floor_cmd.clone() {
            let observed = self.backend.observe().await?;
            if let Some(holder) = observed.holder {
                // No acquire this time, so refresh the candidate record here.
                self.backend.heartbeat().await?;
                return Ok((Attempt::Held(holder), Instant::now()));
            }
            let floor = self.fence_floor(&script).await?;
            let counter = self.backend.advance_fence(floor).await?;
            debug!(floor, counter, "fence counter moved up to the floor");
        }
        let sent_at = Instant::now();
        Ok((self.backend.acquire().await?, sent_at))
    }

    /// Runs the fence-floor command and parses what it printed.
    async fn fence_floor(&mut self, script: &str) -> Result<u64, AttemptError> {
        let (path, argv) = process::shell(script);
        let env = ChildEnv {
            token_env: &self.spec.token_env,
            token: None,
            key: &self.spec.key,
            owner: &self.spec.owner,
        };
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| AttemptError::Floor(format!("cannot make a pipe: {e}")))?;
        let child = process::spawn(
            Program {
                path: &path,
                argv: &argv,
            },
            &env,
            Some(&writer),
        )
        .map_err(|e| AttemptError::Floor(format!("cannot start it: {e}")))?;
        drop(writer);
        let mut output = tokio::net::unix::pipe::Receiver::from_owned_fd(reader)
            .map_err(|e| AttemptError::Floor(format!("cannot read its output: {e}")))?;
        let deadline = Instant::now() + self.spec.timing.ttl;
        let mut printed = Vec::new();
        let mut buf = [0u8; 1024];
        let mut eof = false;
        let mut code = None;
        while code.is_none() || !eof {
            self.metrics.beat();
            tokio::select! {
                biased;
                event = self.signals.next() => match event {
                    SignalEvent::Stop(signal) => {
                        info!(signal = signal.as_str(), "stopped while following");
                        child.signal_group(Signal::SIGKILL);
                        return Err(AttemptError::Stopped);
                    }
                    SignalEvent::ChildChanged => {
                        for (pid, status) in process::reap().exited {
                            if pid == child.pid {
                                code = process::exit_code(status);
                            }
                        }
                    }
                    SignalEvent::Forward(_) => {}
                },
                read = output.read(&mut buf), if !eof => match read {
                    Ok(0) | Err(_) => eof = true,
                    // Enough for any number; the rest is not kept.
                    Ok(n) => printed.extend_from_slice(&buf[..n.min(4096 - printed.len().min(4096))]),
                },
                _ = sleep_until(deadline) => {
                    child.signal_group(Signal::SIGKILL);
                    return Err(AttemptError::Floor(format!("it did not finish within {}", show(self.spec.timing.ttl))));
                }
            }
        }
        let text = String::from_utf8_lossy(&printed);
        let shown: String = text.trim().chars().take(200).collect();
        match code {
            Some(0) => text.trim().parse::<u64>().map_err(|_| {
                AttemptError::Floor(format!(
                    "it printed {shown:?}, which is not a non-negative integer"
                ))
            }),
            code => Err(AttemptError::Floor(format!(
                "it exited with status {} and printed {shown:?}",
                code.unwrap_or(Exit::INTERNAL)
            ))),
        }
    }

    /// Runs one term: runs the claim command if there is one, starts the
    /// command, renews, and ends the term when the command exits, a signal
    /// stops it, the lease is lost, the claim is refused or the deadline
    /// comes.
    async fn lead(&mut self, token: u64, sent_at: Instant) -> TermEnd {
        let timing = self.spec.timing;
        info!(token, "lease acquired");
        let claiming = self.spec.claim_cmd.is_some();
        let first = if claiming {
            self.start_claim(token)
        } else {
            self.start_command(token)
        };
        let child = match first {
            Ok(child) => {
                self.backend.leading();
                child
            }
            Err(error) => {
                warn!(token, error = %error, "cannot start the {}", if claiming { "claim command" } else { "command" });
                self.release(token).await;
                let code = match error.kind() {
                    std::io::ErrorKind::NotFound => Exit::NOT_FOUND,
                    _ => Exit::NOT_EXECUTABLE,
                };
                return TermEnd {
                    reason: if claiming {
                        EndReason::ClaimRefused
                    } else {
                        EndReason::ChildExited
                    },
                    code: (!claiming).then_some(code),
                };
            }
        };

        let mut term = Term {
            token,
            child,
            deadlines: timing.deadlines(sent_at),
            reason: None,
            early_kill_at: None,
            claiming,
            command_ran: !claiming,
            status: None,
            leftovers: false,
            killed: false,
            lost: false,
        };
        let hold_until = sent_at + self.spec.hold_for;
        let claim_deadline = term.deadlines.yield_at;
        let mut renew_at = sent_at + timing.renew_every;
        let mut renewal: Option<Renewal> = None;
        let mut renewal_failing = false;

        if term.command_ran {
            self.metrics.term_started(token, self.woke_at.elapsed());
        }
        loop {
            self.metrics.beat();
            let alive = term.alive();
            // After the command exited by itself, --hold-for keeps the lease
            // (renewed) until hold_until, but never past the point where a
            // failing renewal would have ended the term anyway.
            let hold_ends = hold_until.min(term.deadlines.yield_at);
            if !alive
                && (term.reason != Some(EndReason::ChildExited)
                    || term.lost
                    || Instant::now() >= hold_ends)
            {
                break;
            }
            tokio::select! {
                biased;
                _ = sleep_until(term.kill_at()), if alive && !term.killed => {
                    self.kill(&mut term);
                }
                _ = sleep_until(term.deadlines.yield_at), if alive && term.reason.is_none() => {
                    let kill_at = term.deadlines.kill_at;
                    let reason = if term.claiming { EndReason::ClaimRefused } else { EndReason::Deadline };
                    self.begin_ending(&mut term, reason, kill_at);
                }
                // The claim must settle before the yield point of the term as
                // acquired: renewals do not give it more time.
                _ = sleep_until(claim_deadline), if term.claiming && term.reason.is_none() => {
                    let kill_at = term.deadlines.kill_at;
                    self.begin_ending(&mut term, EndReason::ClaimRefused, kill_at);
                }
                event = self.signals.next() => match event {
                    SignalEvent::ChildChanged => self.reap(&mut term),
                    SignalEvent::Forward(signal) if alive => {
                        debug!(token, signal = signal.as_str(), "signal forwarded");
                        term.child.signal_group(signal);
                    }
                    SignalEvent::Forward(_) => {}
                    SignalEvent::Stop(signal) if !self.stopping => {
                        info!(token, signal = signal.as_str(), "stop requested");
                        self.stopping = true;
                        if !alive {
                            break;
                        }
                        if term.reason.is_none() {
                            let kill_at = timing.early_kill_at(Instant::now(), &term.deadlines);
                            self.begin_ending(&mut term, EndReason::Stopped, kill_at);
                        }
                    }
                    SignalEvent::Stop(signal) => {
                        info!(token, signal = signal.as_str(), "second stop signal: killing the child now");
                        if alive {
                            self.kill(&mut term);
                        } else {
                            break;
                        }
                    }
                },
                (sent_at, result) = async { renewal.as_mut().expect("guarded").await }, if renewal.is_some() => {
                    renewal = None;
                    match result {
                        Ok(()) => {
                            term.deadlines = timing.deadlines(sent_at);
                            renew_at = sent_at + timing.renew_every;
                            if renewal_failing {
                                renewal_failing = false;
                                info!(token, "renewal recovered");
                            }
                            self.health.reachable();
                        }
                        Err(RenewError::Lost(holder)) => {
                            term.lost = true;
                            match holder {
                                Some(h) => warn!(token, holder = %h.owner, holder_token = h.token, "lease lost"),
                                None => warn!(token, "lease lost"),
                            }
                            if term.alive() && term.reason.is_none() {
                                let kill_at = timing.early_kill_at(Instant::now(), &term.deadlines);
                                self.begin_ending(&mut term, EndReason::Lost, kill_at);
                            }
                        }
                        Err(RenewError::Unreachable(error)) => {
                            self.metrics.renewal_failed();
                            if !renewal_failing {
                                renewal_failing = true;
                                let left = term.deadlines.yield_at.saturating_duration_since(Instant::now());
                                warn!(token, error = %error, until_yield = %show(left), "renewal failed; retrying");
                            }
                            self.health.unreachable(&error);
                            renew_at = Instant::now() + timing.renew_retry_every();
                        }
                    }
                }
                _ = sleep_until(renew_at), if renewal.is_none() && !term.lost => {
                    let backend = self.backend.clone();
                    let sent_at = Instant::now();
                    renewal = Some(Box::pin(async move { (sent_at, backend.renew(token).await) }));
                }
                _ = sleep_until(hold_ends), if !alive => {}
            }
        }

        if term.child.has_terminal {
            process::reclaim_terminal();
        }
        if !term.lost {
            self.release(token).await;
        }
        // After the release: telling the guard wakes its process, and the
        // next leader should not wait for that. The term's processes are
        // all gone already, so the guard has nothing left to kill.
        if let Some(guard) = &self.guard {
            guard.watch(None);
        }
        self.metrics
            .term_ended(term.reason.unwrap_or(EndReason::ChildExited).as_str());
        TermEnd {
            reason: term.reason.unwrap_or(EndReason::ChildExited),
            code: term
                .command_ran
                .then(|| term.status.unwrap_or(Exit::INTERNAL)),
        }
    }

    /// The command itself, with the token in its environment.
    fn start_command(&self, token: u64) -> std::io::Result<Child> {
        let program = Program {
            path: &self.program,
            argv: &self.spec.command,
        };
        self.start(program, token, "child started")
    }

    /// `sh -c <claim command>`, with the command's environment.
    fn start_claim(&self, token: u64) -> std::io::Result<Child> {
        let (path, argv) = process::shell(self.spec.claim_cmd.as_deref().unwrap_or_default());
        let program = Program {
            path: &path,
            argv: &argv,
        };
        self.start(program, token, "claim command started")
    }

    /// Starts a process of the term and puts its group under the guard.
    fn start(&self, program: Program<'_>, token: u64, started: &str) -> std::io::Result<Child> {
        let child = process::spawn(program, &self.child_env(Some(token)), None)?;
        if let Some(guard) = &self.guard {
            guard.watch(Some(child.pgid));
        }
        debug!(token, pid = child.pid.as_raw(), "{started}");
        Ok(child)
    }

    fn child_env(&self, token: Option<u64>) -> ChildEnv<'_> {
        ChildEnv {
            token_env: &self.spec.token_env,
            token,
            key: &self.spec.key,
            owner: &self.spec.owner,
        }
    }

    /// Starts the end of a term: the yield signal goes to the child's group
    /// now, SIGKILL at `kill_at` (or the term's kill point, if sooner).
    fn begin_ending(&self, term: &mut Term, reason: EndReason, kill_at: Instant) {
        term.reason = Some(reason);
        if term.claiming {
            // A claim that has not settled by now is refused: no grace.
            info!(token = term.token, reason = reason.as_str(), "term ending");
            self.kill(term);
            return;
        }
        term.early_kill_at = Some(kill_at);
        let grace = term.kill_at().saturating_duration_since(Instant::now());
        info!(token = term.token, reason = reason.as_str(), kill_in = %show(grace), "term ending");
        let signal = self.spec.yield_signal;
        if term.status.is_none() {
            term.child.signal_group(signal);
        } else {
            // Only leftovers remain: reach them wherever they went.
            term.child.signal_everything(signal);
        }
        info!(
            token = term.token,
            signal = signal.as_str(),
            "child signalled"
        );
    }

    /// SIGKILL to the child's group and every other descendant.
    fn kill(&self, term: &mut Term) {
        if term.reason.is_none() {
            // The kill point passed before the yield point was acted on: a
            // supervisor that was paused past both. Kill first, then say why.
            term.reason = Some(EndReason::Deadline);
            info!(
                token = term.token,
                reason = EndReason::Deadline.as_str(),
                "term ending"
            );
        }
        term.killed = true;
        term.child.signal_everything(Signal::SIGKILL);
        info!(token = term.token, "child killed");
    }

    /// Reaps what ended, and notes whether the command is gone and whether
    /// anything of it is left.
    fn reap(&self, term: &mut Term) {
        let reaped = process::reap();
        for (pid, status) in reaped.exited {
            if pid == term.child.pid {
                term.status = process::exit_code(status);
            }
        }
        if term.status.is_none() {
            return;
        }
        if term.claiming {
            term.claiming = false;
            if term.status == Some(0) && term.reason.is_none() {
                info!(token = term.token, "claim accepted");
                match self.start_command(term.token) {
                    Ok(child) => {
                        term.child = child;
                        term.command_ran = true;
                        term.status = None;
                        self.metrics
                            .term_started(term.token, self.woke_at.elapsed());
                        return;
                    }
                    Err(error) => {
                        warn!(token = term.token, error = %error, "cannot start the command");
                        term.command_ran = true;
                        term.status = Some(match error.kind() {
                            std::io::ErrorKind::NotFound => Exit::NOT_FOUND,
                            _ => Exit::NOT_EXECUTABLE,
                        });
                    }
                }
            } else if term.reason.is_none() {
                term.reason = Some(EndReason::ClaimRefused);
                info!(
                    token = term.token,
                    reason = EndReason::ClaimRefused.as_str(),
                    code = term.status,
                    "term ending"
                );
            }
        }
        let first_sight = !term.leftovers;
        term.leftovers = reaped.children_left;
        if term.reason.is_none() {
            info!(token = term.token, code = term.status, "child exited");
            if term.leftovers {
                // The command is gone but something it started is not: the
                // term is not over until that is gone too.
                let kill_at = self
                    .spec
                    .timing
                    .early_kill_at(Instant::now(), &term.deadlines);
                self.begin_ending(term, EndReason::ChildExited, kill_at);
            } else {
                term.reason = Some(EndReason::ChildExited);
            }
        } else if term.leftovers && term.killed {
            // Descendants re-parented since the kill, or forked during it.
            process::signal_descendants(Signal::SIGKILL);
        } else if term.leftovers && first_sight {
            // The term is ending and the command is gone, but descendants that
            // left its group never got the yield signal: give them the same
            // grace, within the same kill point.
            process::signal_descendants(self.spec.yield_signal);
        }
    }

    async fn release(&self, token: u64) {
        self.backend.leading();
        match self.backend.release(token).await {
            Ok(true) => info!(token, "lease released"),
            Ok(false) => info!(token, "lease already lapsed; nothing to release"),
            Err(error) => {
                warn!(token, error = %error, "release failed; the lease lapses at its expiry")
            }
        }
    }
}

impl Spec {
    fn wait_duration(&self) -> Duration {
        match self.wait {
            Wait::For(wait) => wait,
            Wait::Once | Wait::Forever => Duration::ZERO,
        }
    }
}

/// The delay before attempt `failures + 1` against an unreachable backend:
/// doubling from campaign_every, capped at 5 s (or campaign_every if longer).
fn backoff(campaign_every: Duration, failures: u32) -> Duration {
    let cap = campaign_every.max(Duration::from_secs(5));
    campaign_every
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(cap)
}

/// Rate-limited reporting of "could not ask the backend".
struct Health {
    down_since: Option<Instant>,
    last_warning: Option<Instant>,
    failures: u64,
    metrics: Arc<Metrics>,
}

const WARN_EVERY: Duration = Duration::from_secs(10);

impl Health {
    fn new(metrics: Arc<Metrics>) -> Health {
        Health {
            down_since: None,
            last_warning: None,
            failures: 0,
            metrics,
        }
    }

    fn unreachable(&mut self, error: &Unreachable) {
        self.metrics.backend_error();
        let now = Instant::now();
        self.failures += 1;
        let since = *self.down_since.get_or_insert(now);
        if self.last_warning.is_none_or(|at| now - at >= WARN_EVERY) {
            self.last_warning = Some(now);
            warn!(error = %error, failures = self.failures, down_for = %show(now - since), "backend unreachable");
        } else {
            debug!(error = %error, "backend unreachable");
        }
    }

    fn reachable(&mut self) {
        if let Some(since) = self.down_since.take() {
            info!(down_for = %show(Instant::now() - since), failures = self.failures, "backend reachable again");
            self.failures = 0;
            self.last_warning = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_campaign_every_up_to_five_seconds() {
        let every = Duration::from_millis(500);
        let delays: Vec<u64> = (1..=6)
            .map(|n| backoff(every, n).as_millis() as u64)
            .collect();
        assert_eq!(delays, [500, 1000, 2000, 4000, 5000, 5000]);
        assert_eq!(backoff(Duration::from_secs(9), 3), Duration::from_secs(9));
    }
}
