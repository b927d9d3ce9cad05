//! Campaigning: attempts until the lease is this replica's, the wait runs
//! out, or a stop signal; the waits in between (a release notice, the
//! holder's known expiry, the campaign period, a backoff); and the
//! fence-floor hook, which runs through the same spawn path as the command.
//!
//! Every step can be interrupted by a stop signal and by the `--wait`
//! deadline, also a backend call in flight: `--wait D` bounds the whole wait,
//! and a stop while following is prompt.

use std::future::Future;
use std::time::Duration;

use tokio::io::AsyncReadExt as _;
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use super::health::backoff;
use super::{HostEvent, Supervisor, Wait};
use crate::backend::{Attempt, Fatal, StoreError, Unreachable};
use crate::error::Exit;
use crate::process::{ProcessUnit, Processes, Spawn, UnitEvent, shell};
use crate::timing::show;

/// How a campaign ended.
pub enum Campaign {
    Acquired {
        token: u64,
        /// When the successful acquire request was sent.
        sent_at: Instant,
        /// When the wait that led to it ended (for the handover figure).
        woke_at: Instant,
    },
    GaveUp(Exit),
    Stopped,
    Refused(Fatal),
}

/// Why a follower's wait ended.
enum Wake {
    Attempt,
    /// Attempt, woken by a release notice (the lease may be free now).
    Noticed,
    Stopped,
    GaveUp,
}

/// Why an acquisition attempt did not reach an answer.
enum AttemptError {
    Unreachable(Unreachable),
    Fatal(Fatal),
    /// The fence-floor command failed or printed something unusable.
    Floor(String),
    Stopped,
    GaveUp,
}

impl From<StoreError> for AttemptError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Unreachable(e) => AttemptError::Unreachable(e),
            StoreError::Fatal(e) => AttemptError::Fatal(e),
        }
    }
}

/// How long an acquisition in flight when a stop comes may still take: if it
/// went through, the lease is released rather than left to lapse.
const STOP_GRACE: Duration = Duration::from_millis(250);

/// Whether a host event that comes while following stops the campaign (a
/// stop signal, or the host gone); forwarded signals and hand-over requests
/// mean nothing without a term.
fn stops(event: Option<HostEvent>) -> bool {
    match event {
        Some(HostEvent::Stop(signal)) => {
            info!(signal = signal.as_str(), "stopped while following");
            true
        }
        Some(HostEvent::Forward(_) | HostEvent::Resign) => false,
        None => true,
    }
}

impl<P: Processes> Supervisor<P> {
    /// Attempts until the lease is ours, the wait runs out, or a stop signal.
    /// The first attempt waits for `not_before`, if given.
    pub(super) async fn campaign(&mut self, not_before: Option<Instant>) -> Campaign {
        let timing = self.spec.timing;
        let once = self.spec.wait == Wait::Once;
        let give_up_at = match self.spec.wait {
            Wait::For(wait) => Some(Instant::now() + wait),
            Wait::Once | Wait::Forever => None,
        };
        let mut failures = 0;
        let mut held_off = None;
        let mut woke_at = Instant::now();
        // Release notices cannot cut the first wait short: the one to expect
        // then is this replica's own.
        let mut next: Option<(Instant, bool)> = not_before.map(|at| (at, false));
        loop {
            let mut noticed = false;
            if let Some((at, notices)) = next {
                // While nothing waits for it, get the next spawn ready.
                self.procs.prepare();
                self.env.prepare();
                match self.wait(at, give_up_at, notices).await {
                    Wake::Attempt => woke_at = Instant::now(),
                    Wake::Noticed => {
                        woke_at = Instant::now();
                        noticed = self.store.release_wakes_one();
                    }
                    Wake::Stopped => return Campaign::Stopped,
                    Wake::GaveUp => return self.give_up(),
                }
            }
            // Shard mode: an attempt needs a slot of the replica's share.
            match self.slot(noticed).await {
                Wake::Attempt | Wake::Noticed => {}
                Wake::Stopped => return Campaign::Stopped,
                Wake::GaveUp => return self.give_up(),
            }
            let attempted = self.attempt(give_up_at).await;
            if let Some(role) = &mut self.shard {
                if !matches!(attempted, Ok((Attempt::Acquired { .. }, _))) {
                    role.gate.unreserve();
                    role.slot = false;
                }
            }
            // Release notices may cut a wait short, but not a hold-off's:
            // the lease is not to be taken before it ends.
            let mut notices = true;
            let wake_at = match attempted {
                Ok((Attempt::Acquired { token }, sent_at)) => {
                    self.health.reachable();
                    return Campaign::Acquired {
                        token,
                        sent_at,
                        woke_at,
                    };
                }
                Ok((Attempt::Held(holder), _)) => {
                    self.health.reachable();
                    failures = 0;
                    if once {
                        info!(holder = %holder.owner, holder_token = holder.token, "lease held elsewhere; giving up (--no-wait)");
                        return Campaign::GaveUp(Exit::HeldElsewhere);
                    }
                    debug!(holder = %holder.owner, holder_token = holder.token, "lease held elsewhere");
                    // A follower that a release would wake attempts only
                    // every half ttl (its heartbeat); one that it would not
                    // polls every campaign period. Either wakes at the
                    // holder's known expiry if that comes first.
                    // In shard mode, a replica below its share polls every
                    // campaign period: the release it waits for may wake a
                    // replica at its share instead (which only looks at the
                    // replicas again), and it wants a shard now.
                    let wanting = self.shard.as_ref().is_some_and(|r| r.gate.wanting());
                    let period = if self.store.wakes_on_release() && !wanting {
                        (timing.ttl / 2).max(timing.campaign_every)
                    } else {
                        timing.campaign_every
                    };
                    let wait = holder
                        .expires_in
                        .map_or(period, |left| (left + Duration::from_millis(1)).min(period));
                    Instant::now() + wait
                }
                Ok((Attempt::HeldOff { retry_in, why }, _)) => {
                    self.health.reachable();
                    failures = 0;
                    if once && held_off.is_some() {
                        info!(why, "lease held off again; giving up (--no-wait)");
                        return Campaign::GaveUp(Exit::HeldElsewhere);
                    }
                    if held_off != Some(why) {
                        held_off = Some(why);
                        // A hold-off is a known, bounded wait: --no-wait waits
                        // it out once, then makes its one attempt.
                        let note = if once {
                            " (waiting it out once: --no-wait)"
                        } else {
                            ""
                        };
                        info!(why, retry_in = %show(retry_in), "lease held off{note}");
                    }
                    notices = false;
                    Instant::now() + retry_in.max(Duration::from_millis(1))
                }
                Err(AttemptError::Unreachable(error)) => {
                    self.health.unreachable(&error);
                    if once {
                        return Campaign::GaveUp(Exit::Unreachable);
                    }
                    failures += 1;
                    Instant::now() + backoff(timing.campaign_every, failures)
                }
                Err(AttemptError::Fatal(fatal)) => return Campaign::Refused(fatal),
                Err(AttemptError::Floor(why)) => {
                    warn!(why = %why, "fence floor command failed; skipping this attempt");
                    if once {
                        return Campaign::GaveUp(Exit::HeldElsewhere);
                    }
                    Instant::now() + timing.campaign_every
                }
                Err(AttemptError::Stopped) => return Campaign::Stopped,
                Err(AttemptError::GaveUp) => return self.give_up(),
            };
            next = Some((wake_at, notices));
        }
    }

    /// Asks the backend once whether the configuration works, before any
    /// attempt: a refusal is `Err`. A backend that cannot be reached is only
    /// a warning, except with --no-wait, whose one contact this was.
    pub(super) async fn startup_check(&mut self) -> Result<Option<Exit>, Fatal> {
        let store = self.store.clone();
        let early = self.early_check.take();
        let give_up_at = match self.spec.wait {
            Wait::For(wait) => Some(Instant::now() + wait),
            Wait::Once | Wait::Forever => None,
        };
        let checked = self
            .race(give_up_at, async {
                let checked = match early {
                    // Never aborted: an error is the check's panic, which
                    // goes on as if the check had run here.
                    Some(started) => started.await.unwrap_or_else(|panicked| {
                        std::panic::resume_unwind(panicked.into_panic())
                    }),
                    None => store.check().await,
                };
                Ok::<_, StoreError>(checked)
            })
            .await;
        match checked {
            Ok(Ok(None)) => {
                self.health.reachable();
                Ok(None)
            }
            Ok(Ok(Some(why))) => {
                self.health.unreachable(&why);
                if self.spec.wait == Wait::Once {
                    return Ok(Some(Exit::Unreachable));
                }
                info!("campaigning anyway: the backend is retried until it answers");
                Ok(None)
            }
            Ok(Err(fatal)) => Err(fatal),
            Err(AttemptError::GaveUp) => match self.give_up() {
                Campaign::GaveUp(exit) => Ok(Some(exit)),
                _ => Ok(Some(Exit::Unreachable)),
            },
            Err(_) => Ok(Some(Exit::Stopped)),
        }
    }

    fn give_up(&self) -> Campaign {
        let wait = match self.spec.wait {
            Wait::For(wait) => wait,
            Wait::Once | Wait::Forever => Duration::ZERO,
        };
        info!(wait = %show(wait), "giving up (--wait)");
        Campaign::GaveUp(if self.health.answered {
            Exit::HeldElsewhere
        } else {
            Exit::Unreachable
        })
    }

    /// Shard mode: takes a slot of the replica's share for the next attempt,
    /// waiting for room if there is none. Out of room, the supervisor makes
    /// no requests; a release of its shard (which may mean a replica left)
    /// asks the balancer for a fresh look at the replicas. `noticed`: the
    /// wait before was ended by such a release, which counts as one here.
    async fn slot(&mut self, noticed: bool) -> Wake {
        let gate = match &self.shard {
            None => return Wake::Attempt,
            Some(role) => role.gate.clone(),
        };
        if self.take_slot() {
            return Wake::Attempt;
        }
        // Woken by a release: the look at the replicas asked for then. A
        // release that ended the wait is one this replica cannot use now
        // either: left to the next notice, its wake would stop here, with
        // no replica in line woken (one with room would poll for it later).
        let mut asked: Option<u64> = noticed.then(|| gate.ask_refresh());
        loop {
            tokio::select! {
                biased;
                event = self.events.recv() => if stops(event) {
                    return Wake::Stopped;
                },
                () = gate.room() => if self.take_slot() {
                    return Wake::Attempt;
                },
                () = gate.looked_since(asked.unwrap_or_default()), if asked.is_some() => {
                    asked = None;
                    if self.take_slot() {
                        return Wake::Attempt;
                    }
                    // A wake this replica cannot use, while shards move (a
                    // replica left, or one joined and others hand shards
                    // over): pass it along the line, once per such change,
                    // until a replica with room takes the shard (the same
                    // replica may be first in every shard's line).
                    let changed = gate.split_changed(self.spec.timing.ttl);
                    let due = match (&self.shard, changed) {
                        (Some(role), Some(d)) if role.passed_for < d => Some(d),
                        _ => None,
                    };
                    // Only a wake passed on counts (where a release wakes
                    // one): a lease held meanwhile (by the replica in line
                    // before, passing it on too) is released again, and
                    // that wakes this one.
                    if let Some(d) = due {
                        let one = self.store.release_wakes_one();
                        if self.pass_wake().await || !one {
                            if let Some(role) = &mut self.shard {
                                role.passed_for = d;
                            }
                        }
                    }
                }
                () = self.store.notice(), if asked.is_none() => asked = Some(gate.ask_refresh()),
            }
        }
    }

    /// Passes on a release's wake this replica cannot use, to the next
    /// follower in the shard's line: takes the lease and gives it back at
    /// once (a token is used up; no command runs). Whether it did: not if
    /// the lease was held or the backend did not answer.
    async fn pass_wake(&mut self) -> bool {
        let attempt = self.attempt;
        self.attempt += 1;
        let Ok(Attempt::Acquired { token }) = self.store.acquire(attempt).await else {
            return false;
        };
        self.store.leading();
        let _ = self.store.release(token).await;
        debug!(token, "passed a release's wake on to the next follower");
        true
    }

    /// Whether this shard's supervisor has a slot now: the one it kept, or
    /// one it reserves.
    fn take_slot(&mut self) -> bool {
        match &mut self.shard {
            Some(role) => {
                role.slot = role.slot || role.gate.try_reserve();
                role.slot
            }
            None => true,
        }
    }

    /// Waits while following until `at`, a release notice (when `notices`),
    /// the --wait deadline, or a stop signal.
    async fn wait(&mut self, at: Instant, give_up_at: Option<Instant>, notices: bool) -> Wake {
        loop {
            self.health.metrics_handle().beat();
            tokio::select! {
                biased;
                event = self.events.recv() => if stops(event) {
                    return Wake::Stopped;
                },
                () = sleep_until(give_up_at.unwrap_or(at)), if give_up_at.is_some_and(|g| g <= at) => return Wake::GaveUp,
                () = self.store.notice(), if notices => return Wake::Noticed,
                () = sleep_until(at) => return Wake::Attempt,
            }
        }
    }

    /// Runs `call` unless a stop signal or the --wait deadline comes first.
    async fn race<T>(
        &mut self,
        give_up_at: Option<Instant>,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, AttemptError> {
        tokio::pin!(call);
        loop {
            tokio::select! {
                biased;
                event = self.events.recv() => if stops(event) {
                    return Err(AttemptError::Stopped);
                },
                () = sleep_until(give_up_at.unwrap_or_else(Instant::now)), if give_up_at.is_some() => {
                    return Err(AttemptError::GaveUp);
                }
                result = &mut call => return Ok(result?),
            }
        }
    }

    /// One acquisition attempt. With --fence-floor-cmd, and only while the
    /// lease is free, the floor command runs first and the counter is moved
    /// up to what it printed.
    async fn attempt(
        &mut self,
        give_up_at: Option<Instant>,
    ) -> Result<(Attempt, Instant), AttemptError> {
        let store = self.store.clone();
        if let Some(script) = self.spec.fence_floor_cmd.clone() {
            let observed = self.race(give_up_at, store.observe()).await?;
            if let Some(holder) = observed.holder {
                // No acquire this time, so refresh the candidate record here.
                self.race(give_up_at, store.heartbeat()).await?;
                return Ok((Attempt::Held(holder), Instant::now()));
            }
            let floor = self.fence_floor(&script).await?;
            let counter = self.race(give_up_at, store.advance_fence(floor)).await?;
            debug!(floor, counter, "fence counter moved up to the floor");
        }
        let sent_at = Instant::now();
        let acquire = store.acquire(self.attempt);
        tokio::pin!(acquire);
        let answer = self.race(give_up_at, &mut acquire).await;
        if let Err(AttemptError::Stopped | AttemptError::GaveUp) = answer {
            // A stop or the deadline came with the request in flight: if it
            // went through after all, give the lease back rather than leave
            // it to lapse.
            if let Ok(Ok(Attempt::Acquired { token })) =
                tokio::time::timeout(STOP_GRACE, &mut acquire).await
            {
                let _ = tokio::time::timeout(STOP_GRACE, store.release(token)).await;
            }
        }
        let answer = answer?;
        // A lease handed over was made to last from an earlier moment.
        let counted_from = match answer {
            Attempt::Acquired { .. } => store
                .acquired_since()
                .map_or(sent_at, |at| Instant::from_std(at).min(sent_at)),
            _ => sent_at,
        };
        Ok((answer, counted_from))
    }

    /// Runs the fence-floor command and parses what it printed.
    async fn fence_floor(&mut self, script: &str) -> Result<u64, AttemptError> {
        let floor_error = |why: String| AttemptError::Floor(why);
        let (path, argv) = shell(script);
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| floor_error(format!("cannot make a pipe: {e}")))?;
        let spawned = self
            .procs
            .spawn(Spawn {
                program: &path,
                argv: &argv,
                env: &self.env,
                stdout: Some(&writer),
                terminal: false,
            })
            .await;
        drop(writer);
        let mut unit = spawned.map_err(|e| floor_error(format!("cannot start it: {e}")))?;
        let mut output = tokio::net::unix::pipe::Receiver::from_owned_fd(reader)
            .map_err(|e| floor_error(format!("cannot read its output: {e}")))?;
        let ttl = self.spec.timing.ttl;
        let deadline = Instant::now() + ttl;
        let mut printed = Vec::new();
        let mut buf = [0u8; 1024];
        let mut eof = false;
        let mut code = None;
        let finished = loop {
            if code.is_some() && eof {
                break Ok(());
            }
            self.health.metrics_handle().beat();
            tokio::select! {
                biased;
                event = self.events.recv() => if stops(event) {
                    break Err(AttemptError::Stopped);
                },
                read = output.read(&mut buf), if !eof => match read {
                    Ok(0) | Err(_) => eof = true,
                    // Enough for any number; the rest is not kept.
                    Ok(n) => printed.extend_from_slice(&buf[..n.min(4096 - printed.len().min(4096))]),
                },
                event = unit.next(), if code.is_none() => {
                    if let UnitEvent::Exited(status) = event {
                        code = Some(status);
                    }
                }
                () = sleep_until(deadline) => {
                    break Err(floor_error(format!("it did not finish within {}", show(ttl))));
                }
            }
        };
        // A hook's processes do not outlive it.
        unit.kill();
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while unit.next().await != UnitEvent::Empty {}
        })
        .await;
        finished?;
        let text = String::from_utf8_lossy(&printed);
        let shown: String = text.trim().chars().take(200).collect();
        match code {
            Some(0) => text.trim().parse::<u64>().map_err(|_| {
                floor_error(format!(
                    "it printed {shown:?}, which is not a non-negative integer"
                ))
            }),
            code => Err(floor_error(format!(
                "it exited with status {} and printed {shown:?}",
                code.unwrap_or(Exit::INTERNAL)
            ))),
        }
    }
}
