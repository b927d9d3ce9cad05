//! The balancer of a replica in shard mode: it keeps the replica's
//! membership record on the key fresh, looks at the other replicas every
//! renewal period (and at once when a supervisor out of room was woken by a
//! release), sets the replica's share, and asks the supervisors of shards
//! over it to hand them over.
//!
//! Against flapping: a replica that appears after this one started counts
//! only once it has been seen for a whole renewal period, so one that joins
//! and leaves (or a record that comes and goes with a slow heartbeat) moves
//! no shard; a replica's shards move only when its record is withdrawn (a
//! graceful stop), expires (ttl after its last heartbeat), or the split says
//! the replica is over its share.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::time::{Instant, sleep};
use tracing::{debug, error, info, warn};

use super::split::{self, Share};
use crate::backend::{Identity, LeaseStore, Observation};
use crate::metrics::Metrics;
use crate::supervisor::{Gate, HostEvent};

pub struct Balancer {
    /// The key's own store: the replicas' membership records.
    pub store: Arc<dyn LeaseStore>,
    pub gate: Rc<Gate>,
    /// Each shard's supervisor, by shard.
    pub shards: Vec<UnboundedSender<HostEvent>>,
    pub events: UnboundedReceiver<HostEvent>,
    pub me: Identity,
    pub n: u32,
    /// How often it looks (the renewal period).
    pub every: Duration,
    pub metrics: Arc<Metrics>,
}

/// How long a stop waits for the membership record's removal before it
/// stops the shards anyway.
const WITHDRAW_FIRST: Duration = Duration::from_millis(300);

/// A replica by its record: host, pid, start time.
type Seen = (String, u32, u64);

impl Balancer {
    /// Runs until the shards are done; passes the host's signals on to every
    /// shard. On a stop it withdraws the membership record first, so a
    /// replica that a release of one of this replica's shards wakes sees it
    /// gone and takes the shard.
    pub async fn run(mut self) {
        let mut first_seen: HashMap<Seen, Instant> = HashMap::new();
        let mut last_settled: Option<Instant> = None;
        let mut looked = false;
        let mut last: Option<Share> = None;
        let mut beat_at: Option<Instant> = None;
        loop {
            self.metrics.beat();
            if beat_at.is_none_or(|at| at.elapsed() >= self.every / 2) {
                match self.store.heartbeat().await {
                    Ok(()) => beat_at = Some(Instant::now()),
                    Err(e) => debug!(error = %e, "cannot refresh the membership record"),
                }
            }
            match self.store.observe().await {
                Ok(seen) => {
                    let share = self.share(&seen, &mut first_seen, &mut last_settled, looked);
                    looked = true;
                    self.apply(share, &mut last);
                }
                Err(e) => {
                    warn!(error = %e, "cannot see the other replicas; the split stays as it was")
                }
            }
            tokio::select! {
                biased;
                event = self.events.recv() => match event {
                    Some(HostEvent::Stop(signal)) => {
                        self.depart(Some(signal)).await;
                        break;
                    }
                    None => {
                        self.depart(None).await;
                        break;
                    }
                    Some(event) => self.to_all(event),
                },
                () = sleep(self.every) => {}
                () = self.gate.refresh_asked() => {}
            }
        }
        // Stopping: later signals (a second stop kills at once) still reach
        // every shard.
        while let Some(event) = self.events.recv().await {
            self.to_all(event);
        }
    }

    /// A stop: the membership record goes first (within a short bound), so
    /// the replica a release of one of this replica's shards wakes sees it
    /// gone and has room; then every shard's supervisor is told.
    async fn depart(&self, signal: Option<nix::sys::signal::Signal>) {
        match tokio::time::timeout(WITHDRAW_FIRST, self.store.withdraw()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                debug!(error = %e, "cannot remove the membership record; it expires after ttl")
            }
            Err(_) => debug!(
                "the membership record is still being removed; stopping the shards meanwhile"
            ),
        }
        if let Some(signal) = signal {
            self.to_all(HostEvent::Stop(signal));
        }
    }

    fn to_all(&self, event: HostEvent) {
        for supervisor in &self.shards {
            let _ = supervisor.send(event);
        }
    }

    /// This replica's share from one look. The replicas of the first look
    /// count at once; later ones once they have been seen for `every`.
    fn share(
        &self,
        seen: &Observation,
        first_seen: &mut HashMap<Seen, Instant>,
        last_settled: &mut Option<Instant>,
        looked: bool,
    ) -> Share {
        let now = Instant::now();
        let settled = now.checked_sub(self.every).unwrap_or(now);
        let mut current = HashMap::new();
        for c in &seen.candidates {
            let id = (c.host.clone(), c.pid, c.since_ms);
            let at = match first_seen.get(&id) {
                Some(at) => *at,
                None if looked => now,
                None => settled,
            };
            current.insert(id, at);
        }
        // A replica counted before and gone now, or one that counts from
        // this look on.
        let departure = first_seen
            .iter()
            .any(|(id, at)| *at <= settled && !current.contains_key(id));
        let counts_now = current
            .values()
            .any(|at| *at <= settled && last_settled.is_some_and(|before| *at > before));
        *first_seen = current;
        *last_settled = Some(settled);
        // A join counts where a release wakes one follower: the hand-overs'
        // wakes are passed on then, as after a departure.
        self.gate
            .looked(departure || (counts_now && self.store.release_wakes_one()));
        split::share(self.n, &self.me, &seen.candidates, |c| {
            first_seen
                .get(&(c.host.clone(), c.pid, c.since_ms))
                .is_some_and(|at| *at <= settled)
        })
    }

    /// Sets the share and asks the newest terms over it to hand over.
    fn apply(&self, share: Share, last: &mut Option<Share>) {
        let changed = last.as_ref() != Some(&share);
        if changed {
            match &share.refused {
                Some(why) => error!(why = %why, "taking no shard"),
                None => info!(
                    shards = share.quota,
                    replicas = share.replicas,
                    of = self.n,
                    "share of the shards"
                ),
            }
            for other in &share.ignored {
                warn!(replica = %other, "a replica with another --shards is left out of the split; give every replica the same --shards");
            }
        }
        for shard in self.gate.set_quota(share.quota) {
            info!(shard, "handing the shard over (over this replica's share)");
            if let Some(supervisor) = self.shards.get(shard as usize) {
                let _ = supervisor.send(HostEvent::Resign);
            }
        }
        *last = Some(share);
    }
}
