//! Docker's timestamps and differences between wall-clock times.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (what Docker writes, e.g. `State.FinishedAt`) with
/// the shim's own parser ([`shim_runtime::docker_time_ns`]); `None` before 1970.
pub fn parse_rfc3339_utc(text: &str) -> Option<SystemTime> {
    let ns = u64::try_from(shim_runtime::docker_time_ns(text)?).ok()?;
    Some(UNIX_EPOCH + Duration::from_nanos(ns))
}

/// Milliseconds from `earlier` to `later`, negative if the clock says `later` came first.
pub fn ms_between(earlier: SystemTime, later: SystemTime) -> f64 {
    match later.duration_since(earlier) {
        Ok(d) => d.as_secs_f64() * 1e3,
        Err(e) => -e.duration().as_secs_f64() * 1e3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_timestamps_become_system_times() {
        let t = parse_rfc3339_utc("2026-11-29T20:40:01.123456789Z").unwrap();
        // date -u -d 2026-11-29T20:40:01Z +%s
        assert_eq!(t, UNIX_EPOCH + Duration::new(1_795_984_801, 123_456_789));
        assert!(parse_rfc3339_utc("0001-01-01T00:00:00Z").is_none());
        assert!(parse_rfc3339_utc("garbage").is_none());
    }

    #[test]
    fn differences_have_a_sign() {
        let a = UNIX_EPOCH + Duration::from_millis(1000);
        let b = UNIX_EPOCH + Duration::from_millis(1250);
        assert_eq!(ms_between(a, b), 250.0);
        assert_eq!(ms_between(b, a), -250.0);
    }
}
