//! One acquisition attempt on Redis: the acquiring script's arguments, made
//! from what this replica knows (the highest token it has seen, the server's
//! run id, a holder whose expiry has not passed), and its answer, read back
//! into an `Attempt` while what it tells is remembered.
//!
//! Two connections send attempts: the command connection, when the campaign
//! asks, and the followers' line, which sends one behind each of its `BLPOP`s
//! so that Redis runs it the moment a release's wake is served (`line.rs`).
//! An answer the line got is kept here until the campaign asks
//! (`take_kept`); for an acquisition, the term is then counted from the
//! moment the line sent it (the server started the lease's ttl later than
//! that).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::MAX_TOKEN;
use crate::backend::{Attempt, Fatal, Holder, Identity};

const YOUNG: &str =
    "the Redis server started less than one ttl ago; waiting for a stale leader to stop";
const NEW_RUN_ID: &str =
    "the Redis server changed (new run id); waiting one ttl for a stale leader to stop";
const OTHER_HISTORY: &str = "the lease was last written on a server with another replication history (a failover to a replica that may have missed writes, or a restart); waiting one ttl for a stale leader to stop";
const VANISHED: &str = "the lease vanished before its known expiry (flushed, deleted or evicted); waiting for that expiry so its holder can stop";

/// No attempt made yet.
const NO_ATTEMPT: u64 = u64::MAX;

/// An attempt's request: the script's keys and arguments, and the holder it
/// told the server of (a `VANISHED` answer waits for that holder's expiry).
pub struct Request {
    pub args: Vec<String>,
    holder: Option<(u64, Instant)>,
}

/// The acquiring script's reply: `{code, token, text, ms}` (acquire.lua).
pub type Reply = (i64, u64, String, i64);

/// What a reply means.
pub enum Answer {
    Attempt(Attempt),
    /// Sent behind the line and declined by the script: the lease is this
    /// replica's from another attempt, or this replica has left the
    /// candidates (it is exiting). Nothing was changed.
    Declined,
}

/// An answer the line got before the campaign asked.
struct Kept {
    attempt: u64,
    /// When the line sent the attempt (behind its `BLPOP`).
    sent_at: Instant,
    received_at: Instant,
    answer: Attempt,
}

/// What one replica's acquisitions of one lease send and learn.
pub struct Acquirer {
    /// lease, counter, candidates, released, history, heldoff, line.
    pub keys: [String; 7],
    me: Identity,
    ttl: Duration,
    /// This replica's candidate record ("<since ms> <pid> <host> <owner>").
    record: String,
    pub script: Script,
    /// The highest token this replica has seen, its own or a holder's.
    highest_seen: AtomicU64,
    /// The server's run id as last seen, and until when acquisition is held
    /// off after it changed.
    server: Mutex<ServerView>,
    /// The token of the last holder seen, and when its lease expires at the
    /// latest (measured from the reply, so never before the server's).
    last_holder: Mutex<Option<(u64, Instant)>>,
    /// The attempt the campaign made last: the line's attempts are the same
    /// one (a follower keeps its attempt until it leads).
    attempt: AtomicU64,
    kept: Mutex<Option<Kept>>,
}

#[derive(Default)]
struct ServerView {
    run_id: String,
    held_off_until: Option<Instant>,
}

impl Acquirer {
    pub fn new(keys: [String; 7], me: Identity, ttl: Duration, record: String) -> Acquirer {
        Acquirer {
            keys,
            me,
            ttl,
            record,
            script: Script::new(
                &[
                    include_str!("scripts/beat.lua"),
                    include_str!("scripts/acquire.lua"),
                ]
                .concat(),
            ),
            highest_seen: AtomicU64::new(0),
            server: Mutex::new(ServerView::default()),
            last_holder: Mutex::new(None),
            attempt: AtomicU64::new(NO_ATTEMPT),
            kept: Mutex::new(None),
        }
    }

    /// Remembers a token seen on the server, so the counter is never let
    /// fall behind it.
    pub fn saw(&self, token: u64) {
        self.highest_seen.fetch_max(token, Ordering::SeqCst);
    }

    /// The request of attempt `attempt`, or the answer without asking:
    /// acquisition is held off here after the server's run id changed.
    /// `behind_line`: sent behind the line's `BLPOP`, on a connection to the
    /// server with this run id, which is known to be up for a ttl from this
    /// moment on (or None): the script need not ask the server for either.
    pub fn request(
        &self,
        attempt: u64,
        behind_line: Option<Option<(&str, Instant)>>,
    ) -> Result<Request, Attempt> {
        let known_run_id = {
            let server = self.server.lock().unwrap();
            let now = Instant::now();
            if let Some(until) = server.held_off_until.filter(|until| now < *until) {
                return Err(Attempt::HeldOff {
                    retry_in: until - now,
                    why: NEW_RUN_ID,
                });
            }
            server.run_id.clone()
        };
        let ttl_secs = self.ttl_secs();
        // The line's connection has been to one server process all along
        // (a restart breaks it): if that is the one whose run id this
        // replica knows (or it knows none yet), and it has been up for a
        // ttl, the script's own look at both is not needed.
        let known_server = behind_line.flatten().filter(|(run_id, up_for_a_ttl)| {
            (known_run_id.is_empty() || *run_id == known_run_id) && Instant::now() >= *up_for_a_ttl
        });
        let known_run_id = match known_server {
            Some((run_id, _)) => run_id.to_owned(),
            None => known_run_id,
        };
        let holder = {
            let last = *self.last_holder.lock().unwrap();
            last.filter(|(_, expires)| *expires > Instant::now())
        };
        let args = vec![
            self.me.instance.clone(),
            attempt.to_string(),
            self.me.owner.clone(),
            self.ttl.as_millis().to_string(),
            self.highest_seen.load(Ordering::SeqCst).to_string(),
            known_run_id,
            ttl_secs.to_string(),
            self.record.clone(),
            holder
                .map(|(token, _)| token.to_string())
                .unwrap_or_default(),
            MAX_TOKEN.to_string(),
            if behind_line.is_some() { "1" } else { "0" }.to_owned(),
            if known_server.is_some() { "1" } else { "0" }.to_owned(),
        ];
        Ok(Request { args, holder })
    }

    /// The ttl in whole seconds, rounded up (the unit of a server's uptime).
    pub fn ttl_secs(&self) -> u64 {
        self.ttl.as_secs() + u64::from(self.ttl.subsec_nanos() > 0)
    }

    /// Reads a reply to `request`, and remembers what it tells.
    pub fn answer(&self, reply: Reply, request: &Request) -> Result<Answer, Fatal> {
        let (code, token, text, ms) = reply;
        let remaining = Duration::from_millis(ms.max(0) as u64);
        let mut server = self.server.lock().unwrap();
        let attempt = match code {
            1 => {
                self.saw(token);
                if !text.is_empty() {
                    server.run_id = text;
                }
                *self.last_holder.lock().unwrap() = None;
                Attempt::Acquired { token }
            }
            0 => {
                self.saw(token);
                // PTTL is -1 for a key without expiry (an operator's SET).
                let expires_in = (ms >= 0).then_some(remaining);
                *self.last_holder.lock().unwrap() =
                    expires_in.map(|left| (token, Instant::now() + left));
                Attempt::Held(Holder {
                    owner: text,
                    token,
                    expires_in,
                })
            }
            2 => {
                server.run_id = text;
                Attempt::HeldOff {
                    retry_in: remaining,
                    why: YOUNG,
                }
            }
            3 => {
                // The run id changed: the data may be older than what a
                // leader was told. Hold off one ttl from now.
                server.run_id = text;
                server.held_off_until = Some(Instant::now() + self.ttl);
                Attempt::HeldOff {
                    retry_in: self.ttl,
                    why: NEW_RUN_ID,
                }
            }
            4 => {
                let until = request.holder.map_or_else(Instant::now, |(_, at)| at);
                Attempt::HeldOff {
                    retry_in: until.saturating_duration_since(Instant::now()),
                    why: VANISHED,
                }
            }
            6 => Attempt::HeldOff {
                retry_in: remaining,
                why: OTHER_HISTORY,
            },
            7 => return Ok(Answer::Declined),
            _ => {
                return Err(Fatal::CounterExhausted {
                    counter: token,
                    max: MAX_TOKEN,
                });
            }
        };
        Ok(Answer::Attempt(attempt))
    }

    /// The campaign makes attempt `attempt` now: the line's attempts are
    /// this one from now on.
    pub fn attempting(&self, attempt: u64) {
        self.attempt.store(attempt, Ordering::SeqCst);
    }

    /// The attempt the line sends behind its `BLPOP`, if the campaign made
    /// one yet.
    pub fn current_attempt(&self) -> Option<u64> {
        Some(self.attempt.load(Ordering::SeqCst)).filter(|a| *a != NO_ATTEMPT)
    }

    /// Keeps the answer the line got to an attempt it sent at `sent_at`.
    pub fn keep(&self, attempt: u64, sent_at: Instant, answer: Attempt) {
        *self.kept.lock().unwrap() = Some(Kept {
            attempt,
            sent_at,
            received_at: Instant::now(),
            answer,
        });
    }

    /// The kept answer to `attempt`, if it is recent enough to stand for an
    /// attempt made now, with, for an acquisition, when it was sent (the
    /// term is counted from then). An acquisition sent more than half a ttl
    /// ago would leave the term's first renewal too little time: the
    /// attempt is made again (the same attempt, so the same token, with a
    /// fresh ttl). Any other answer stands for half a ttl after it came,
    /// its wait shortened by the time since.
    pub fn take_kept(&self, attempt: u64) -> Option<(Attempt, Option<Instant>)> {
        let kept = self.kept.lock().unwrap().take()?;
        if kept.attempt != attempt {
            return None;
        }
        let fresh = self.ttl / 2;
        let since = kept.received_at.elapsed();
        match kept.answer {
            Attempt::Acquired { token } => (kept.sent_at.elapsed() < fresh)
                .then_some((Attempt::Acquired { token }, Some(kept.sent_at))),
            Attempt::Held(holder) => (since < fresh).then(|| {
                let expires_in = holder.expires_in.map(|left| left.saturating_sub(since));
                (
                    Attempt::Held(Holder {
                        expires_in,
                        ..holder
                    }),
                    None,
                )
            }),
            Attempt::HeldOff { retry_in, why } => (since < fresh).then(|| {
                let retry_in = retry_in.saturating_sub(since);
                (Attempt::HeldOff { retry_in, why }, None)
            }),
        }
    }

    /// Forgets a kept answer: this replica leads now.
    pub fn forget_kept(&self) {
        *self.kept.lock().unwrap() = None;
    }
}
