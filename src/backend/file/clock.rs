//! The file backend's clock: CLOCK_BOOTTIME with the boot id.
//!
//! Expiry times are shared between processes of one host through the lease
//! file, so the monotonic clock of one process will not do. The wall clock
//! jumps; CLOCK_BOOTTIME does not, counts suspended time (a lease does not
//! survive a suspend it would have lapsed in), and restarts at each boot,
//! which the boot id tells apart.

use std::time::Duration;

/// Nanoseconds since this boot began.
pub fn now_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .expect("CLOCK_BOOTTIME is always available on Linux");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// `now + d` in nanoseconds, saturating: a far expiry stays far, never wraps
/// round to the past.
pub fn after(now: u64, d: Duration) -> u64 {
    now.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// This boot's id; a record written in another boot is stale.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_ttl_saturates_instead_of_wrapping() {
        let huge = Duration::new(18_446_744_075, 209_551_616);
        assert_eq!(after(now_ns(), huge), u64::MAX);
        assert_eq!(after(5, Duration::from_nanos(7)), 12);
    }
}
