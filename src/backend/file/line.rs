//! The followers' line. Of the replicas waiting for a lease, one at a time,
//! the head, watches the lease file and attempts when it changes; each of
//! the others has a thread blocked in the kernel on the line byte, which the
//! kernel grants to one of them when the head leaves it (it acquired the
//! lease, or exited, or died). A release thus wakes one process: with 100
//! followers, the herd that answered every release was what delayed the
//! winner's child. Followers still poll at campaign_every and at a lease's
//! known expiry, so a stuck head slows handover to that, never stops it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use super::lease::Shared;
use super::lock::{self, LINE_AT};

#[derive(Default)]
pub struct Line {
    state: Mutex<Place>,
    changed: Condvar,
    /// Signalled when this replica becomes the head.
    pub head: tokio::sync::Notify,
}

/// This replica's place in the line.
#[derive(Default)]
struct Place {
    /// The replica follows (wants a place); false while it leads.
    following: bool,
    /// The line thread runs (it is started once, on the first wait).
    queuing: bool,
    /// The line thread holds the line byte: this replica is the head.
    head: bool,
    /// How many times the replica left the line: a head gives the byte up
    /// even if it follows again before its thread sees it had left.
    left: u64,
}

impl Line {
    /// Joins the line (the thread queues while following). Returns whether
    /// this replica is the head.
    pub fn follow(self: &Arc<Self>, shared: &Arc<Shared>) -> bool {
        let mut place = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !place.following {
            place.following = true;
            self.changed.notify_all();
        }
        if !place.queuing {
            place.queuing = true;
            let (line, shared) = (self.clone(), shared.clone());
            let spawned = std::thread::Builder::new()
                .name("leaderrun-line".into())
                .spawn(move || line.queue(&shared));
            if let Err(e) = spawned {
                // Without a place in line, watch like a head: more wake-ups,
                // nothing missed.
                warn!(error = %e, "cannot queue for the lease; watching it directly");
                place.head = true;
            }
        }
        place.head
    }

    /// Whether this replica waits in line (at its head or behind it).
    pub fn waiting(&self) -> bool {
        let place = self.state.lock().unwrap_or_else(|e| e.into_inner());
        place.following && place.queuing
    }

    /// Leaves the line (this replica leads now): the thread lets the next
    /// follower have the head's place. Idempotent: called again (before a
    /// release) it wakes nothing, so the thread does not compete with the
    /// release for the CPU.
    pub fn leave(&self) {
        let mut place = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if place.following {
            place.following = false;
            place.left += 1;
            self.changed.notify_all();
        }
    }

    /// The line thread: waits for the line byte while following, holds it as
    /// head until this replica stops following, and queues again.
    fn queue(&self, shared: &Shared) {
        loop {
            let mut place = self.state.lock().unwrap_or_else(|e| e.into_inner());
            while !place.following {
                place = self.changed.wait(place).unwrap_or_else(|e| e.into_inner());
            }
            drop(place);
            // Opened for each turn, so a replaced lease file is queued on as
            // it is now; close-on-exec like every descriptor here.
            let turn = shared
                .open_lease_file()
                .and_then(|file| lock::lock_waiting(&file, LINE_AT).map(|()| file));
            let mut place = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let Ok(turn) = turn.inspect_err(|e| {
                warn!(error = %e, "cannot queue for the lease; watching it directly");
            }) else {
                place.head = true;
                self.head.notify_one();
                return;
            };
            if place.following {
                place.head = true;
                self.head.notify_one();
                let left = place.left;
                while place.following && place.left == left {
                    place = self.changed.wait(place).unwrap_or_else(|e| e.into_inner());
                }
                place.head = false;
                drop(place);
                hand_on(&turn);
            }
            // Dropping `turn` closes it and gives the byte to the next.
        }
    }
}

/// How long a head that left waits for the next follower to take the line
/// byte before it may queue again.
const HAND_ON: Duration = Duration::from_millis(20);

/// Gives the line byte to the next follower: the kernel wakes every waiter
/// at the unlock and the first to run takes it, which may be this replica's
/// own thread queuing again at once (a replica passing on a wake it cannot
/// use rejoins the line right after). It waits until another holds the
/// byte, so it queues behind them.
fn hand_on(turn: &std::fs::File) {
    lock::unlock(turn, LINE_AT);
    let until = Instant::now() + HAND_ON;
    while Instant::now() < until {
        if !matches!(lock::held_elsewhere(turn, LINE_AT), Ok(false)) {
            return;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}
