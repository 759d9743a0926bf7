//! A strict parser of the OpenMetrics text format, for the checks the tests make of the shim's
//! `GET /metrics` ([`TestShim::metrics`](crate::harness::TestShim::metrics)).

use std::collections::{BTreeMap, BTreeSet};

/// A sample's labels, sorted by name.
pub type Labels = Vec<(String, String)>;

/// Samples by name, then by their label set.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Samples by name, then by label set.
    pub samples: BTreeMap<String, BTreeMap<Labels, f64>>,
    /// Each family's type (`counter`, `gauge`, `histogram`, …), by family name.
    pub types: BTreeMap<String, String>,
}

impl Metrics {
    /// The value of `name{labels}`; 0 when absent (a labelled counter appears on first use).
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.try_get(name, labels).unwrap_or(0.0)
    }

    /// The value of `name{labels}`, if the exposition has it.
    pub fn try_get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut key: Labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        key.sort();
        self.samples
            .get(name)
            .and_then(|by_labels| by_labels.get(&key))
            .copied()
    }
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The suffixes a family of `typ` may give its samples.
fn suffixes(typ: &str) -> &'static [&'static str] {
    match typ {
        "counter" => &["_total", "_created"],
        "histogram" => &["_bucket", "_count", "_sum", "_created"],
        "info" => &["_info"],
        "gauge" | "unknown" => &[""],
        _ => &[],
    }
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|_| format!("bad value {s:?}")),
    }
}

/// Parses `{k="v",...}` (escapes `\\`, `\"`, `\n`); returns the labels and the rest.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let Some(mut rest) = s.strip_prefix('{') else {
        return Ok((Vec::new(), s));
    };
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('}') {
        return Ok((labels, r));
    }
    loop {
        let (name, r) = rest
            .split_once("=\"")
            .ok_or_else(|| format!("bad label in {s:?}"))?;
        if !is_name(name) || name.contains(':') {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = r.char_indices();
        let after = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?} in {s:?}")),
                },
                Some((i, '"')) => break &r[i + 1..],
                Some((_, c)) => value.push(c),
                None => return Err(format!("unterminated label value in {s:?}")),
            }
        };
        if labels.iter().any(|(n, _)| n == name) {
            return Err(format!("label {name} twice in {s:?}"));
        }
        labels.push((name.to_owned(), value));
        if let Some(r) = after.strip_prefix(',') {
            rest = r;
        } else if let Some(r) = after.strip_prefix('}') {
            labels.sort();
            return Ok((labels, r));
        } else {
            return Err(format!("expected , or }} in {s:?}"));
        }
    }
}

/// Parses an OpenMetrics text exposition strictly: `# HELP`/`# TYPE`/`# UNIT` lines naming a
/// family once, before its samples; each sample named after the current family with a suffix
/// its type allows; no sample twice; `# EOF` as the last line; histograms with `le` buckets
/// that are cumulative and end in `+Inf` equal to `_count`; counters not negative.
pub fn parse_openmetrics(text: &str) -> Result<Metrics, String> {
    let body = text
        .strip_suffix("# EOF\n")
        .ok_or("the exposition does not end with `# EOF`")?;
    let mut metrics = Metrics::default();
    let mut family: Option<(String, String)> = None;
    let mut done_families = BTreeSet::new();
    for line in body.lines() {
        if line.is_empty() {
            return Err("empty line".into());
        }
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let rest = parts.next();
            if !is_name(name) {
                return Err(format!("bad family name in {line:?}"));
            }
            if family.as_ref().is_none_or(|(f, _)| f != name) {
                if !done_families.insert(name.to_owned()) {
                    return Err(format!("family {name} appears twice"));
                }
                family = Some((name.to_owned(), "unknown".to_owned()));
            }
            match (kind, rest) {
                ("HELP", _) | ("UNIT", Some(_)) => {}
                ("TYPE", Some(typ)) => {
                    if suffixes(typ).is_empty() {
                        return Err(format!("unknown type in {line:?}"));
                    }
                    if metrics
                        .types
                        .insert(name.to_owned(), typ.to_owned())
                        .is_some()
                    {
                        return Err(format!("two TYPE lines for {name}"));
                    }
                    family = Some((name.to_owned(), typ.to_owned()));
                }
                _ => return Err(format!("bad metadata line {line:?}")),
            }
            continue;
        }
        if line.starts_with('#') {
            return Err(format!("bad comment line {line:?}"));
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or(format!("bad sample {line:?}"))?;
        let name = &line[..name_end];
        let (labels, rest) = parse_labels(&line[name_end..])?;
        let mut fields = rest
            .strip_prefix(' ')
            .ok_or(format!("bad sample {line:?}"))?
            .split(' ');
        let value = parse_value(fields.next().unwrap_or(""))?;
        if let Some(ts) = fields.next() {
            parse_value(ts)?;
        }
        if fields.next().is_some() {
            return Err(format!("trailing fields in {line:?}"));
        }
        let (fam, typ) = family
            .as_ref()
            .ok_or(format!("sample before any family: {line:?}"))?;
        let suffix = name
            .strip_prefix(fam.as_str())
            .ok_or(format!("sample {name} outside its family {fam}"))?;
        if !suffixes(typ).contains(&suffix) {
            return Err(format!("sample {name} does not fit {typ} family {fam}"));
        }
        if typ == "counter" && suffix == "_total" && (value < 0.0 || value.is_nan()) {
            return Err(format!("negative counter {line:?}"));
        }
        let by_labels = metrics.samples.entry(name.to_owned()).or_default();
        if by_labels.insert(labels, value).is_some() {
            return Err(format!("sample twice: {line:?}"));
        }
    }
    check_histograms(&metrics)?;
    Ok(metrics)
}

fn check_histograms(metrics: &Metrics) -> Result<(), String> {
    for (fam, typ) in &metrics.types {
        if typ != "histogram" {
            continue;
        }
        let buckets = metrics
            .samples
            .get(&format!("{fam}_bucket"))
            .ok_or(format!("histogram {fam} has no buckets"))?;
        let count = metrics.get(&format!("{fam}_count"), &[]);
        let mut bounds: Vec<(f64, f64)> = buckets
            .iter()
            .map(|(labels, v)| {
                let le = labels
                    .iter()
                    .find(|(k, _)| k == "le")
                    .ok_or(format!("bucket of {fam} without le"))?;
                Ok((parse_value(&le.1)?, *v))
            })
            .collect::<Result<_, String>>()?;
        bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        if bounds.last().map(|b| b.0) != Some(f64::INFINITY) {
            return Err(format!("histogram {fam} has no +Inf bucket"));
        }
        if bounds.windows(2).any(|w| w[1].1 < w[0].1) {
            return Err(format!("histogram {fam} buckets are not cumulative"));
        }
        if bounds.last().map(|b| b.1) != Some(count) {
            return Err(format!("histogram {fam}: +Inf bucket != _count"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: panics are failures

    use super::*;

    #[test]
    fn the_parser_is_strict() {
        let good = "# HELP a_seconds x\n# TYPE a_seconds histogram\n\
            a_seconds_sum 1.5\na_seconds_count 2\n\
            a_seconds_bucket{le=\"1.0\"} 1\na_seconds_bucket{le=\"+Inf\"} 2\n\
            # TYPE b counter\nb_total{op=\"x\\\"y\"} 3\n# TYPE c info\nc_info{v=\"1\"} 1\n# EOF\n";
        let m = parse_openmetrics(good).unwrap();
        assert_eq!(m.get("b_total", &[("op", "x\"y")]), 3.0);
        assert_eq!(m.get("a_seconds_count", &[]), 2.0);
        for bad in [
            good.trim_end_matches("# EOF\n"),
            &good.replace("b_total", "b"),
            &good.replace(
                "a_seconds_bucket{le=\"+Inf\"} 2",
                "a_seconds_bucket{le=\"+Inf\"} 3",
            ),
            &good.replace(
                "a_seconds_bucket{le=\"1.0\"} 1",
                "a_seconds_bucket{le=\"1.0\"} 5",
            ),
            &good.replace("# TYPE c info", "# TYPE b info"),
            &good.replace("c_info{v=\"1\"} 1", "c_info{v=\"1\"} 1\nc_info{v=\"1\"} 1"),
            &good.replace("c_info{v=\"1\"}", "c_info{v=\"1}"),
            &good.replace("b_total{op=\"x\\\"y\"} 3", "b_total{op=\"x\\\"y\"} -3"),
        ] {
            assert!(parse_openmetrics(bad).is_err(), "accepted:\n{bad}");
        }
    }
}
