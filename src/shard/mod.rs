//! Shard mode (SPEC §6a): `--shards N` runs shard `i` of `N` while this
//! replica holds its lease, each shard a lease of its own (key `K/shard/i`,
//! its own token counter) with a supervisor of its own, and the shards split
//! fairly among the replicas of the key.
//!
//! - `split.rs`: the share of one replica, from the key's records;
//! - `balancer.rs`: the membership record on the key itself, the looks at
//!   the other replicas, the hand-over of surplus shards.
//!
//! Each shard's term is a single lease's term (`supervisor`): the same
//! timeline, hooks and fencing. The supervisors attempt within the
//! replica's share (`supervisor::Gate`).

mod balancer;
mod split;

use std::rc::Rc;
use std::sync::Arc;

use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tracing::{Instrument as _, info};

use self::balancer::Balancer;
use crate::backend::{Counted, Fatal, Identity, LeaseConfig, LeaseStore};
use crate::error::{ConfigError, Exit};
use crate::metrics::Metrics;
use crate::process::{Host, LeaseHost};
use crate::supervisor::{Gate, Health, HostEvent, LeaseSpec, Supervisor};
use crate::timing::Timing;

pub use self::split::is_me;

/// The key of shard `shard` of `key`.
pub fn shard_key(key: &str, shard: u32) -> String {
    format!("{key}/shard/{shard}")
}

/// The leases of a replica in shard mode: the key's own (its membership
/// record) and each shard's (the guard, if leaderrun dies, makes them again
/// from the same command line to release a running term's lease).
pub struct Leases {
    pub membership: Arc<dyn LeaseStore>,
    pub shards: Vec<Arc<dyn LeaseStore>>,
    pub me: Identity,
    pub replica_metrics: Arc<Metrics>,
    pub shard_metrics: Vec<Arc<Metrics>>,
}

impl Leases {
    pub fn open(
        backend: &dyn crate::backend::Backend,
        key: &str,
        me: Identity,
        n: u32,
        timing: &Timing,
    ) -> Result<Leases, ConfigError> {
        let (replica_metrics, shard_metrics) =
            Metrics::sharded(key, &me.owner, timing.longest_sleep(), n);
        let me = Identity {
            shards: Some(n),
            ..me
        };
        let config = |key: String| LeaseConfig {
            key,
            me: me.clone(),
            ttl: timing.ttl,
            call_timeout: timing.call_timeout(),
            hand_over: false,
        };
        let membership = Counted::wrap(
            backend.lease(config(key.to_owned()))?,
            replica_metrics.backend_calls(),
        );
        let shards = (0..n)
            .map(|shard| {
                Ok(Counted::wrap(
                    backend.lease(config(shard_key(key, shard)))?,
                    shard_metrics[shard as usize].backend_calls(),
                ))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Leases {
            membership,
            shards,
            me,
            replica_metrics,
            shard_metrics,
        })
    }
}

/// Runs the replica's shards until a stop signal: each shard's supervisor,
/// and the balancer. Returns the sender the host's signals go to (the
/// balancer, which passes them on to every shard), and the run. A backend
/// refusal on one shard (credentials, permissions) stops every shard and is
/// the run's outcome.
pub fn lead(
    leases: Leases,
    lease: LeaseSpec,
    host: Rc<Host>,
) -> (
    Vec<UnboundedSender<HostEvent>>,
    impl std::future::Future<Output = Result<Exit, Fatal>>,
) {
    let n = leases.shards.len() as u32;
    let gate = Rc::new(Gate::new());
    let mut senders = Vec::new();
    let mut supervisors = Vec::new();
    for (shard, store) in leases.shards.into_iter().enumerate() {
        let shard = shard as u32;
        let (events, receiver) = unbounded_channel();
        senders.push(events);
        // The command's LEADERRUN_KEY is the key it was given (the shard's
        // lease is `K/shard/i`, an inner name).
        let mut spec = lease.clone();
        spec.extra_env
            .push(("LEADERRUN_SHARD".into(), shard.to_string()));
        spec.extra_env
            .push(("LEADERRUN_SHARDS".into(), n.to_string()));
        let health = Health::new(leases.shard_metrics[shard as usize].clone());
        let procs = LeaseHost {
            host: host.clone(),
            lease: shard + 1,
        };
        supervisors.push(
            Supervisor::new(spec, store, procs, receiver, health).in_shard(shard, gate.clone()),
        );
    }
    let (to_balancer, receiver) = unbounded_channel();
    let balancer = Balancer {
        store: leases.membership.clone(),
        gate,
        shards: senders.clone(),
        events: receiver,
        me: leases.me,
        n,
        every: lease.timing.renew_every,
        metrics: leases.replica_metrics,
    };
    let membership = leases.membership;
    let run = async move {
        // The backend is asked once for all shards whether it works.
        match membership.check().await {
            Err(fatal) => return Err(fatal),
            Ok(Some(why)) => {
                info!(error = %why, "the backend is unreachable; campaigning anyway")
            }
            Ok(None) => {}
        }
        info!(shards = n, "shard mode");
        let mut running: FuturesUnordered<_> = supervisors
            .into_iter()
            .enumerate()
            .map(|(shard, supervisor)| {
                supervisor
                    .run()
                    .instrument(tracing::info_span!("shard", shard))
            })
            .collect();
        let balancing = balancer.run();
        tokio::pin!(balancing);
        let mut balancer_done = false;
        let mut refused = None;
        loop {
            tokio::select! {
                () = &mut balancing, if !balancer_done => balancer_done = true,
                ended = running.next() => match ended {
                    None => break,
                    Some(Err(fatal)) => {
                        // What refused one shard refuses every shard: stop.
                        if refused.is_none() {
                            for sender in &senders {
                                let _ = sender.send(HostEvent::Stop(nix::sys::signal::Signal::SIGTERM));
                            }
                            refused = Some(fatal);
                        }
                    }
                    Some(Ok(_)) => {}
                },
            }
        }
        match refused {
            Some(fatal) => Err(fatal),
            None => Ok(Exit::Stopped),
        }
    };
    (vec![to_balancer], run)
}
