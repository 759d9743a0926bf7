//! The Prometheus text format, as much as filtering needs: sample lines parsed into name and
//! labels (quoted values with `\\`, `\"` and `\n` escapes), `# HELP`/`# TYPE` lines tied to
//! their family.

use std::borrow::Cow;

/// A parsed sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// The metric name.
    pub name: &'a str,
    /// The labels in line order, values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The sample value.
    pub value: f64,
    /// The optional timestamp (milliseconds).
    pub timestamp: Option<i64>,
}

impl Sample<'_> {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Why a sample line could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} at byte {at}")]
pub struct ParseError {
    /// What was expected.
    pub reason: &'static str,
    /// Where, in bytes from the line start.
    pub at: usize,
}

/// Parses one sample line (no comments, no blank lines; surrounding whitespace allowed).
pub fn parse_sample(line: &str) -> Result<Sample<'_>, ParseError> {
    let mut p = Parser { s: line, i: 0 };
    p.skip_ws();
    let name = p.name(true).ok_or(p.err("metric name expected"))?;
    p.skip_ws();
    let mut labels = Vec::new();
    if p.eat('{') {
        loop {
            p.skip_ws();
            if p.eat('}') {
                break;
            }
            let label = p.name(false).ok_or(p.err("label name expected"))?;
            p.skip_ws();
            if !p.eat('=') {
                return Err(p.err("'=' expected"));
            }
            p.skip_ws();
            let value = p.quoted()?;
            labels.push((label, value));
            p.skip_ws();
            if p.eat(',') {
                continue;
            }
            if p.eat('}') {
                break;
            }
            return Err(p.err("',' or '}' expected"));
        }
    }
    p.skip_ws();
    let value = p.token().ok_or(p.err("value expected"))?;
    let value = parse_value(value).ok_or(p.err("invalid value"))?;
    p.skip_ws();
    let timestamp = match p.token() {
        None => None,
        Some(t) => Some(t.parse::<i64>().map_err(|_| p.err("invalid timestamp"))?),
    };
    p.skip_ws();
    if p.i != line.len() {
        return Err(p.err("end of line expected"));
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp,
    })
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ if s
            .bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)) =>
        {
            s.parse().ok()
        }
        _ => None,
    }
}

struct Parser<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, reason: &'static str) -> ParseError {
        ParseError { reason, at: self.i }
    }

    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.i).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c as u8) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.i += 1;
        }
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` (colons only in metric names).
    fn name(&mut self, colons: bool) -> Option<&'a str> {
        let start = self.i;
        while let Some(b) = self.peek() {
            let ok = b.is_ascii_alphabetic()
                || b == b'_'
                || (colons && b == b':')
                || (self.i > start && b.is_ascii_digit());
            if !ok {
                break;
            }
            self.i += 1;
        }
        (self.i > start).then(|| &self.s[start..self.i])
    }

    /// A run of non-blank characters.
    fn token(&mut self) -> Option<&'a str> {
        let start = self.i;
        while matches!(self.peek(), Some(b) if b != b' ' && b != b'\t') {
            self.i += 1;
        }
        (self.i > start).then(|| &self.s[start..self.i])
    }

    /// A double-quoted label value; `\\`, `\"` and `\n` are unescaped, any other backslash is
    /// kept as it is (as Prometheus' own parser does).
    fn quoted(&mut self) -> Result<Cow<'a, str>, ParseError> {
        if !self.eat('"') {
            return Err(self.err("'\"' expected"));
        }
        let start = self.i;
        let mut owned: Option<String> = None;
        let mut run = start;
        loop {
            let Some(b) = self.peek() else {
                return Err(self.err("unterminated label value"));
            };
            match b {
                b'"' => {
                    let value = match owned {
                        None => Cow::Borrowed(&self.s[start..self.i]),
                        Some(mut o) => {
                            o.push_str(&self.s[run..self.i]);
                            Cow::Owned(o)
                        }
                    };
                    self.i += 1;
                    return Ok(value);
                }
                b'\\' => {
                    let o = owned.get_or_insert_with(String::new);
                    o.push_str(&self.s[run..self.i]);
                    match self.s.as_bytes().get(self.i + 1) {
                        Some(b'\\') => o.push('\\'),
                        Some(b'"') => o.push('"'),
                        Some(b'n') => o.push('\n'),
                        Some(_) => {
                            // Keep the backslash; the next character is copied with the run.
                            o.push('\\');
                            self.i += 1;
                            run = self.i;
                            continue;
                        }
                        None => return Err(self.err("unterminated label value")),
                    }
                    self.i += 2;
                    run = self.i;
                }
                _ => self.i += 1,
            }
        }
    }
}

/// The metric family a `# HELP` or `# TYPE` comment describes, and which one it is.
fn metadata(line: &str) -> Option<(Meta, &str)> {
    let rest = line.strip_prefix('#')?.trim_start();
    let (kind, rest) = if let Some(r) = rest.strip_prefix("HELP") {
        (Meta::Help, r)
    } else if let Some(r) = rest.strip_prefix("TYPE") {
        (Meta::Type, r)
    } else {
        return None;
    };
    if !rest.starts_with([' ', '\t']) {
        return None;
    }
    let family = rest.split_whitespace().next()?;
    Some((kind, family))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Meta {
    Help,
    Type,
}

/// Whether a sample named `name` belongs to family `family` (the family itself, or one of the
/// series a summary or histogram family adds).
fn in_family(name: &str, family: &str) -> bool {
    match name.strip_prefix(family) {
        Some("") => true,
        Some(suffix) => matches!(
            suffix,
            "_bucket" | "_sum" | "_count" | "_total" | "_created"
        ),
        None => false,
    }
}

/// The labels that carry a GPU's UUID in dcgm-exporter's samples: `UUID` (current) and `uuid`
/// (dcgm-exporter 1.x, and later with `--use-old-namespace`).
pub const UUID_LABELS: [&str; 2] = ["UUID", "uuid"];

/// Keeps the samples of the given GPUs and the `# HELP`/`# TYPE` lines of the families that
/// still have samples; drops everything else (other GPUs' samples, other comments, blank and
/// unparsable lines). Kept lines are copied verbatim (trimmed), each ending in `\n`; the HELP
/// line comes before the TYPE line, both once, right before the family's first kept sample.
///
/// Upstream (`runner/internal/shim/dcgm/metrics.go`, `FilterMetrics`) keeps a sample line when
/// it *contains* an id anywhere; this keeps it when its `UUID` label *equals* one, which is the
/// same for dcgm-exporter's output and task GPU ids (`GPU-<uuid>`), without matching an id
/// that happens to appear inside another label's value. No ids: empty output, as upstream.
pub fn filter_metrics(text: &str, gpu_ids: &[String]) -> String {
    let mut out = String::new();
    if gpu_ids.is_empty() {
        return out;
    }
    // The pending metadata lines of the family being read: (family, line).
    let mut help: Option<(&str, &str)> = None;
    let mut typ: Option<(&str, &str)> = None;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with('#') {
            match metadata(line) {
                Some((Meta::Help, family)) => {
                    if typ.is_some_and(|(f, _)| f != family) {
                        typ = None;
                    }
                    help = Some((family, line));
                }
                Some((Meta::Type, family)) => {
                    if help.is_some_and(|(f, _)| f != family) {
                        help = None;
                    }
                    typ = Some((family, line));
                }
                None => {}
            }
            continue;
        }
        let sample = match parse_sample(line) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(line, error = %e, "skipping an unparsable exporter line");
                continue;
            }
        };
        let ours = UUID_LABELS
            .iter()
            .filter_map(|l| sample.label(l))
            .any(|uuid| gpu_ids.iter().any(|id| id == uuid));
        if !ours {
            continue;
        }
        for pending in [&mut help, &mut typ] {
            if let Some((family, meta)) = *pending
                && in_family(sample.name, family)
            {
                out.push_str(meta);
                out.push('\n');
                *pending = None;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_labels_values_and_timestamps() {
        let s = parse_sample(r#"m_1:x{a="1", b_2 = "two" ,} 1.5e3 1700000000000"#).unwrap();
        assert_eq!(s.name, "m_1:x");
        assert_eq!(s.label("a"), Some("1"));
        assert_eq!(s.label("b_2"), Some("two"));
        assert_eq!(s.value, 1500.0);
        assert_eq!(s.timestamp, Some(1_700_000_000_000));

        let s = parse_sample("up 1").unwrap();
        assert!(s.labels.is_empty());
        let s = parse_sample("x{} NaN").unwrap();
        assert!(s.value.is_nan());
        assert_eq!(parse_sample("x -Inf").unwrap().value, f64::NEG_INFINITY);
    }

    #[test]
    fn unescapes_label_values() {
        let s = parse_sample(r#"x{a="q\"uo}te, \\ back\nnl \t kept",b="é"} 0"#).unwrap();
        assert_eq!(s.label("a"), Some("q\"uo}te, \\ back\nnl \\t kept"));
        assert_eq!(s.label("b"), Some("é"));
    }

    #[test]
    fn rejects_malformed_lines() {
        for line in [
            "",
            "1metric 1",
            "x{a=1} 1",
            "x{a=\"1\" 1",
            "x{a=\"1\"",
            "x{a=\"1\\",
            "x{=\"1\"} 1",
            "x",
            "x one",
            "x 1 2 3",
            "x 1 t",
        ] {
            assert!(parse_sample(line).is_err(), "{line:?} parsed");
        }
    }
}
