//! Values as the upstream shim's Go parses them (urfave/cli v3 over Go's `strconv`): booleans,
//! integers in any base, dstack's log levels.

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
