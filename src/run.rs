//! Running leaderrun: from the parsed command line to an exit status. Sets
//! the process up (containment, guard, subreaper, runtime, signals), opens
//! the lease, and runs the supervisor beside the host's signal loop.

use std::convert::Infallible;
use std::rc::Rc;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tracing::{info, warn};

use crate::backend::{Counted, Fatal, Identity, LeaseConfig, LeaseStore};
use crate::cli::RunArgs;
use crate::error::{ConfigError, Exit};
use crate::log;
use crate::metrics::{self, Metrics};
use crate::process::{self, Containment, Guard, Host};
use crate::shard;
use crate::signals::{SignalEvent, Signals};
use crate::spec::{KeySource, Spec};
use crate::supervisor::{EarlyCheck, Health, HostEvent, LeaseSpec, Supervisor};

/// How a run fails before it has an exit status of its own to give.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// Exit 2: the operator's input or environment is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The backend refused for good (exit 2, 65 or 70, by kind).
    #[error(transparent)]
    Fatal(#[from] Fatal),
    /// Exit 70.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Config(_) => Exit::USAGE,
            Failure::Fatal(fatal) => fatal.exit_code(),
            Failure::Internal(_) => Exit::INTERNAL,
        }
    }
}

/// Starts the store's startup check and returns once its first requests
/// are likely out: a few turns of the runtime, each of which polls the
/// sockets (a connection on the loopback is up by the second). Whatever is
/// left of it goes on when the runtime next runs.
async fn start_check(store: Store) -> EarlyCheck {
    let check = tokio::spawn(async move { store.check().await });
    for _ in 0..EARLY_TURNS {
        tokio::task::yield_now().await;
    }
    check
}

/// The runtime's turns `start_check` gives the check.
const EARLY_TURNS: usize = 6;

/// `leaderrun [OPTIONS] --key KEY -- COMMAND...`
pub fn run(args: RunArgs, key_source: KeySource) -> Result<Exit, Failure> {
    let log_args = args.lease.log.clone();
    let spec = Spec::from_args(args, key_source)?;
    log::init(
        &log_args,
        vec![("key", spec.key.clone()), ("owner", spec.owner.clone())],
    )?;
    // Checked before campaigning: a command that cannot run takes no lease.
    let program = match process::resolve(&spec.command[0]) {
        Ok(program) => program,
        Err(e) => {
            eprintln!("leaderrun: error: {e}");
            return Ok(Exit::Child(e.exit_code()));
        }
    };
    if spec.require_fence_advance {
        spec.backend
            .capabilities()
            .require_fence_advance(spec.backend.as_ref())?;
    }
    let leases = open(&spec, Identity::new(&spec.owner))?;
    // A current-thread runtime on the main thread: every process is spawned
    // from this thread, which lives as long as leaderrun (see spawn.rs).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(4)
        .build()
        .context("cannot start the runtime")?;
    // The backend's first round trip goes out now; its replies wait in the
    // sockets while the containment and the guard are set up.
    let early_check = match &leases {
        Leases::One(store, ..) => Some(runtime.block_on(start_check(store.clone()))),
        Leases::Shards(_) => None,
    };
    // The keeper is this very binary, run again: /proc/self/exe names it
    // even if the file was replaced since.
    let containment = Containment::choose(spec.containment, "/proc/self/exe".into())?;
    // As PID 1 the guard is not needed: the kernel kills the whole
    // namespace with us.
    let guard: Option<Guard> = if std::process::id() == 1 {
        None
    } else {
        Guard::start(containment.cgroups(), &leases.guarded(), leases.identity())
            .inspect_err(|e| warn!(error = %e, "cannot start the guard process; a term's processes may outlive a killed leaderrun"))
            .ok()
    };
    let guarded = guard.is_some();
    if let Err(e) = process::become_subreaper() {
        warn!(error = %e, "cannot become a child subreaper; orphans of a term are reaped by init");
    }
    let exit = runtime.block_on(async {
        let signals = Signals::register().context("cannot register signal handlers")?;
        if let Some(address) = &spec.metrics_addr {
            metrics::serve(address, leases.served_metrics())?;
        }
        info!(backend = %spec.backend, containment = %containment.describe(), "starting");
        let host = Host::new(containment.clone(), guard);
        let (events, receiver) = unbounded_channel();
        let lease = LeaseSpec {
            key: spec.key.clone(),
            owner: spec.owner.clone(),
            timing: spec.timing,
            token_env: spec.token_env.clone(),
            yield_signal: spec.yield_signal,
            wait: spec.wait,
            hold_for: spec.hold_for,
            fence_floor_cmd: spec.fence_floor_cmd.clone(),
            claim_cmd: spec.claim_cmd.clone(),
            program,
            argv: spec.command.clone(),
            extra_env: Vec::new(),
            hidden_env: spec
                .backend
                .secret_env()
                .iter()
                .map(|name| name.to_string())
                .collect(),
        };
        match leases {
            Leases::One(store, metrics, _) => {
                let mut supervisor =
                    Supervisor::new(lease, store, host.clone(), receiver, Health::new(metrics));
                if let Some(check) = early_check {
                    supervisor = supervisor.checked_by(check);
                }
                tokio::select! {
                    ended = supervisor.run() => Ok::<_, Failure>(ended?),
                    never = serve_signals(host, signals, vec![events]) => match never {},
                }
            }
            Leases::Shards(shards) => {
                drop(receiver);
                let (senders, run) = shard::lead(shards, lease, host.clone());
                tokio::select! {
                    ended = run => Ok::<_, Failure>(ended?),
                    never = serve_signals(host, signals, senders) => match never {},
                }
            }
        }
    });
    // A backend call abandoned at its timeout may still occupy a blocking
    // thread; exiting must not wait for it.
    runtime.shutdown_background();
    // The guard removes what is left when it sees leaderrun go; without
    // one, leaderrun does it on its way out.
    if !guarded {
        containment.remove();
    }
    exit
}

/// The leases `spec` runs for, as replica `me`.
fn open(spec: &Spec, me: Identity) -> Result<Leases, Failure> {
    Ok(match spec.shards {
        None => {
            let metrics = Metrics::new(&spec.key, &spec.owner, spec.timing.longest_sleep());
            let store = Counted::wrap(
                spec.backend.lease(LeaseConfig {
                    key: spec.key.clone(),
                    me: me.clone(),
                    ttl: spec.timing.ttl,
                    call_timeout: spec.timing.call_timeout(),
                    hand_over: spec.fence_floor_cmd.is_none(),
                })?,
                metrics.backend_calls(),
            );
            Leases::One(store, metrics, me)
        }
        Some(n) => {
            if n > 256 {
                process::raise_descriptor_limit();
            }
            Leases::Shards(shard::Leases::open(
                spec.backend.as_ref(),
                &spec.key,
                me,
                n,
                &spec.timing,
            )?)
        }
    })
}

/// The guard, once leaderrun is gone (see `process::guard`): makes the
/// stores of leaderrun's command line, as leaderrun's replica, and releases
/// what ran.
pub fn stand_in(args: RunArgs, key_source: KeySource, aftermath: process::Aftermath) {
    let Ok(spec) = Spec::from_args(args, key_source) else {
        return;
    };
    let me = aftermath.replica(&spec.owner);
    if let Ok(leases) = open(&spec, me) {
        aftermath.release(leases.guarded());
    }
}

type Store = Arc<dyn LeaseStore>;

/// What a run leads: one lease, or the shards of one key.
enum Leases {
    One(Store, Arc<Metrics>, Identity),
    Shards(shard::Leases),
}

impl Leases {
    /// The stores the guard releases through, by lease number.
    fn guarded(&self) -> Vec<Store> {
        match self {
            Leases::One(store, ..) => vec![store.clone()],
            // Lease 0 is the key's own, which never has a term: its
            // membership record, withdrawn first.
            Leases::Shards(shards) => std::iter::once(shards.membership.clone())
                .chain(shards.shards.iter().cloned())
                .collect(),
        }
    }

    /// The replica these leases are run by.
    fn identity(&self) -> &Identity {
        match self {
            Leases::One(.., me) => me,
            Leases::Shards(shards) => &shards.me,
        }
    }

    /// The figures `--metrics-addr` serves.
    fn served_metrics(&self) -> Arc<Metrics> {
        match self {
            Leases::One(_, metrics, _) => metrics.clone(),
            Leases::Shards(shards) => shards.replica_metrics.clone(),
        }
    }
}

/// The host's signal loop: reaps on SIGCHLD, and passes stop and forwarded
/// signals to every lease's supervisor.
pub async fn serve_signals(
    host: Rc<Host>,
    mut signals: Signals,
    leases: Vec<UnboundedSender<HostEvent>>,
) -> Infallible {
    loop {
        let event = match signals.next().await {
            SignalEvent::ChildChanged => {
                host.reap();
                continue;
            }
            SignalEvent::Stop(signal) => HostEvent::Stop(signal),
            SignalEvent::Forward(signal) => HostEvent::Forward(signal),
        };
        for lease in &leases {
            let _ = lease.send(event);
        }
    }
}
