//! The supervisor of one lease: it campaigns for the lease, runs a term
//! while it holds it, and campaigns again or exits when the term ends.
//!
//! - `campaign.rs`: following, attempts, the fence-floor hook;
//! - `term.rs`: one term as a state machine with no I/O (SPEC §3);
//! - `driver.rs`: the `select!` loop that drives a term;
//! - `health.rs`: "backend unreachable" reporting and backoff.
//!
//! Signals reach it as `HostEvent`s from the host, which owns signals and
//! reaping for the whole process; processes go through `Processes`.

mod campaign;
pub mod driver;
mod gate;
mod health;
pub mod term;
#[cfg(test)]
mod timeline_tests;

use std::ffi::OsString;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tracing::{debug, error, info};

use self::campaign::Campaign;
pub use self::gate::Gate;
pub use self::health::Health;
use self::term::{EndReason, TermSettings};
use crate::backend::{Fatal, LeaseStore, StoreError, Unreachable};
use crate::error::Exit;
use crate::process::{ChildEnv, Processes};
use crate::timing::Timing;

/// What the host tells a supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostEvent {
    /// SIGTERM, SIGINT or SIGQUIT: end the term (or stop following) and exit.
    Stop(Signal),
    /// SIGHUP, SIGUSR1, SIGUSR2 or SIGWINCH: pass on; the term goes on.
    Forward(Signal),
    /// Shard mode: hand this shard over (the replica holds more than its
    /// share); the supervisor goes on.
    Resign,
}

/// How long to campaign before giving up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    Forever,
    /// One attempt (`--no-wait`).
    Once,
    For(Duration),
}

/// Everything one lease's supervisor needs to know.
#[derive(Debug, Clone)]
pub struct LeaseSpec {
    pub key: String,
    pub owner: String,
    pub timing: Timing,
    pub token_env: String,
    pub yield_signal: Signal,
    pub wait: Wait,
    pub hold_for: Duration,
    pub fence_floor_cmd: Option<String>,
    pub claim_cmd: Option<String>,
    /// The command, resolved, and its argv (argv[0] first).
    pub program: PathBuf,
    pub argv: Vec<OsString>,
    /// Variables the command gets besides the token, key and owner.
    pub extra_env: Vec<(String, String)>,
    /// Variables of leaderrun's environment the command does not get: the
    /// secrets the backend read (`Backend::secret_env`).
    pub hidden_env: Vec<String>,
}

pub struct Supervisor<P: Processes> {
    spec: LeaseSpec,
    store: Arc<dyn LeaseStore>,
    procs: P,
    events: UnboundedReceiver<HostEvent>,
    health: Health,
    env: ChildEnv,
    /// The acquisition attempt: a retry of one whose reply was lost keeps
    /// its number; every term uses up one.
    attempt: u64,
    /// Shard mode: this lease's shard, and the replica's share it attempts
    /// within.
    shard: Option<ShardRole>,
    /// The startup check, if it was started before the supervisor (see
    /// `EarlyCheck`).
    early_check: Option<EarlyCheck>,
}

/// The backend's startup check, started before the process is set up (the
/// containment, the guard), so that its round trip goes on meanwhile.
pub type EarlyCheck = tokio::task::JoinHandle<Result<Option<Unreachable>, Fatal>>;

/// A shard's supervisor's part in its replica's share.
struct ShardRole {
    index: u32,
    gate: Rc<Gate>,
    /// It holds a reserved slot of the gate's (for its next attempt).
    slot: bool,
    /// The change of the split (the balancer's look) it last passed a wake
    /// on for.
    passed_for: u64,
}

impl<P: Processes> Supervisor<P> {
    pub fn new(
        spec: LeaseSpec,
        store: Arc<dyn LeaseStore>,
        procs: P,
        events: UnboundedReceiver<HostEvent>,
        health: Health,
    ) -> Supervisor<P> {
        let env = ChildEnv {
            token_env: spec.token_env.clone(),
            token: None,
            key: spec.key.clone(),
            owner: spec.owner.clone(),
            extra: spec.extra_env.clone(),
            hidden: spec.hidden_env.clone(),
            inherited: Default::default(),
        };
        Supervisor {
            spec,
            store,
            procs,
            events,
            health,
            env,
            attempt: 1,
            shard: None,
            early_check: None,
        }
    }

    /// The startup check is `check`, already started.
    pub fn checked_by(mut self, check: EarlyCheck) -> Supervisor<P> {
        self.early_check = Some(check);
        self
    }

    /// Shard mode: this supervisor runs shard `shard`, attempting only with
    /// a slot of `gate`'s; it runs until stopped (a command that exits ends
    /// its term only), and its backend was checked once for all shards.
    pub fn in_shard(mut self, shard: u32, gate: Rc<Gate>) -> Supervisor<P> {
        self.shard = Some(ShardRole {
            index: shard,
            gate,
            slot: false,
            passed_for: 0,
        });
        self
    }

    /// Campaigns and leads until the command is done, a stop signal, or the
    /// wait runs out. A refusal of the backend's that no retry can fix ends
    /// it as `Err`.
    pub async fn run(mut self) -> Result<Exit, Fatal> {
        let checked = if self.shard.is_some() {
            Ok(None)
        } else {
            self.startup_check().await
        };
        match checked {
            Err(fatal) => {
                error!(error = %fatal, "the backend refused");
                return Err(fatal);
            }
            Ok(Some(exit)) => return Ok(exit),
            Ok(None) => {}
        }
        let ended = self.lifetime().await;
        // Done: the next leader may be starting its command on this host
        // now. What is left to do here (the shutdown notice, the exit) must
        // not compete with it.
        crate::process::lower_priority();
        // The shutdown notice: a replica that exits gracefully leaves the
        // candidate list at once (one that dies expires after ttl). Not
        // against a backend that does not answer: exiting must not wait.
        if self.health.up() {
            if let Err(error) = self.store.withdraw().await {
                debug!(error = %error, "cannot remove the candidate record; it expires after ttl");
            }
        }
        ended
    }

    async fn lifetime(&mut self) -> Result<Exit, Fatal> {
        let mut not_before = None;
        loop {
            info!("campaign started");
            let (token, sent_at, woke_at) = match self.campaign(not_before.take()).await {
                Campaign::Acquired {
                    token,
                    sent_at,
                    woke_at,
                } => (token, sent_at, woke_at),
                Campaign::GaveUp(exit) => return Ok(exit),
                Campaign::Stopped => return Ok(Exit::Stopped),
                Campaign::Refused(fatal) => {
                    error!(error = %fatal, "the backend refused");
                    return Err(fatal);
                }
            };
            self.attempt += 1;
            if let Some(role) = &mut self.shard {
                role.gate.term_began(role.index);
                role.slot = false;
            }
            let settings = TermSettings {
                timing: self.spec.timing,
                yield_signal: self.spec.yield_signal,
                hold_for: self.spec.hold_for,
                claim: self.spec.claim_cmd.is_some(),
                run_ends_with_command: self.shard.is_none(),
            };
            let outcome = driver::run(
                driver::TermInputs {
                    store: &self.store,
                    procs: &self.procs,
                    events: &mut self.events,
                    health: &mut self.health,
                    settings,
                    program: &self.spec.program,
                    argv: &self.spec.argv,
                    claim_cmd: self.spec.claim_cmd.as_deref(),
                    env: &self.env,
                },
                token,
                sent_at,
                woke_at,
            )
            .await;
            let end = outcome.end;
            if let Some(role) = &mut self.shard {
                // A command that exited keeps its slot for the same
                // shard's next attempt, a campaign period later.
                let again = end.reason == EndReason::ChildExited && !end.stopped;
                role.gate.term_over(role.index, again);
                role.slot = again;
                if end.stopped {
                    return Ok(Exit::Stopped);
                }
                if outcome.refused.is_none() {
                    if again || end.reason == EndReason::ClaimRefused {
                        not_before = Some(Instant::now() + self.spec.timing.campaign_every);
                    }
                    continue;
                }
            }
            if let Some(refused) = outcome.refused {
                let fatal = match refused {
                    StoreError::Fatal(fatal) => fatal,
                    StoreError::Unreachable(e) => Fatal::Internal(e.to_string()),
                };
                error!(error = %fatal, "the backend refused");
                return Err(fatal);
            }
            let once = self.spec.wait == Wait::Once;
            match (end.reason, end.code) {
                (_, None) if end.stopped => return Ok(Exit::Stopped),
                (_, Some(code)) if end.stopped => return Ok(Exit::Child(code)),
                (EndReason::ChildExited | EndReason::Stopped, code) => {
                    return Ok(code.map_or(Exit::Stopped, Exit::Child));
                }
                (_, Some(code)) if once => return Ok(Exit::Child(code)),
                (_, None) if once => return Ok(Exit::HeldElsewhere),
                (EndReason::ClaimRefused, _) => {
                    // A refused claim means this token is stale (or the store
                    // is unwell): try the next one a campaign period later,
                    // not in a tight loop.
                    not_before = Some(Instant::now() + self.spec.timing.campaign_every);
                }
                (EndReason::Deadline | EndReason::Lost | EndReason::Resigned, _) => {}
            }
        }
    }
}
