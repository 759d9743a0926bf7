//! Docker's timestamps.

/// Unix nanoseconds of a time as Docker writes them (RFC 3339 in UTC,
/// `2026-11-30T15:59:51.123456789Z`, as in `State.FinishedAt`); `None` for anything else,
/// including Docker's zero time `0001-01-01T00:00:00Z` (a container that never finished).
pub fn docker_time_ns(t: &str) -> Option<i64> {
    let (date, time) = t.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut h = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (h.next()??, h.next()??, h.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos: i64 = format!("{frac:0<9}").get(..9)?.parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
}

#[cfg(test)]
mod tests {
    use super::docker_time_ns;

    #[test]
    fn docker_times_are_unix_nanoseconds() {
        assert_eq!(docker_time_ns("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            docker_time_ns("2026-11-30T15:59:51.123456789Z"),
            Some(1_796_054_391_123_456_789)
        );
        assert_eq!(
            docker_time_ns("2000-03-01T00:00:01.5Z"),
            Some(951_868_801_500_000_000)
        );
        assert_eq!(docker_time_ns("0001-01-01T00:00:00Z").map(|n| n < 0), None);
        assert_eq!(docker_time_ns("2026-11-30 15:59:51Z"), None);
        assert_eq!(docker_time_ns("garbage"), None);
        assert_eq!(docker_time_ns("2026-11-29T20:40:01+01:00"), None);
        // date -u -d 2000-02-29T00:00:00Z +%s
        assert_eq!(
            docker_time_ns("2000-02-29T00:00:00Z"),
            Some(951_782_400_000_000_000)
        );
    }
}
