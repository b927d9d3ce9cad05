//! The call timeout, as a layer around any lease store: every call is
//! bounded here, in one place, so no backend and no caller can forget it. A
//! call that times out is "could not ask", never "lost"; the supervisor's
//! deadlines never wait on it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::error::TimedOut;
use super::{Attempt, Call, Fatal, LeaseStore, Observation, RenewError, Unreachable};

/// A lease store whose every call gives up after `call_timeout`.
pub struct Bounded {
    inner: Arc<dyn LeaseStore>,
    call_timeout: Duration,
}

impl Bounded {
    pub fn wrap(inner: Arc<dyn LeaseStore>, call_timeout: Duration) -> Arc<dyn LeaseStore> {
        Arc::new(Bounded {
            inner,
            call_timeout,
        })
    }
}

async fn bounded<T, E: TimedOut>(
    after: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    tokio::time::timeout(after, call)
        .await
        .unwrap_or_else(|_| Err(E::timed_out(after)))
}

impl LeaseStore for Bounded {
    fn check(&self) -> BoxFuture<'_, Result<Option<Unreachable>, Fatal>> {
        Box::pin(async move {
            tokio::time::timeout(self.call_timeout, self.inner.check())
                .await
                .unwrap_or(Ok(Some(Unreachable::Timeout(self.call_timeout))))
        })
    }

    fn acquire(&self, attempt: u64) -> Call<'_, Attempt> {
        Box::pin(bounded(self.call_timeout, self.inner.acquire(attempt)))
    }

    fn renew(&self, token: u64) -> BoxFuture<'_, Result<(), RenewError>> {
        Box::pin(bounded(self.call_timeout, self.inner.renew(token)))
    }

    fn release(&self, token: u64) -> Call<'_, bool> {
        Box::pin(bounded(self.call_timeout, self.inner.release(token)))
    }

    fn release_last(&self, token: u64) -> Call<'_, bool> {
        Box::pin(bounded(self.call_timeout, self.inner.release_last(token)))
    }

    fn advance_fence(&self, floor: u64) -> Call<'_, u64> {
        Box::pin(bounded(self.call_timeout, self.inner.advance_fence(floor)))
    }

    fn heartbeat(&self) -> Call<'_, ()> {
        Box::pin(bounded(self.call_timeout, self.inner.heartbeat()))
    }

    fn withdraw(&self) -> Call<'_, ()> {
        Box::pin(bounded(self.call_timeout, self.inner.withdraw()))
    }

    fn observe(&self) -> Call<'_, Observation> {
        Box::pin(bounded(self.call_timeout, self.inner.observe()))
    }

    fn notice(&self) -> BoxFuture<'_, ()> {
        // Not a call: a wait, as long as the caller wants.
        self.inner.notice()
    }

    fn leading(&self) {
        self.inner.leading();
    }

    fn keep_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.inner.keep_fds()
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
}
