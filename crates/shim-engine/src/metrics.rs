//! The engine's own Prometheus metrics ([`crate::Engine::encode_metrics`]).
//!
//! Built on `prometheus-client` (the Prometheus project's Rust client): it has no global
//! registry, so an embedding agent can serve the engine's metrics beside its own, and its
//! types make a label set a Rust type. (The `metrics` facade with its exporter would install a
//! process-wide recorder, which a library should not do.)
//!
//! | metric | type | what |
//! |---|---|---|
//! | `dstack_shim_tasks{status}` | gauge | tasks by status as the API shows it |
//! | `dstack_shim_tasks_submitted` | counter | submits accepted |
//! | `dstack_shim_tasks_terminated{reason}` | counter | terminations (durable) |
//! | `dstack_shim_submit_to_running_seconds` | histogram | submit → `running` visible |
//! | `dstack_shim_exit_to_terminated_seconds` | histogram | the container's exit → `terminated` visible; the exit's time is the `die` event's (dockerd's, a little after the container's `FinishedAt`) or, for an exit found by a list, `FinishedAt` |
//! | `dstack_shim_reconcile_cycle_seconds` | histogram | full reconcile cycles (one list each) |
//! | `dstack_shim_reconcile_last_success_timestamp_seconds` | gauge | the last successful full cycle |
//! | `dstack_shim_reconcile_last_success_age_seconds` | gauge | seconds since then (the readiness signal) |
//! | `dstack_shim_events_connected` | gauge | 1 while Docker's event stream is connected |
//! | `dstack_shim_events_reconnects` | counter | event stream (re)connections |
//! | `dstack_shim_events_received{kind}` | counter | container events handled |
//! | `dstack_shim_docker_requests{op}` | counter | Docker API requests |
//! | `dstack_shim_docker_errors{op,kind}` | counter | failed Docker requests, by error kind |
//! | `dstack_shim_state_write_seconds` | histogram | durable task.json writes (with submit's) |
//! | `dstack_shim_state_write_errors` | counter | failed task.json writes |
//! | `dstack_shim_gpus_locked` / `dstack_shim_gpus_total` | gauge | GPUs held by tasks / on the host |
//! | `dstack_shim_host_key_tasks` | gauge | tasks holding host SSH key lines |
//! | `dstack_shim_volumes_mounted` | gauge | volumes held by tasks |
//! | `dstack_shim_pending_releases` | gauge | terminated tasks still holding something |
//! | `dstack_shim_unwritten_tasks` | gauge | tasks whose last state write failed (retried) |

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use shim_runtime::{
    ContainerDetails, ContainerRuntime, ContainerSpec, ContainerSummary, EventStream, ProgressFn,
    PullProgress, PullRequest, Result as RtResult, RuntimeError,
};
use shim_task::TaskStatus;
use tokio_util::sync::CancellationToken;

use crate::engine::{Inner, now_ms};

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
    pub(crate) write: Histogram,
    pub(crate) write_errors: Counter,
}

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
            write: histogram(),
            write_errors: Counter::default(),
        }
    }

    pub(crate) fn terminated(&self, reason: &str) {
        self.terminated
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub(crate) fn event(&self, kind: &str) {
        self.events_received
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    fn request<T>(&self, op: &str, result: &RtResult<T>) {
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
        }
    }

    /// Registers everything in `registry` (the gauges read the engine at scrape time).
    pub(crate) fn register(self: &Arc<Self>, registry: &mut Registry, inner: Weak<Inner>) {
        let r = registry.sub_registry_with_prefix("dstack_shim");
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
            "state_write_seconds",
            "Durable task.json writes (temp file, fsync, rename, fsync directory)",
            self.write.clone(),
        );
        r.register(
            "state_write_errors",
            "Failed task.json writes (the reconciler retries them)",
            self.write_errors.clone(),
        );
        registry.register_collector(Box::new(State { inner }));
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
            RuntimeError::Cancelled { .. } => "cancelled",
            RuntimeError::PullFailed { .. } => "pull_failed",
            RuntimeError::Daemon { .. } => "daemon",
            _ => "other",
        }
    }
}

/// Gauges read at scrape time.
#[derive(Debug)]
struct State {
    inner: Weak<Inner>,
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    let m = encoder.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

impl Collector for State {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(inner) = self.inner.upgrade() else {
            return Ok(());
        };
        let statuses = [
            TaskStatus::Pending,
            TaskStatus::Preparing,
            TaskStatus::Pulling,
            TaskStatus::Creating,
            TaskStatus::Running,
            TaskStatus::Terminated,
        ];
        let mut by_status = [0u64; 6];
        let (mut keys, mut volumes, mut pending, mut unwritten) = (0u64, 0u64, 0u64, 0u64);
        for slot in inner.slots() {
            let t = slot.lock();
            if let Some(i) = statuses.iter().position(|s| *s == t.status()) {
                by_status[i] += 1;
            }
            let r = &t.record().resources;
            if r.host_keys.is_some() {
                keys += 1;
            }
            volumes += r.volumes.len() as u64;
            if t.record().status == TaskStatus::Terminated && r.holds_any() {
                pending += 1;
            }
            if t.is_dirty() && !t.is_progress_only() {
                unwritten += 1;
            }
        }
        {
            let family: Family<StatusLabels, prometheus_client::metrics::gauge::Gauge> =
                Family::default();
            for (s, n) in statuses.iter().zip(by_status) {
                family
                    .get_or_create(&StatusLabels {
                        status: s.as_str().to_owned(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            let m = encoder.encode_descriptor(
                "dstack_shim_tasks",
                "Tasks by status as the API shows it",
                None,
                family.metric_type(),
            )?;
            family.encode(m)?;
        }
        gauge(
            &mut encoder,
            "dstack_shim_gpus_locked",
            "GPUs held by tasks",
            inner.gpus.locked().len() as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_gpus_total",
            "GPUs on the host",
            inner.deps.host_gpus.gpus.len() as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_host_key_tasks",
            "Tasks holding host SSH key lines",
            keys as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_volumes_mounted",
            "Volumes held by tasks",
            volumes as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_pending_releases",
            "Terminated tasks still holding something (released by the reconciler)",
            pending as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_unwritten_tasks",
            "Tasks whose last state write failed (retried by the reconciler)",
            unwritten as f64,
        )?;
        gauge(
            &mut encoder,
            "dstack_shim_events_connected",
            "1 while Docker's event stream is connected",
            if inner
                .events_connected
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                1.0
            } else {
                0.0
            },
        )?;
        if let Some(last) = inner.last_cycle() {
            gauge(
                &mut encoder,
                "dstack_shim_reconcile_last_success_timestamp_seconds",
                "Unix time of the last successful full reconcile cycle",
                last as f64 / 1000.0,
            )?;
            gauge(
                &mut encoder,
                "dstack_shim_reconcile_last_success_age_seconds",
                "Seconds since the last successful full reconcile cycle",
                now_ms().saturating_sub(last) as f64 / 1000.0,
            )?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

/// A [`ContainerRuntime`] that counts every request and its errors.
pub(crate) struct Metered {
    pub(crate) runtime: Arc<dyn ContainerRuntime>,
    pub(crate) metrics: Arc<Metrics>,
}

impl Metered {
    fn count<T>(&self, op: &str, result: RtResult<T>) -> RtResult<T> {
        self.metrics.request(op, &result);
        result
    }
}

#[async_trait]
impl ContainerRuntime for Metered {
    async fn image_present(&self, image: &str) -> RtResult<bool> {
        self.count("image_present", self.runtime.image_present(image).await)
    }

    async fn pull(
        &self,
        request: &PullRequest,
        progress: ProgressFn<'_>,
        cancel: CancellationToken,
    ) -> RtResult<PullProgress> {
        self.count("pull", self.runtime.pull(request, progress, cancel).await)
    }

    async fn create(&self, spec: &ContainerSpec) -> RtResult<String> {
        self.count("create", self.runtime.create(spec).await)
    }

    async fn start(&self, id: &str) -> RtResult<()> {
        self.count("start", self.runtime.start(id).await)
    }

    async fn inspect(&self, id_or_name: &str) -> RtResult<ContainerDetails> {
        self.count("inspect", self.runtime.inspect(id_or_name).await)
    }

    async fn list(&self, labels: &[(String, String)]) -> RtResult<Vec<ContainerSummary>> {
        self.count("list", self.runtime.list(labels).await)
    }

    async fn stop(&self, id: &str, timeout: Duration) -> RtResult<()> {
        self.count("stop", self.runtime.stop(id, timeout).await)
    }

    async fn remove(&self, id: &str) -> RtResult<()> {
        self.count("remove", self.runtime.remove(id).await)
    }

    async fn logs_tail(&self, id: &str, n: usize) -> RtResult<Vec<String>> {
        self.count("logs", self.runtime.logs_tail(id, n).await)
    }

    async fn events(
        &self,
        labels: &[(String, String)],
        since_ns: Option<i64>,
    ) -> RtResult<EventStream> {
        self.count("events", self.runtime.events(labels, since_ns).await)
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
