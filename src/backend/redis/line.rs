//! The followers' line on Redis: each follower waits in `BLPOP` on the line
//! key, on a connection of its own; a release pushes one wake, which Redis
//! gives to the follower that has waited longest. One replica wakes, not
//! all of them.
//!
//! The wait is a task, never cancelled by a follower's wait that ends (a
//! wake it took would be lost); it is aborted when this replica leads, which
//! closes its connection and so its place, so the wake of its own next
//! release goes to a follower.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::connection::Target;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// How long a `BLPOP` blocks before it asks again: a socket that died
/// without a reset is noticed within this (plus a call timeout).
const BLOCK_SECS: u64 = 5;

pub struct Line {
    key: String,
    target: Target,
    call_timeout: Duration,
    task: Mutex<Option<JoinHandle<()>>>,
    /// The task waits in `BLPOP` now: a release would wake this replica.
    waiting: std::sync::atomic::AtomicBool,
    /// Signalled by the task: a wake was taken, or the place is new (a
    /// release may have come while there was none).
    woken: Notify,
}

impl Line {
    pub fn new(key: String, target: Target, call_timeout: Duration) -> Line {
        Line {
            key,
            target,
            call_timeout,
            task: Mutex::new(None),
            waiting: std::sync::atomic::AtomicBool::new(false),
            woken: Notify::new(),
        }
    }

    /// Waits for a wake from the line; takes a place first if this replica
    /// has none.
    pub async fn wait(self: &Arc<Self>) {
        {
            let mut task = self.task.lock().unwrap();
            if task.as_ref().is_none_or(|t| t.is_finished()) {
                *task = Some(tokio::spawn(queue(self.clone())));
            }
        }
        self.woken.notified().await;
    }

    /// Gives up this replica's place (it leads now).
    pub fn leave(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        self.set_waiting(false);
    }

    /// Whether this replica waits in line now.
    pub fn waiting(&self) -> bool {
        self.waiting.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn set_waiting(&self, waiting: bool) {
        self.waiting
            .store(waiting, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The line task: waits in `BLPOP` on its own connection, made again after
/// an error, and passes on every wake it takes. Failures back off (up to
/// 2 s), also when the connection is made but `BLPOP` is refused (an ACL
/// without it), so a broken line never spins.
async fn queue(line: Arc<Line>) {
    let response_timeout = Duration::from_secs(BLOCK_SECS) + line.call_timeout;
    let mut failures: u64 = 0;
    loop {
        if failures > 0 {
            tokio::time::sleep(Duration::from_millis(100 * failures.min(20))).await;
        }
        failures += 1;
        let connect = line.target.connect(line.call_timeout, response_timeout);
        let Ok(Ok(mut connection)) = tokio::time::timeout(line.call_timeout, connect).await else {
            continue;
        };
        // A new place in line: a release may have come while there was none.
        line.set_waiting(true);
        line.woken.notify_one();
        loop {
            let popped: redis::RedisResult<Option<(String, String)>> = redis::cmd("BLPOP")
                .arg(&line.key)
                .arg(BLOCK_SECS)
                .query_async(&mut connection)
                .await;
            match popped {
                Ok(Some(_)) => {
                    failures = 0;
                    line.woken.notify_one();
                    // Let the attempt go out before this replica queues again.
                    tokio::task::yield_now().await;
                }
                // Timed out: the connection is alive; wait again.
                Ok(None) => failures = 0,
                Err(error) => {
                    tracing::debug!(error = %error, "the follower's line connection failed");
                    line.set_waiting(false);
                    break;
                }
            }
        }
    }
}
