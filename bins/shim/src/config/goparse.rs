//! Values as the upstream shim's Go parses them (urfave/cli v3 over Go's `strconv`): booleans,
//! integers in any base, dstack's log levels; and sizes as Docker's Go parses its log options.

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
