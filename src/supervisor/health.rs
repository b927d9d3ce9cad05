//! Rate-limited reporting of "could not ask the backend", and the backoff
//! between attempts while it lasts.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::backend::Unreachable;
use crate::metrics::Metrics;
use crate::timing::show;

/// At most one warning per this while the backend stays unreachable.
const WARN_EVERY: Duration = Duration::from_secs(10);

pub struct Health {
    down_since: Option<Instant>,
    last_warning: Option<Instant>,
    failures: u64,
    /// A call reached the backend at least once.
    pub answered: bool,
    metrics: Arc<Metrics>,
}

impl Health {
    pub fn new(metrics: Arc<Metrics>) -> Health {
        Health {
            down_since: None,
            last_warning: None,
            failures: 0,
            answered: false,
            metrics,
        }
    }

    /// The metrics, as a handle that outlives a borrow of this.
    pub fn metrics_handle(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    pub fn unreachable(&mut self, error: &Unreachable) {
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

    pub fn reachable(&mut self) {
        self.answered = true;
        if let Some(since) = self.down_since.take() {
            info!(down_for = %show(Instant::now() - since), failures = self.failures, "backend reachable again");
            self.failures = 0;
            self.last_warning = None;
        }
    }

    /// Whether the last call reached the backend.
    pub fn up(&self) -> bool {
        self.answered && self.down_since.is_none()
    }
}

/// The delay before attempt `failures + 1` against an unreachable backend:
/// doubling from campaign_every, capped at 5 s (or campaign_every if longer).
pub fn backoff(campaign_every: Duration, failures: u32) -> Duration {
    let cap = campaign_every.max(Duration::from_secs(5));
    campaign_every
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(cap)
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
