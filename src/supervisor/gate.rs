//! The gate of shard mode: the supervisors of one replica's shards share
//! its share of the shards (a quota, set by the balancer). A supervisor
//! attempts only with a slot: one it reserved, or its running term's. A
//! supervisor that finds no slot makes no attempts and waits for room; it
//! keeps its place in its shard's line, so a release (a replica may have
//! left) makes the balancer look again.
//!
//! Single-threaded: the supervisors and the balancer run on leaderrun's
//! current-thread runtime.

use std::cell::RefCell;
use std::collections::BTreeMap;

use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Default)]
pub struct Gate {
    state: RefCell<State>,
    /// Room may have opened (a term ended, a reservation was returned, the
    /// quota went up).
    room: Notify,
    /// A supervisor asks the balancer for a fresh look at the replicas.
    refresh: Notify,
    /// The balancer looked (see `looks`).
    looked: Notify,
}

#[derive(Default)]
struct State {
    quota: usize,
    /// Slots taken by attempts in flight (and cool-downs, see `term_over`).
    reserved: usize,
    /// Running terms: shard, and when its term began.
    terms: BTreeMap<u32, Instant>,
    /// Shards asked to hand over, whose terms have not ended yet.
    resigning: Vec<u32>,
    /// The balancer's looks so far; the last one that found the replicas
    /// counted in the split changed, and when.
    looks: u64,
    changed_at: u64,
    changed_when: Option<Instant>,
}

impl Gate {
    pub fn new() -> Gate {
        Gate::default()
    }

    /// Takes a slot for an attempt, if there is room.
    pub fn try_reserve(&self) -> bool {
        let mut state = self.state.borrow_mut();
        let room = state.reserved + state.terms.len() < state.quota;
        if room {
            state.reserved += 1;
        }
        room
    }

    /// Gives back a slot whose attempt did not acquire.
    pub fn unreserve(&self) {
        let mut state = self.state.borrow_mut();
        state.reserved = state.reserved.saturating_sub(1);
        drop(state);
        self.room.notify_waiters();
    }

    /// An attempt with a reserved slot acquired `shard`: the slot is the
    /// term's now.
    pub fn term_began(&self, shard: u32) {
        let mut state = self.state.borrow_mut();
        state.reserved = state.reserved.saturating_sub(1);
        state.terms.insert(shard, Instant::now());
    }

    /// The term of `shard` ended. With `keep_slot`, its slot stays reserved
    /// for the same shard's next attempt (a command that exited: the
    /// replica takes the shard again after a campaign period, and its other
    /// shards' supervisors do not rush for the slot meanwhile).
    pub fn term_over(&self, shard: u32, keep_slot: bool) {
        let mut state = self.state.borrow_mut();
        state.terms.remove(&shard);
        state.resigning.retain(|s| *s != shard);
        if keep_slot {
            state.reserved += 1;
        }
        drop(state);
        self.room.notify_waiters();
    }

    /// Resolves when room may have opened; the caller tries again.
    pub async fn room(&self) {
        self.room.notified().await;
    }

    /// Sets the replica's share. Returns the shards to hand over to get
    /// down to it: the terms that began last, and that are not already
    /// handing over.
    pub fn set_quota(&self, quota: usize) -> Vec<u32> {
        let mut state = self.state.borrow_mut();
        let grew = quota > state.quota;
        state.quota = quota;
        let keeping = state.terms.len() - state.resigning.len();
        let surplus = keeping.saturating_sub(quota);
        let mut newest: Vec<(Instant, u32)> = state
            .terms
            .iter()
            .filter(|(shard, _)| !state.resigning.contains(shard))
            .map(|(shard, began)| (*began, *shard))
            .collect();
        newest.sort_unstable_by(|a, b| b.cmp(a));
        let out: Vec<u32> = newest
            .into_iter()
            .take(surplus)
            .map(|(_, shard)| shard)
            .collect();
        state.resigning.extend(&out);
        drop(state);
        if grew {
            self.room.notify_waiters();
        }
        out
    }

    /// Whether this replica holds fewer shards than its share (its
    /// followers then poll every campaign period: they want a shard).
    pub fn wanting(&self) -> bool {
        let state = self.state.borrow();
        state.terms.len() < state.quota
    }

    /// A supervisor out of room was woken for its shard: the balancer should
    /// look at the replicas now (one may have left). Returns the number of
    /// looks so far, for `looked_since`.
    pub fn ask_refresh(&self) -> u64 {
        self.refresh.notify_one();
        self.state.borrow().looks
    }

    pub async fn refresh_asked(&self) {
        self.refresh.notified().await;
    }

    /// The balancer looked at the replicas; `changed`: the replicas counted
    /// in the split are not the ones counted before (one is gone, or one
    /// counts now).
    pub fn looked(&self, changed: bool) {
        let mut state = self.state.borrow_mut();
        state.looks += 1;
        if changed {
            state.changed_at = state.looks;
            state.changed_when = Some(Instant::now());
        }
        drop(state);
        self.looked.notify_waiters();
    }

    /// Resolves once the balancer has looked after look number `look`.
    pub async fn looked_since(&self, look: u64) {
        loop {
            let notified = self.looked.notified();
            if self.state.borrow().looks > look {
                return;
            }
            notified.await;
        }
    }

    /// The look that last found the counted replicas changed, if that was
    /// within `recent`: shards move then (a replica's left, or ones over
    /// their new share are handed over), and a shard's supervisor woken by
    /// a release it cannot use passes the wake on once per such change
    /// (see `campaign.rs`).
    pub fn split_changed(&self, recent: std::time::Duration) -> Option<u64> {
        let state = self.state.borrow();
        state
            .changed_when
            .is_some_and(|at| at.elapsed() < recent)
            .then_some(state.changed_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_quota_and_surplus_hands_over_the_newest_terms() {
        let gate = Gate::new();
        assert!(!gate.try_reserve(), "no quota yet");
        assert!(gate.set_quota(2).is_empty());
        assert!(gate.try_reserve());
        gate.term_began(5);
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(gate.try_reserve());
        assert!(!gate.try_reserve(), "two slots, two taken");
        gate.term_began(1);
        assert_eq!(gate.set_quota(1), vec![1], "the newest term goes");
        assert!(gate.set_quota(1).is_empty(), "asked once");
        gate.term_over(1, false);
        assert!(!gate.try_reserve());
        gate.term_over(5, true);
        assert!(!gate.try_reserve(), "the exited shard keeps its slot");
        gate.unreserve();
        assert!(gate.try_reserve());
    }
}
