//! The term timeline's arithmetic (SPEC §3): every deadline of a term,
//! computed in one place from the instant the last successful acquire or
//! renew was *sent*.
//!
//! Measuring from the send instant, not the reply, is what makes the
//! arithmetic safe: the backend started the lease's ttl no earlier than that,
//! so `expiry` is never later than the backend's own idea of the lapse.

use std::time::Duration;

use tokio::time::Instant;

/// The durations of SPEC §2, validated against the invariant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub ttl: Duration,
    pub renew_every: Duration,
    pub campaign_every: Duration,
    pub margin: Duration,
    pub yield_grace: Duration,
    pub release_timeout: Duration,
}

/// The longest duration any option takes (a year, as humantime counts it): far beyond any sensible lease or
/// wait, and far enough below the clock's range that no deadline overflows.
pub const LONGEST: Duration = Duration::from_secs(31_557_600);

/// A timing the invariant refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    #[error("{flag} must be greater than zero (got {value})")]
    Zero { flag: &'static str, value: String },
    #[error(
        "{flag} {value} is longer than the longest duration leaderrun takes ({}); give a shorter one",
        show(LONGEST)
    )]
    TooLong { flag: &'static str, value: String },
    #[error("{}", invariant_message(.0))]
    Invariant(Timing),
}

/// Refuses a duration over `LONGEST`, naming the flag.
pub fn bounded(flag: &'static str, value: Duration) -> Result<Duration, TimingError> {
    if value > LONGEST {
        return Err(TimingError::TooLong {
            flag,
            value: show(value),
        });
    }
    Ok(value)
}

impl Timing {
    /// The defaults of SPEC §2 (clap holds the same values as text).
    pub const DEFAULT: Timing = Timing {
        ttl: Duration::from_secs(6),
        renew_every: Duration::from_secs(2),
        campaign_every: Duration::from_millis(500),
        margin: Duration::from_millis(500),
        yield_grace: Duration::from_secs(1),
        release_timeout: Duration::from_millis(500),
    };

    /// Refuses zero durations, and a sum of renew_every, yield_grace,
    /// release_timeout and margin that reaches ttl: the child's grace and its
    /// kill have to fall before the lease could lapse, with one renewal
    /// attempted before the yield.
    pub fn validate(self) -> Result<Timing, TimingError> {
        let named = [
            ("--ttl", self.ttl),
            ("--renew-every", self.renew_every),
            ("--campaign-every", self.campaign_every),
            ("--margin", self.margin),
            ("--yield-grace", self.yield_grace),
            ("--release-timeout", self.release_timeout),
        ];
        for (flag, value) in named {
            if value.is_zero() {
                return Err(TimingError::Zero {
                    flag,
                    value: show(value),
                });
            }
            bounded(flag, value)?;
        }
        let sum = self.renew_every + self.yield_grace + self.release_timeout + self.margin;
        if sum >= self.ttl {
            return Err(TimingError::Invariant(self));
        }
        Ok(self)
    }

    /// The longest backend outage that costs a leader nothing: renewals are
    /// retried until the yield point, which is this long after the renewal
    /// that was due.
    pub fn renewal_budget(&self) -> Duration {
        self.ttl - self.renew_every - self.yield_grace - self.release_timeout - self.margin
    }

    /// How soon a failed renewal is tried again: often enough that an outage
    /// shorter than the budget is bridged, rarely enough not to hammer a
    /// struggling backend.
    pub fn renew_retry_every(&self) -> Duration {
        (self.renewal_budget() / 8).clamp(Duration::from_millis(20), Duration::from_millis(250))
    }

    /// The bound on any one backend call. A call still pending at this point
    /// is abandoned and counted as "could not ask"; the supervisor's timers
    /// never wait on it, so this only decides how soon the call is retried.
    pub fn call_timeout(&self) -> Duration {
        self.renew_every.min(Duration::from_secs(2))
    }

    /// The longest the supervisor sleeps without waking: a follower's wait
    /// (at most a campaign period, a 5 s backoff, or a hold-off of about a
    /// ttl) or a hook's bound (ttl). For the health check.
    pub fn longest_sleep(&self) -> Duration {
        (self.ttl + Duration::from_secs(1))
            .max(self.campaign_every)
            .max(self.renew_every)
            .max(Duration::from_secs(5))
    }

    /// The deadlines of a term whose last successful acquire/renew was sent at
    /// `sent_at`.
    pub fn deadlines(&self, sent_at: Instant) -> Deadlines {
        let expiry = sent_at + self.ttl;
        let term_deadline = expiry - self.margin - self.release_timeout;
        Deadlines {
            expiry,
            term_deadline,
            yield_at: term_deadline - self.yield_grace,
            kill_at: term_deadline + self.release_timeout,
        }
    }

    /// When a term that ends early (stopped, lost) at `now` kills what is left
    /// of its child: after the full grace, but never past the term's own kill
    /// point, so the child is dead before the lease can lapse.
    pub fn early_kill_at(&self, now: Instant, deadlines: &Deadlines) -> Instant {
        (now + self.yield_grace + self.release_timeout).min(deadlines.kill_at)
    }
}

/// The instants of one term (SPEC §3), all on the monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// `E = s + ttl`: the earliest moment the backend could consider the
    /// lease lapsed.
    pub expiry: Instant,
    /// `D = E − margin − release_timeout`.
    pub term_deadline: Instant,
    /// `D − yield_grace`: the child is told to stop.
    pub yield_at: Instant,
    /// `D + release_timeout = E − margin`: anything left of the child is killed.
    pub kill_at: Instant,
}

/// A duration for messages and logs: whole milliseconds in humantime's
/// notation (`1s 500ms`, not `1s 499ms 999us 810ns`); below a millisecond,
/// as it is.
pub fn show(d: Duration) -> String {
    let rounded = if d >= Duration::from_millis(1) {
        Duration::from_millis((d.as_nanos() as f64 / 1e6).round() as u64)
    } else {
        d
    };
    humantime::format_duration(rounded).to_string()
}

fn invariant_message(t: &Timing) -> String {
    let sum = show(t.renew_every + t.yield_grace + t.release_timeout + t.margin);
    format!(
        "timing invariant violated: renew_every ({}) + yield_grace ({}) + release_timeout ({}) + margin ({}) = {sum}, which must be less than ttl ({}); raise --ttl above {sum} or shorten the others",
        show(t.renew_every),
        show(t.yield_grace),
        show(t.release_timeout),
        show(t.margin),
        show(t.ttl),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn defaults_satisfy_the_invariant_with_a_two_second_budget() {
        let timing = Timing::DEFAULT.validate().unwrap();
        assert_eq!(timing.renewal_budget(), ms(2000));
        assert_eq!(timing.renew_retry_every(), ms(250));
    }

    #[test]
    fn default_deadlines_match_the_worked_example() {
        let s = Instant::now();
        let d = Timing::DEFAULT.deadlines(s);
        assert_eq!(d.expiry - s, ms(6000));
        assert_eq!(d.term_deadline - s, ms(5000));
        assert_eq!(d.yield_at - s, ms(4000));
        assert_eq!(d.kill_at - s, ms(5500));
        assert_eq!(d.expiry - d.kill_at, Timing::DEFAULT.margin);
    }

    #[test]
    fn renewal_is_due_before_the_yield_point() {
        let timing = Timing::DEFAULT;
        let s = Instant::now();
        assert!(s + timing.renew_every < timing.deadlines(s).yield_at);
    }

    #[test]
    fn invariant_equal_to_ttl_is_refused_and_names_every_value() {
        let timing = Timing {
            ttl: ms(4000),
            ..Timing::DEFAULT
        };
        let message = timing.validate().unwrap_err().to_string();
        for part in [
            "renew_every (2s)",
            "yield_grace (1s)",
            "release_timeout (500ms)",
            "margin (500ms)",
            "= 4s",
            "ttl (4s)",
        ] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
    }

    #[test]
    fn invariant_one_millisecond_under_ttl_is_accepted() {
        let timing = Timing {
            ttl: ms(4001),
            ..Timing::DEFAULT
        };
        assert_eq!(timing.validate().unwrap().renewal_budget(), ms(1));
    }

    #[test]
    fn zero_durations_are_refused_by_flag_name() {
        let timing = Timing {
            margin: Duration::ZERO,
            ..Timing::DEFAULT
        };
        let message = timing.validate().unwrap_err().to_string();
        assert!(message.contains("--margin"), "{message}");
    }

    #[test]
    fn early_kill_never_passes_the_term_kill_point() {
        let timing = Timing::DEFAULT;
        let s = Instant::now();
        let d = timing.deadlines(s);
        // Stopped early in the term: the full grace applies.
        assert_eq!(timing.early_kill_at(s + ms(100), &d), s + ms(1600));
        // Lost after the yield point: the kill point caps it.
        assert_eq!(timing.early_kill_at(s + ms(4200), &d), d.kill_at);
    }

    #[test]
    fn a_renewal_moves_every_deadline_by_the_send_gap() {
        let timing = Timing::DEFAULT;
        let s = Instant::now();
        let first = timing.deadlines(s);
        let renewed = timing.deadlines(s + ms(2000));
        assert_eq!(renewed.yield_at - first.yield_at, ms(2000));
        assert_eq!(renewed.kill_at - first.kill_at, ms(2000));
    }

    #[test]
    fn durations_past_a_year_are_refused_by_flag_name() {
        let timing = Timing {
            ttl: Duration::from_secs(u64::MAX),
            ..Timing::DEFAULT
        };
        let message = timing.validate().unwrap_err().to_string();
        assert!(message.contains("--ttl"), "{message}");
        assert!(message.contains("(1year)"), "{message}");
    }

    #[test]
    fn shown_durations_are_rounded_to_milliseconds() {
        assert_eq!(show(Duration::new(1, 499_999_810)), "1s 500ms");
        assert_eq!(show(ms(2000)), "2s");
        assert_eq!(show(Duration::from_micros(250)), "250us");
    }

    #[test]
    fn retry_period_is_clamped() {
        let tight = Timing {
            ttl: ms(2010),
            renew_every: ms(1000),
            yield_grace: ms(500),
            release_timeout: ms(250),
            margin: ms(250),
            campaign_every: ms(100),
        };
        assert_eq!(tight.renew_retry_every(), ms(20));
    }
}
