//! The followers' line on Redis: each follower waits in `BLPOP` on the line
//! key, on a connection of its own; a release pushes one wake, which Redis
//! gives to the follower that has waited longest. One replica wakes, not
//! all of them.
//!
//! Where a release may hand the lease straight to a follower, the follower
//! sends its acquisition attempt right behind its `BLPOP`, on the same
//! connection. Redis runs a blocked client's next command the moment the
//! wake is served, so the acquisition happens at the release, and both
//! answers come back together: no round trip between the wake and the
//! follower's command. The attempt also runs when the `BLPOP` times out,
//! which makes it the follower's heartbeat; its answer is kept for the
//! campaign's next attempt (`Acquirer::take_kept`). An attempt takes
//! nothing for a replica that has moved on (acquire.lua).
//!
//! The wait is a task, never cancelled by a follower's wait that ends (a
//! wake it took would be lost); it is aborted when this replica leads, which
//! closes its connection and so its place, so the wake of its own next
//! release goes to a follower. After an acquisition it sends nothing until
//! the campaign waits again: the lease is this replica's, and the
//! connection, idle and out of line, is kept for the term's release
//! (`take_kept`, and the Redis backend's `release_once`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Value;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::acquisition::{Acquirer, Answer, Reply, Request};
use super::connection::{Conn, Target};
use crate::backend::Attempt;

/// How long a plain `BLPOP` blocks before it asks again: a socket that died
/// without a reset is noticed within this (plus a call timeout).
const BLOCK: Duration = Duration::from_secs(5);

pub struct Line {
    key: String,
    target: Target,
    call_timeout: Duration,
    /// Sends an attempt behind each `BLPOP`, and blocks for `block`.
    behind: Option<Arc<Acquirer>>,
    block: Duration,
    task: Mutex<Option<JoinHandle<()>>>,
    /// The task waits in `BLPOP` now: a release would wake this replica.
    waiting: AtomicBool,
    /// Signalled by the task: a wake was taken, an attempt behind the line
    /// acquired, or the place is new (a release may have come while there
    /// was none).
    woken: Notify,
    /// The campaign waits for a wake: cleared by an acquisition behind the
    /// line, set by the campaign's next wait.
    armed: AtomicBool,
    arm: Notify,
    /// The connection of the last acquisition behind the line, idle since:
    /// set at that acquisition, dropped when the campaign waits again, taken
    /// by the term's release (`take_kept`).
    kept: Mutex<Option<Conn>>,
    /// The server lets this user turn its replies off (`CLIENT REPLY`).
    quiet: AtomicBool,
}

impl Line {
    /// A line whose followers only wait (`behind`: none), or send an
    /// attempt behind each `BLPOP`. Such an attempt's acquisition is counted
    /// from its send, so the `BLPOP` blocks for less than half a ttl
    /// (`Acquirer::take_kept`), and its runs, every block, are the
    /// follower's heartbeat.
    pub fn new(
        key: String,
        target: Target,
        call_timeout: Duration,
        behind: Option<(Arc<Acquirer>, Duration)>,
    ) -> Line {
        let block = match &behind {
            // Redis ends a block up to 100 ms late (its timer's tick).
            Some((_, ttl)) => (*ttl / 2)
                .saturating_sub(Duration::from_millis(250))
                .max(*ttl / 4)
                .min(BLOCK),
            None => BLOCK,
        };
        Line {
            key,
            target,
            call_timeout,
            behind: behind.map(|(acquirer, _)| acquirer),
            block,
            task: Mutex::new(None),
            waiting: AtomicBool::new(false),
            woken: Notify::new(),
            armed: AtomicBool::new(false),
            arm: Notify::new(),
            kept: Mutex::new(None),
            quiet: AtomicBool::new(false),
        }
    }

    /// Waits for a wake from the line; takes a place first if this replica
    /// has none.
    pub async fn wait(self: &Arc<Self>) {
        // Following again: the connection is the line's (or the term that
        // began with it ended without its release).
        self.kept.lock().unwrap().take();
        self.armed.store(true, Ordering::SeqCst);
        self.arm.notify_one();
        {
            let mut task = self.task.lock().unwrap();
            if task.as_ref().is_none_or(|t| t.is_finished()) {
                *task = Some(tokio::spawn(queue(self.clone())));
            }
        }
        self.woken.notified().await;
    }

    /// Gives up this replica's place (it leads now, or exits). A connection
    /// idle after an acquisition holds no place: it stays kept.
    pub fn leave(&self) {
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        self.set_waiting(false);
        self.armed.store(false, Ordering::SeqCst);
    }

    /// The connection of the acquisition behind the line that began this
    /// term, idle since (nothing is in flight on it), where this user may
    /// turn its replies off.
    pub fn take_kept(&self) -> Option<Conn> {
        let kept = self.kept.lock().unwrap().take();
        kept.filter(|_| self.quiet.load(Ordering::SeqCst))
    }

    /// Whether this replica waits in line now.
    pub fn waiting(&self) -> bool {
        self.waiting.load(Ordering::SeqCst)
    }

    fn set_waiting(&self, waiting: bool) {
        self.waiting.store(waiting, Ordering::SeqCst);
    }

    /// `BLPOP`'s timeout: seconds with a fraction (Redis 6 and later), or
    /// whole seconds, at least one (Redis 5).
    fn timeout_arg(&self, whole_seconds: bool) -> String {
        if whole_seconds {
            self.block.as_secs().max(1).to_string()
        } else {
            format!("{:.3}", self.block.as_secs_f64())
        }
    }
}

/// What one turn in line brought.
struct Turn {
    /// A wake was taken.
    popped: bool,
    /// The connection failed (or `BLPOP` was refused): make a new one.
    failed: bool,
    /// The server takes only whole seconds for `BLPOP`'s timeout.
    whole_seconds: bool,
}

/// The line task: waits in `BLPOP` on its own connection, made again after
/// an error, and passes on every wake it takes. Failures back off (up to
/// 2 s), also when the connection is made but `BLPOP` is refused (an ACL
/// without it), so a broken line never spins.
async fn queue(line: Arc<Line>) {
    let response_timeout = line.block + line.call_timeout;
    let mut failures: u64 = 0;
    let mut whole_seconds = false;
    loop {
        if failures > 0 {
            tokio::time::sleep(Duration::from_millis(100 * failures.min(20))).await;
        }
        failures += 1;
        let connect = line.target.connect(line.call_timeout, response_timeout);
        let Ok(Ok(mut connection)) = tokio::time::timeout(line.call_timeout, connect).await else {
            continue;
        };
        let server = match &line.behind {
            Some(acquirer) => server_of(&line, &mut connection, acquirer).await,
            None => None,
        };
        // A new place in line: a release may have come while there was none.
        line.set_waiting(true);
        line.woken.notify_one();
        loop {
            if line.behind.is_some() && !line.armed.load(Ordering::SeqCst) {
                // This replica acquired: nothing more is sent until the
                // campaign waits again (or leads, which ends this task).
                line.set_waiting(false);
                while !line.armed.load(Ordering::SeqCst) {
                    line.arm.notified().await;
                }
                line.set_waiting(true);
            }
            let server = server.as_ref().map(|(run_id, at)| (run_id.as_str(), *at));
            let turn = turn(&line, &mut connection, server, whole_seconds).await;
            whole_seconds |= turn.whole_seconds;
            if turn.popped {
                failures = 0;
                line.woken.notify_one();
                // Let the attempt go out before this replica queues again.
                tokio::task::yield_now().await;
            } else if !turn.failed {
                failures = 0;
            }
            if turn.failed {
                line.set_waiting(false);
                break;
            }
        }
    }
}

/// The run id of the one server a connection goes to, and from when it has
/// been up for a ttl, as it says (`INFO server`); None on a cluster, whose
/// connection follows a slot from node to node. Asked with it (no round
/// trip more): whether this user may turn replies off (`CLIENT REPLY`), for
/// the term's release (`take_kept`).
async fn server_of(
    line: &Line,
    connection: &mut Conn,
    acquirer: &Acquirer,
) -> Option<(String, Instant)> {
    let Conn::Server(server) = connection else {
        return None;
    };
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    pipe.cmd("INFO").arg("server");
    pipe.cmd("CLIENT").arg("REPLY").arg("ON");
    let replies: Vec<Value> = pipe.query_async(server).await.ok()?;
    // The server wrote its uptime before this moment.
    let answered = Instant::now();
    let mut replies = replies.into_iter();
    let text: String = redis::from_redis_value(replies.next()?).ok()?;
    line.quiet.store(
        matches!(replies.next(), Some(Value::Okay)),
        Ordering::SeqCst,
    );
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .map(|value| value.trim().to_owned())
    };
    let run_id = field("run_id:")?;
    let uptime: u64 = field("uptime_in_seconds:")?.parse().ok()?;
    let left = acquirer.ttl_secs().saturating_sub(uptime);
    Some((run_id, answered + Duration::from_secs(left)))
}

/// One `BLPOP`, with an attempt behind it where the line sends one (on a
/// connection to `server`, if known).
async fn turn(
    line: &Line,
    connection: &mut Conn,
    server: Option<(&str, Instant)>,
    whole_seconds: bool,
) -> Turn {
    let behind = line.behind.as_ref().and_then(|acquirer| {
        let attempt = acquirer.current_attempt()?;
        // Held off here: nothing to send.
        let request = acquirer.request(attempt, Some(server)).ok()?;
        Some((acquirer, attempt, request))
    });
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    pipe.cmd("BLPOP")
        .arg(&line.key)
        .arg(line.timeout_arg(whole_seconds));
    if let Some((acquirer, _, request)) = &behind {
        pipe.cmd("EVALSHA")
            .arg(acquirer.script.get_hash())
            .arg(acquirer.keys.len())
            .arg(&acquirer.keys[..])
            .arg(&request.args[..]);
    }
    let sent_at = Instant::now();
    let replies: redis::RedisResult<Vec<Value>> = pipe.query_async(connection).await;
    let mut replies = match replies {
        Ok(replies) => replies.into_iter(),
        Err(error) => {
            tracing::debug!(error = %error, "the follower's line connection failed");
            return Turn {
                popped: false,
                failed: true,
                whole_seconds: false,
            };
        }
    };
    let popped = replies.next();
    if let (Some((acquirer, attempt, request)), Some(reply)) = (behind, replies.next()) {
        take_answer(
            line, connection, acquirer, attempt, &request, sent_at, reply,
        )
        .await;
    }
    match popped {
        Some(Value::Nil) => Turn {
            popped: false,
            failed: false,
            whole_seconds: false,
        },
        Some(Value::ServerError(error)) => {
            let text = error.details().unwrap_or_default();
            // Redis 5 takes whole seconds only.
            let whole_seconds = text.contains("timeout is not an integer");
            tracing::debug!(error = %error.code(), details = text, "the follower's BLPOP failed");
            Turn {
                popped: false,
                failed: !whole_seconds,
                whole_seconds,
            }
        }
        Some(_) => Turn {
            popped: true,
            failed: false,
            whole_seconds: false,
        },
        None => Turn {
            popped: false,
            failed: true,
            whole_seconds: false,
        },
    }
}

/// Reads the reply to the attempt sent behind the `BLPOP` at `sent_at`:
/// its answer is kept for the campaign, which an acquisition wakes.
async fn take_answer(
    line: &Line,
    connection: &mut Conn,
    acquirer: &Acquirer,
    attempt: u64,
    request: &Request,
    sent_at: Instant,
    reply: Value,
) {
    let reply = match reply {
        Value::ServerError(error) if error.code() == "NOSCRIPT" => {
            // The server forgot the script (a restart of its cache): load it
            // for the next turn.
            let _ = acquirer.script.load_async(connection).await;
            return;
        }
        Value::ServerError(error) => {
            // The campaign's own attempt meets it too, and says so.
            tracing::debug!(error = %error.details().unwrap_or(error.code()), "an attempt behind the line failed");
            return;
        }
        reply => redis::from_redis_value::<Reply>(reply),
    };
    let answer = match reply.map(|reply| acquirer.answer(reply, request)) {
        Ok(Ok(Answer::Attempt(answer))) => answer,
        Ok(Ok(Answer::Declined)) => return,
        Ok(Err(fatal)) => {
            tracing::debug!(error = %fatal, "an attempt behind the line was refused");
            return;
        }
        Err(error) => {
            tracing::debug!(error = %error, "an attempt behind the line answered oddly");
            return;
        }
    };
    let acquired = matches!(answer, Attempt::Acquired { .. });
    acquirer.keep(attempt, sent_at, answer);
    if acquired {
        // Idle from now on, until the campaign waits again.
        *line.kept.lock().unwrap() = Some(connection.clone());
        line.armed.store(false, Ordering::SeqCst);
        line.woken.notify_one();
    }
}
