//! The engine's counters and histograms (prometheus-client types, cheap to share): moved by
//! the driver, the reconciler and the metered runtime, registered and documented in
//! [`crate::metrics`].

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use shim_runtime::{Result as RtResult, RuntimeError};

/// The prefix of every metric of the engine.
pub(crate) const PREFIX: &str = "dstack_shim";

/// Latency buckets (seconds): 1 ms to ~30 s.
fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
    ]
    .into_iter()
}

fn histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpKindLabels {
    op: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    reason: String,
}

/// The engine's metrics (shared by the engine's parts).
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) submitted: Counter,
    pub(crate) terminated: Family<ReasonLabels, Counter>,
    pub(crate) submit_to_running: Histogram,
    pub(crate) exit_to_terminated: Histogram,
    pub(crate) cycle: Histogram,
    pub(crate) events_received: Family<KindLabels, Counter>,
    pub(crate) events_reconnects: Counter,
    docker_requests: Family<OpLabels, Counter>,
    docker_errors: Family<OpKindLabels, Counter>,
    pull_stalls: Counter,
    pub(crate) write: Histogram,
    pub(crate) write_errors: Counter,
    /// The reasons that have a label value of their own ([`Metrics::reason_label`]).
    reasons: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// How many distinct termination reasons get a label value of their own (dstack's server
/// knows 21).
const REASON_LABELS_MAX: usize = 64;

impl Metrics {
    pub(crate) fn new() -> Self {
        Self {
            submitted: Counter::default(),
            terminated: Family::default(),
            submit_to_running: histogram(),
            exit_to_terminated: histogram(),
            cycle: histogram(),
            events_received: Family::default(),
            events_reconnects: Counter::default(),
            docker_requests: Family::default(),
            docker_errors: Family::default(),
            pull_stalls: Counter::default(),
            write: histogram(),
            write_errors: Counter::default(),
            reasons: std::sync::Mutex::default(),
        }
    }

    pub(crate) fn terminated(&self, reason: &str) {
        let reason = self.reason_label(reason);
        self.terminated
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// The `reason` label of a termination. A terminate's reason is the server's free text
    /// (upstream keeps any string), and each label value is a series kept for the life of the
    /// process: a reason shaped as the server's (lowercase letters, digits and `_`, at most
    /// 64 bytes) is its own value while fewer than [`REASON_LABELS_MAX`] have been seen;
    /// anything else is `other`.
    fn reason_label(&self, reason: &str) -> String {
        let token = !reason.is_empty()
            && reason.len() <= 64
            && reason
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if token {
            let mut seen = self.reasons.lock().unwrap_or_else(|p| p.into_inner());
            if seen.contains(reason)
                || seen.len() < REASON_LABELS_MAX && seen.insert(reason.to_owned())
            {
                return reason.to_owned();
            }
        }
        "other".to_owned()
    }

    pub(crate) fn event(&self, kind: &str) {
        self.events_received
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    pub(crate) fn request<T>(&self, op: &str, result: &RtResult<T>) {
        self.docker_requests
            .get_or_create(&OpLabels { op: op.to_owned() })
            .inc();
        if let Err(e) = result {
            self.docker_errors
                .get_or_create(&OpKindLabels {
                    op: op.to_owned(),
                    kind: error_kind(e).to_owned(),
                })
                .inc();
            if matches!(e, RuntimeError::PullStalled { .. }) {
                self.pull_stalls.inc();
            }
        }
    }

    /// Registers the counters and histograms in `registry` (under the `dstack_shim` prefix);
    /// the gauges read at scrape time are [`crate::metrics`]' collector.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix(PREFIX);
        r.register(
            "tasks_submitted",
            "Submits accepted",
            self.submitted.clone(),
        );
        r.register(
            "tasks_terminated",
            "Terminations made durable, by reason",
            self.terminated.clone(),
        );
        r.register(
            "submit_to_running_seconds",
            "From submit to `running` shown by the API",
            self.submit_to_running.clone(),
        );
        r.register(
            "exit_to_terminated_seconds",
            "From the container's exit (the die event's time, or FinishedAt when found by a list) to `terminated` shown by the API",
            self.exit_to_terminated.clone(),
        );
        r.register(
            "reconcile_cycle_seconds",
            "Full reconcile cycles (one container list each)",
            self.cycle.clone(),
        );
        r.register(
            "events_received",
            "Container events handled, by kind",
            self.events_received.clone(),
        );
        r.register(
            "events_reconnects",
            "Connections of Docker's event stream",
            self.events_reconnects.clone(),
        );
        r.register(
            "docker_requests",
            "Docker API requests, by operation",
            self.docker_requests.clone(),
        );
        r.register(
            "docker_errors",
            "Failed Docker API requests, by operation and error kind",
            self.docker_errors.clone(),
        );
        r.register(
            "pull_stalls",
            "Image pulls failed because the engine sent no progress for the stall timeout (--pull-stall-timeout)",
            self.pull_stalls.clone(),
        );
        r.register(
            "state_write_seconds",
            "Durable task.json writes (temp file, fsync, rename, fsync directory)",
            self.write.clone(),
        );
        r.register(
            "state_write_errors",
            "Failed task.json writes (the reconciler retries them)",
            self.write_errors.clone(),
        );
    }
}

/// A runtime error's kind, as a label.
fn error_kind(e: &RuntimeError) -> &'static str {
    if e.is_not_found() {
        "not_found"
    } else if e.is_unavailable() {
        "unavailable"
    } else {
        match e {
            RuntimeError::Conflict { .. } => "conflict",
            RuntimeError::PullTimeout { .. } => "timeout",
            RuntimeError::PullStalled { .. } => "stalled",
            RuntimeError::Cancelled { .. } => "cancelled",
            RuntimeError::PullFailed { .. } => "pull_failed",
            RuntimeError::Daemon { .. } => "daemon",
            _ => "other",
        }
    }
}

/// Times a durable write.
pub(crate) struct WriteTimer(Instant);

impl WriteTimer {
    pub(crate) fn start() -> Self {
        Self(Instant::now())
    }

    pub(crate) fn done(self, metrics: &Metrics, ok: bool) {
        metrics.write.observe(self.0.elapsed().as_secs_f64());
        if !ok {
            metrics.write_errors.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A terminate's reason is the server's free text: a reason shaped as the server's is its
    /// own label value, up to a bound; free text, and reasons past the bound, count as
    /// `other`, so no terminate makes the metrics grow without end.
    #[test]
    fn termination_reasons_make_a_bounded_set_of_series() {
        let metrics = Metrics::new();
        metrics.terminated("done_by_runner");
        metrics.terminated("a reason\nwith \"quotes\" and lines");
        for i in 0..200 {
            metrics.terminated(&format!("reason_{i}"));
        }
        metrics.terminated("done_by_runner");
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("dstack_shim_tasks_terminated_total{"))
            .collect();
        assert_eq!(series.len(), REASON_LABELS_MAX + 1, "{series:?}");
        assert!(
            series.contains(&r#"dstack_shim_tasks_terminated_total{reason="done_by_runner"} 2"#)
        );
        // done_by_runner and reason_0 … reason_62 have their own; the rest are other.
        let others = 200 - (REASON_LABELS_MAX - 1) + 1;
        let others = format!(r#"dstack_shim_tasks_terminated_total{{reason="other"}} {others}"#);
        assert!(series.contains(&others.as_str()), "{series:?}");
    }
}
