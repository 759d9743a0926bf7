//! Docker's timestamps and differences between wall-clock times.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (what Docker writes, e.g. `State.FinishedAt`).
pub fn parse_rfc3339_utc(text: &str) -> Option<SystemTime> {
    let (date, time) = text.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(str::parse::<i64>);
    let (year, month, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(str::parse::<i64>);
    let (h, m, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        let digits: String = fraction
            .chars()
            .chain(std::iter::repeat('0'))
            .take(9)
            .collect();
        digits.parse().ok()?
    };
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    // Days since 1970-01-01 (H. Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days * 86_400 + h * 3600 + m * 60 + s).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
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
    fn parses_docker_timestamps() {
        let t = parse_rfc3339_utc("1970-01-01T00:00:01.5Z").unwrap();
        assert_eq!(t, UNIX_EPOCH + Duration::from_millis(1500));
        let t = parse_rfc3339_utc("2026-11-29T20:40:01.123456789Z").unwrap();
        // date -u -d 2026-11-29T20:40:01Z +%s
        assert_eq!(t, UNIX_EPOCH + Duration::new(1_795_984_801, 123_456_789));
        let t = parse_rfc3339_utc("2000-02-29T00:00:00Z").unwrap();
        assert_eq!(t, UNIX_EPOCH + Duration::from_secs(951_782_400));
        assert!(parse_rfc3339_utc("0001-01-01T00:00:00Z").is_none());
        assert!(parse_rfc3339_utc("2026-11-29T20:40:01+01:00").is_none());
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
