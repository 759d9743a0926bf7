//! What the bench measured: latency rows of the micro benchmarks and the shim-versus-raw-Docker
//! comparisons, printed as tables and written as JSON.

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

/// A latency distribution of a micro benchmark, in microseconds.
#[derive(Debug, Clone)]
pub struct Row {
    /// `store` or `engine`.
    pub group: &'static str,
    /// What was measured.
    pub name: String,
    /// Samples.
    pub n: usize,
    /// Percentiles (min, p50, p90, p99, max) in µs.
    pub pct: [f64; 5],
}

impl Row {
    /// A row from a `{"name","n","min_us","p50_us",..}` object.
    pub fn from_json(group: &'static str, value: &Value) -> Result<Row> {
        let f = |key: &str| {
            value[key]
                .as_f64()
                .with_context(|| format!("no {key} in {value}"))
        };
        Ok(Row {
            group,
            name: value["name"]
                .as_str()
                .with_context(|| format!("no name in {value}"))?
                .to_owned(),
            n: usize::try_from(value["n"].as_u64().unwrap_or(0)).unwrap_or(0),
            pct: [
                f("min_us")?,
                f("p50_us")?,
                f("p90_us")?,
                f("p99_us")?,
                f("max_us")?,
            ],
        })
    }

    fn json(&self) -> Value {
        let r = |us: f64| (us * 10.0).round() / 10.0;
        json!({
            "group": self.group, "name": self.name, "n": self.n,
            "min_us": r(self.pct[0]), "p50_us": r(self.pct[1]), "p90_us": r(self.pct[2]),
            "p99_us": r(self.pct[3]), "max_us": r(self.pct[4]),
        })
    }
}

/// The `p`-th percentile (nearest rank, 0..=100) of `samples`; `NaN` if there are none.
pub fn percentile(samples: &[f64], p: usize) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(sorted.len() - 1) * p.min(100) / 100]
}

/// The median of `samples`.
pub fn median(samples: &[f64]) -> f64 {
    percentile(samples, 50)
}

/// A duration in microseconds, readable.
pub fn human_us(us: f64) -> String {
    if us < 1.0 {
        format!("{:.0} ns", us * 1000.0)
    } else if us < 1000.0 {
        format!("{us:.1} µs")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

/// A goal of a comparison (SPEC's performance goals, issue 13).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Goal {
    /// shim ≤ raw + this much (same unit).
    RawPlus(f64),
    /// shim ≤ this much.
    AtMost(f64),
    /// shim − raw ≤ this much (same unit): what the shim adds.
    ExtraAtMost(f64),
    /// shim ≥ raw × this.
    AtLeastRawTimes(f64),
    /// shim ≤ raw × this.
    AtMostRawTimes(f64),
    /// None.
    None,
}

impl Goal {
    fn text(self, unit: &str) -> String {
        match self {
            Goal::RawPlus(d) => format!("≤ raw + {d} {unit}"),
            Goal::AtMost(v) => format!("≤ {v} {unit}"),
            Goal::ExtraAtMost(v) => format!("shim − raw ≤ {v} {unit}"),
            Goal::AtLeastRawTimes(f) => format!("≥ {f}× raw"),
            Goal::AtMostRawTimes(f) => format!("≤ {f}× raw"),
            Goal::None => "—".to_owned(),
        }
    }

    /// Whether `shim` (and `raw`) meet the goal; `None` when there is no goal or no figure.
    pub fn met(self, shim: f64, raw: Option<f64>) -> Option<bool> {
        let raw_or = |f: &dyn Fn(f64) -> bool| raw.filter(|r| r.is_finite()).map(f);
        if !shim.is_finite() {
            return None;
        }
        match self {
            Goal::RawPlus(d) => raw_or(&|r| shim <= r + d),
            Goal::AtMost(v) => Some(shim <= v),
            Goal::ExtraAtMost(v) => raw_or(&|r| shim - r <= v),
            Goal::AtLeastRawTimes(f) => raw_or(&|r| shim >= r * f),
            Goal::AtMostRawTimes(f) => raw_or(&|r| shim <= r * f),
            Goal::None => None,
        }
    }
}

/// One figure of the shim next to the same figure of raw Docker, measured in the same run.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// Stable key in `bench.json`.
    pub key: String,
    /// What was measured, for the table.
    pub figure: String,
    /// The unit of `shim` and `raw` (`ms`, `s`, `%`, `tasks/s`, `MiB`, …).
    pub unit: &'static str,
    /// The shim's figure.
    pub shim: f64,
    /// Raw Docker's figure, if there is one.
    pub raw: Option<f64>,
    /// The goal.
    pub goal: Goal,
    /// Samples and anything else worth keeping.
    pub detail: Value,
}

impl Comparison {
    /// A comparison without details.
    pub fn new(
        key: impl Into<String>,
        figure: impl Into<String>,
        unit: &'static str,
        shim: f64,
        raw: Option<f64>,
        goal: Goal,
    ) -> Self {
        Self {
            key: key.into(),
            figure: figure.into(),
            unit,
            shim,
            raw,
            goal,
            detail: Value::Null,
        }
    }

    /// Adds details (samples, counts) to the JSON.
    #[must_use]
    pub fn with_detail(mut self, detail: Value) -> Self {
        self.detail = detail;
        self
    }

    /// shim / raw.
    pub fn ratio(&self) -> Option<f64> {
        self.raw
            .filter(|r| *r != 0.0 && r.is_finite())
            .map(|r| self.shim / r)
    }

    fn value(&self, v: f64) -> String {
        if !v.is_finite() {
            return "—".to_owned();
        }
        let digits = if v.abs() >= 100.0 {
            0
        } else if v.abs() >= 10.0 {
            1
        } else if v.abs() >= 0.1 {
            2
        } else {
            3
        };
        format!("{v:.digits$} {}", self.unit)
    }

    fn cells(&self) -> [String; 5] {
        let met = match self.goal.met(self.shim, self.raw) {
            Some(true) => " (met)",
            Some(false) => " (missed)",
            None => "",
        };
        [
            self.figure.clone(),
            self.value(self.shim),
            self.raw.map_or_else(|| "—".to_owned(), |r| self.value(r)),
            self.ratio()
                .map_or_else(|| "—".to_owned(), |r| format!("{r:.2}×")),
            format!("{}{met}", self.goal.text(self.unit)),
        ]
    }

    /// The JSON of this comparison.
    pub fn json(&self) -> Value {
        let finite = |v: f64| v.is_finite().then_some(v);
        json!({
            "key": self.key,
            "figure": self.figure,
            "unit": self.unit,
            "shim": finite(self.shim),
            "raw": self.raw.and_then(finite),
            "ratio": self.ratio(),
            "goal": self.goal.text(self.unit),
            "goal_met": self.goal.met(self.shim, self.raw),
            "detail": self.detail,
        })
    }
}

/// Prints the comparisons as a Markdown table (the one in `docs/BENCHMARKS.md`).
pub fn print_comparisons(rows: &[Comparison]) {
    println!("\n| figure | shim | raw Docker same run | ratio | goal |");
    println!("|---|---|---|---|---|");
    for row in rows {
        println!("| {} |", row.cells().join(" | "));
    }
}

/// Prints the micro benchmark rows.
pub fn print_rows(rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(0).max(10);
    println!(
        "\n{:<7} {:<width$} {:>5} {:>10} {:>10} {:>10} {:>10}",
        "group", "benchmark", "n", "median", "p90", "p99", "max"
    );
    for row in rows {
        println!(
            "{:<7} {:<width$} {:>5} {:>10} {:>10} {:>10} {:>10}",
            row.group,
            row.name,
            row.n,
            human_us(row.pct[1]),
            human_us(row.pct[2]),
            human_us(row.pct[3]),
            human_us(row.pct[4])
        );
    }
}

/// The JSON of the micro rows.
pub fn rows_json(rows: &[Row]) -> Vec<Value> {
    rows.iter().map(Row::json).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_units_and_goals() {
        let samples = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(
            (
                percentile(&samples, 0),
                median(&samples),
                percentile(&samples, 100)
            ),
            (1.0, 3.0, 5.0)
        );
        assert!(median(&[]).is_nan());
        assert_eq!(human_us(0.41), "410 ns");
        assert_eq!(human_us(28.29), "28.3 µs");
        assert_eq!(human_us(3075.0), "3.08 ms");
        assert_eq!(human_us(2_500_000.0), "2.50 s");

        assert_eq!(Goal::RawPlus(8.0).met(10.0, Some(3.0)), Some(true));
        assert_eq!(Goal::RawPlus(8.0).met(12.0, Some(3.0)), Some(false));
        assert_eq!(Goal::RawPlus(8.0).met(12.0, None), None);
        assert_eq!(Goal::AtLeastRawTimes(0.97).met(9.8, Some(10.0)), Some(true));
        assert_eq!(
            Goal::AtMostRawTimes(1.05).met(10.6, Some(10.0)),
            Some(false)
        );
        assert_eq!(Goal::ExtraAtMost(0.1).met(0.25, Some(0.2)), Some(true));
        assert_eq!(Goal::AtMost(16.0).met(f64::NAN, None), None);

        let c = Comparison::new("k", "fig", "ms", 12.0, Some(4.0), Goal::RawPlus(8.0));
        assert_eq!(c.ratio(), Some(3.0));
        assert_eq!(c.cells()[4], "≤ raw + 8 ms (met)");
        assert_eq!(c.json()["goal_met"], true);

        let row = Row::from_json(
            "g",
            &json!({"name": "x", "n": 3, "min_us": 1.0, "p50_us": 2.0, "p90_us": 3.0,
                    "p99_us": 3.0, "max_us": 3.0}),
        )
        .unwrap();
        assert_eq!(Row::from_json("g", &row.json()).unwrap().pct, row.pct);
    }
}
