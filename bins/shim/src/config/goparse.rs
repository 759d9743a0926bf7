//! Values as the upstream shim's Go parses them (urfave/cli v3 over Go's `strconv`): booleans,
//! integers in any base, durations (`time.ParseDuration`), dstack's log levels; and sizes as
//! Docker's Go parses its log options.

use anyhow::bail;
use tracing_subscriber::filter::LevelFilter;

/// What Go's `strconv.ParseBool` takes: true, then false.
pub const GO_BOOLS: [&str; 12] = [
    "1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False",
];

/// Go's `strconv.ParseBool`.
pub fn go_bool(s: &str) -> Option<bool> {
    GO_BOOLS.iter().position(|b| *b == s).map(|i| i < 6)
}

/// Go's `strconv.ParseInt(s, 0, 64)`: an optional sign, then `0x`/`0X` hex, `0o`/`0O` or a
/// leading `0` octal, `0b`/`0B` binary, or decimal; `_` only between digits after a prefix.
pub fn go_int(s: &str) -> Option<i64> {
    let (neg, body) = match s.as_bytes().first()? {
        b'+' => (false, &s[1..]),
        b'-' => (true, &s[1..]),
        _ => (false, s),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits, prefixed) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d.to_owned(), true)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d.to_owned(), true)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d.to_owned(), true)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, lower[1..].to_owned(), true)
    } else {
        (10, lower.clone(), false)
    };
    if digits.contains('_') {
        // Underscores only with base 0 and a prefix, each between digits.
        if !prefixed || digits.ends_with('_') || digits.contains("__") {
            return None;
        }
    }
    let digits: String = digits.chars().filter(|c| *c != '_').collect();
    if digits.is_empty() {
        return None;
    }
    let magnitude = i128::from_str_radix(&digits, radix).ok()?;
    let value = if neg { -magnitude } else { magnitude };
    i64::try_from(value).ok()
}

/// Go's `time.ParseDuration`, non-negative: a sequence of decimal numbers, each with an
/// optional fraction and a unit `ns`, `us` (or `µs`), `ms`, `s`, `m`, `h` (`5m`, `1h30m`,
/// `1.5h`, `300ms`), or a bare `0`; a leading `+` is allowed. `None` for anything else: a
/// number without a unit (`300`), a negative duration, or one beyond Go's limit (about 292
/// years).
pub fn go_duration(s: &str) -> Option<std::time::Duration> {
    const UNITS: [(&str, u128); 9] = [
        ("ns", 1),
        ("us", 1_000),
        ("\u{b5}s", 1_000),
        ("\u{3bc}s", 1_000),
        ("ms", 1_000_000),
        ("s", 1_000_000_000),
        ("m", 60_000_000_000),
        ("h", 3_600_000_000_000),
        ("", 0),
    ];
    let mut rest = s.strip_prefix('+').unwrap_or(s);
    if rest == "0" {
        return Some(std::time::Duration::ZERO);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (int, after) = rest.split_at(int_len);
        let (frac, after) = match after.strip_prefix('.') {
            Some(f) => {
                let n = f.find(|c: char| !c.is_ascii_digit()).unwrap_or(f.len());
                f.split_at(n)
            }
            None => ("", after),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        let unit_len = after
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale = UNITS
            .iter()
            .find(|(name, _)| *name == unit && !name.is_empty())
            .map(|(_, scale)| *scale)?;
        let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let mut value = int.checked_mul(scale)?;
        // The fraction's first digits (beyond 19 none counts at a nanosecond's precision).
        let frac = &frac[..frac.len().min(19)];
        if !frac.is_empty() {
            let digits: u128 = frac.parse().ok()?;
            value += digits * scale / 10u128.pow(u32::try_from(frac.len()).ok()?);
        }
        total = total.checked_add(value)?;
        rest = after;
    }
    if total > u128::from(i64::MAX.unsigned_abs()) {
        return None;
    }
    Some(std::time::Duration::from_nanos(u64::try_from(total).ok()?))
}

/// A size as Docker parses its `json-file` driver's `max-size` (go-units' `RAMInBytes`): a
/// decimal number, a fraction allowed, then optionally one space and a unit `k`, `m` or `g` in
/// either case (powers of 1024), which may be followed by `b` or `ib` (`100m`, `1.5g`,
/// `512KiB`, `100MB`, `1048576`; a bare `b` is bytes). A fraction of a byte is dropped. `None`
/// for anything else (Go's float syntax beyond that, `1.`, `.5`, `1e6`, and the units `t`
/// and `p` are refused here), and for a size beyond `i64::MAX` (Docker's limit).
pub fn docker_size(s: &str) -> Option<u64> {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, rest) = s.split_at(end);
    let (whole, fraction) = match number.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (number, None),
    };
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || fraction.is_some_and(|f| !digits(f)) {
        return None;
    }
    let unit = rest.strip_prefix(' ').unwrap_or(rest).to_ascii_lowercase();
    let (shift, suffix) = match unit.as_bytes().first() {
        Some(b'k') => (10, &unit[1..]),
        Some(b'm') => (20, &unit[1..]),
        Some(b'g') => (30, &unit[1..]),
        _ => (0, unit.as_str()),
    };
    match suffix {
        "" | "b" => {}
        "i" | "ib" if shift > 0 => {}
        _ => return None,
    }
    let multiplier = 1u64 << shift;
    let mut bytes = whole.parse::<u64>().ok()?.checked_mul(multiplier)?;
    if let Some(fraction) = fraction {
        // Exactly: floor(0.<fraction> × multiplier), from its first 18 digits.
        let fraction = &fraction[..fraction.len().min(18)];
        let numerator = fraction.parse::<u128>().ok()? * u128::from(multiplier);
        let denominator = 10u128.pow(u32::try_from(fraction.len()).ok()?);
        bytes = bytes.checked_add(u64::try_from(numerator / denominator).ok()?)?;
    }
    (i64::try_from(bytes).is_ok()).then_some(bytes)
}

/// dstack's log levels (upstream `runner/internal/common/log/log.go`, `ParseLevel`): one
/// digit 1 (fatal) to 6 (trace), or a logrus level name in any case; `panic` (0), `0`, `7`,
/// `""` and others are refused.
pub fn parse_level(s: &str) -> anyhow::Result<LevelFilter> {
    let level = if s.len() == 1 && s.as_bytes()[0].is_ascii_digit() {
        u32::from(s.as_bytes()[0] - b'0')
    } else {
        match s.to_ascii_lowercase().as_str() {
            "panic" => 0,
            "fatal" => 1,
            "error" => 2,
            "warn" | "warning" => 3,
            "info" => 4,
            "debug" => 5,
            "trace" => 6,
            _ => bail!("invalid log level: {s}"),
        }
    };
    Ok(match level {
        1 | 2 => LevelFilter::ERROR,
        3 => LevelFilter::WARN,
        4 => LevelFilter::INFO,
        5 => LevelFilter::DEBUG,
        6 => LevelFilter::TRACE,
        _ => bail!("invalid log level: {s}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Go's `time.ParseDuration` takes (without negatives), and what it refuses.
    #[test]
    fn durations() {
        use std::time::Duration;
        for (s, want) in [
            ("0", Duration::ZERO),
            ("+0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("5m", Duration::from_secs(300)),
            ("2h", Duration::from_secs(7200)),
            ("1h30m", Duration::from_secs(5400)),
            ("1.5h", Duration::from_secs(5400)),
            (".5s", Duration::from_millis(500)),
            ("1.s", Duration::from_secs(1)),
            ("300ms", Duration::from_millis(300)),
            ("10us", Duration::from_micros(10)),
            ("10\u{b5}s", Duration::from_micros(10)),
            ("10\u{3bc}s", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            ("1m0.25s", Duration::from_millis(60_250)),
            ("2562047h", Duration::from_secs(2_562_047 * 3600)),
        ] {
            assert_eq!(go_duration(s), Some(want), "{s}");
        }
        for s in [
            "", "300", "5", "-5m", "5 m", "5M", "m", "5d", ".s", "1h-5m", "5m ", "3000000h", "+",
            "1..5s",
        ] {
            assert_eq!(go_duration(s), None, "{s:?}");
        }
    }

    #[test]
    fn booleans() {
        for v in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(go_bool(v), Some(true), "{v}");
        }
        for v in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(go_bool(v), Some(false), "{v}");
        }
        for v in ["", "yes", "tRUE", " 1"] {
            assert_eq!(go_bool(v), None, "{v:?}");
        }
    }

    /// go-units' `RAMInBytes` (`size_test.go`, `TestRAMInBytes`), for k, m and g.
    #[test]
    fn docker_sizes() {
        for (s, bytes) in [
            ("32", 32),
            ("32b", 32),
            ("32B", 32),
            ("32k", 32 << 10),
            ("32K", 32 << 10),
            ("32kb", 32 << 10),
            ("32Kb", 32 << 10),
            ("32Kib", 32 << 10),
            ("32KIB", 32 << 10),
            ("32Mb", 32 << 20),
            ("32Gb", 32 << 30),
            ("32 mb", 32 << 20),
            ("32 ", 32),
            ("100m", 100 << 20),
            ("0.3Mb", 314_572),
            ("1.5g", 3 << 29),
            ("1.0", 1),
            ("1.9", 1),
            ("0", 0),
        ] {
            assert_eq!(docker_size(s), Some(bytes), "{s:?}");
        }
        for bad in [
            "",
            "m",
            "-1",
            "+1",
            "1.",
            ".5",
            "1..2",
            "32.3.2",
            "32i",
            "32ib",
            "32  m",
            " 32",
            "32bm",
            "32t",
            "32kk",
            "100 m extra",
            "abc",
            "daemon",
            "8589934592g",
            "99999999999999999999",
        ] {
            assert_eq!(docker_size(bad), None, "{bad:?}");
        }
    }

    /// upstream `runner/internal/common/log/log_test.go` (TestParseLevel, TestParseLevelError).
    #[test]
    fn levels() {
        assert_eq!(parse_level("1").unwrap(), LevelFilter::ERROR);
        assert_eq!(parse_level("2").unwrap(), LevelFilter::ERROR);
        assert_eq!(parse_level("3").unwrap(), LevelFilter::WARN);
        assert_eq!(parse_level("Debug").unwrap(), LevelFilter::DEBUG);
        assert_eq!(parse_level("WARNING").unwrap(), LevelFilter::WARN);
        for bad in ["", "verbose", "panic", "0", "7", "9", "10", "-1", "4 "] {
            assert!(parse_level(bad).is_err(), "{bad:?}");
        }
    }
}
