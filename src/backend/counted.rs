//! Counting backend calls, as a layer around any lease store: what an idle
//! follower or a leader costs its backend, for `/metrics` and the benchmark.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;

use super::{Attempt, Call, Fatal, LeaseStore, Observation, RenewError, Unreachable};

/// A lease store whose every call is counted (waits for notices are not
/// calls).
pub struct Counted {
    inner: Arc<dyn LeaseStore>,
    calls: Counter,
}

impl Counted {
    pub fn wrap(inner: Arc<dyn LeaseStore>, calls: Counter) -> Arc<dyn LeaseStore> {
        Arc::new(Counted { inner, calls })
    }

    fn count(&self) {
        self.calls.inc();
    }
}

impl LeaseStore for Counted {
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        self.count();
        self.inner.check()
    }

    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        self.count();
        self.inner.acquire(attempt)
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        self.count();
        self.inner.renew(token)
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        self.count();
        self.inner.release(token)
    }

    fn release_last(&self, token: u64) -> Call<'_, bool> {
        self.count();
        self.inner.release_last(token)
    }

    fn advance_fence(&self, floor: u64) -> Call<'_, u64> {
        self.count();
        self.inner.advance_fence(floor)
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        self.count();
        self.inner.heartbeat()
    }

    fn withdraw(&self) -> Call<'_, ()> {
        self.count();
        self.inner.withdraw()
    }

    fn observe(&self) -> Call<'_, Observation> {
        self.count();
        self.inner.observe()
    }

    fn notice(&self) -> BoxFuture<'_, ()> {
        self.inner.notice()
    }

    fn leading(&self) {
        self.inner.leading();
    }

    fn wakes_on_release(&self) -> bool {
        self.inner.wakes_on_release()
    }

    fn release_wakes_one(&self) -> bool {
        self.inner.release_wakes_one()
    }

    fn acquired_since(&self) -> Option<std::time::Instant> {
        self.inner.acquired_since()
    }

    fn keep_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.inner.keep_fds()
    }
}
