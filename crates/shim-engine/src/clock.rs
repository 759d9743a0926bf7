//! The clocks the engine reads: wall time for records and metrics, a monotonic stamp that
//! orders a list request against the end of a start.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Unix milliseconds now (0 before 1970).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Unix nanoseconds now (what Docker's event `since` takes).
pub(crate) fn now_unix_ns() -> i64 {
    let ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    i64::try_from(ns).unwrap_or(i64::MAX)
}

/// Nanoseconds on a monotonic clock since the first call in this process, plus one (never 0):
/// orders a list request against the end of a start, which milliseconds cannot (both may fall
/// in the same one).
pub(crate) fn mono_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_nanos())
        .unwrap_or(u64::MAX - 1)
        .saturating_add(1)
}
